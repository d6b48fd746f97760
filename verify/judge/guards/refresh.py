"""Guards with new values in old buffers: guard:refreshed_inputs (another case's values written into
the same tensors after a first call) and guard:warmed_up (WARMUP_CALLS calls of one shape, then new
values). A candidate that keeps anything across calls keyed by pointer, shape or call count
(prepacked weights, a memo of outputs, a graph captured after N calls) answers for old values."""
from __future__ import annotations

from verify.judge.calls import Placed, guarded_call, one_line
from verify.judge import placement
from verify.model.opdef import OpInputs
from verify.model.verdict import Check

WARMUP_CALLS = 100       # calls of one shape before guard:warmed_up judges the next


def refreshed_inputs(ctx) -> list[Check]:
    """guard:refreshed_inputs: call once, write another case's values into the same input (and
    state) tensors, in place, at the same addresses, and call again. The second result is judged
    against the reference on the new values."""
    name = "guard:refreshed_inputs"
    found = ctx.refreshed()
    if found is None:
        return [Check(name, True, "not run: no other values with this case's shapes could be drawn")]
    seed2, inputs2 = found
    where = f"seed {seed2}" if seed2 is not None else "this case's float inputs rescaled"
    judged = ctx.judged_on(inputs2, ("refreshed",))
    if judged is None:
        return [Check(name, True, "not run: the other seed's case is vacuous")]
    inputs64_2, oracle2, base2 = judged
    placed = Placed(ctx.fn, ctx.op, ctx.dinputs, base2, ctx.device)
    new = ctx.on_device(inputs2)
    try:
        placed.call(ctx.fn, ctx.inputs.params)
        for k, g in placed.inputs.items():     # through .data: no _version bump, as a graph replay,
            g.view.data.copy_(new.tensors[k])  # a DLPack or IPC alias writes
        for g in placed.outs.values():
            g.view.fill_(placement.poison_value(g.view.dtype))
        returned = placed.call(ctx.fn, inputs2.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return [Check(name, False, f"a call with new values in the same buffers raised {one_line(e)}")]
    results, out_checks = placed.outputs(returned)
    bad = [c for c in out_checks + placed.unwritten(results) if not c.ok]
    if not bad:
        bad = [c for c in ctx.judge(results, oracle2, base2, inputs2, inputs64_2) if not c.ok]
    if bad:
        return [stale_or_wrong(ctx, name, inputs2, judged, bad,
                               f"new values ({where}) written into the same input buffers, in place, after a first call",
                               f"the values of {where} (same shapes; drawn by the refreshed-inputs run)")]
    return [Check(name, True, "new values in the same buffers judged like a first call")]


def stale_or_wrong(ctx, name: str, values: OpInputs, judged, bad: list[Check], later: str, values_are: str) -> Check:
    """A later call failed (`bad`) on `values` (judged: ctx.judged_on(values)): stale state, or simply
    wrong on these values? A first call on them in fresh buffers tells which. `later` says what the
    failed call was, `values_are` what the values are."""
    inputs64_2, oracle2, base2 = judged
    fresh = guarded_call(ctx.fn, ctx.op, ctx.on_device(values), base2, ctx.device)
    fresh_ok = not fresh.error and all(c.ok for c in fresh.checks)
    if fresh_ok:
        plain = [c for c in ctx.judge(fresh.results, oracle2, base2, values, inputs64_2) if not c.ok]
        if plain:
            return Check(plain[0].name, False, f"on {values_are}, in fresh buffers too: {plain[0].detail}",
                         plain[0].metrics, plain[0].worst)
    return Check(name, False, f"{later}: " + "; ".join(f"{c.name}: {c.detail}" for c in bad)
                 + (" (the same values in fresh buffers pass)" if fresh_ok else ""))


def warmed_up(ctx) -> list[Check]:
    """guard:warmed_up: WARMUP_CALLS calls of one shape, then a call on other values in fresh buffers,
    judged. A case calls the candidate a dozen times, but a serving process calls it millions: a
    wrapper that captures a CUDA graph, swaps in an autotuned variant or caches a plan after N calls
    of a shape is judged only if N is reached. On the cases the plan marks (a cost of WARMUP_CALLS
    calls each); a counter above WARMUP_CALLS still goes unseen."""
    name = "guard:warmed_up"
    found = ctx.refreshed() if ctx.warmup else None
    if found is None:
        return []
    inputs2 = found[1]
    judged = ctx.judged_on(inputs2, ("refreshed",))
    if judged is None:
        return [Check(name, True, "not run: the other values' case is vacuous")]
    inputs64_2, oracle2, base2 = judged
    placed = Placed(ctx.fn, ctx.op, ctx.dinputs, base2, ctx.device)   # the case's shapes: one set of buffers
    try:
        for _ in range(WARMUP_CALLS):
            for s in ctx.op.state:                        # each call from the case's state (a layer's cache
                placed.inputs[s].view.copy_(ctx.dinputs.tensors[s])   # fills up over 100 decode steps)
            placed.call(ctx.fn, ctx.dinputs.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return [Check(name, False, f"one of {WARMUP_CALLS} calls of the same shape raised {one_line(e)}")]
    after = guarded_call(ctx.fn, ctx.op, ctx.on_device(inputs2), base2, ctx.device)
    if after.error:
        return [Check(name, False, f"after {WARMUP_CALLS} calls of the same shape, a call raised {after.error}")]
    bad = [c for c in after.checks if not c.ok]
    bad = bad or [c for c in ctx.judge(after.results, oracle2, base2, inputs2, inputs64_2) if not c.ok]
    if bad:
        return [Check(name, False, f"after {WARMUP_CALLS} calls of the same shape, a call on new values in fresh "
                      f"buffers: {bad[0].name}: {bad[0].detail}", bad[0].metrics, bad[0].worst)]
    return [Check(name, True, f"judged like a first call after {WARMUP_CALLS} calls of the same shape")]
