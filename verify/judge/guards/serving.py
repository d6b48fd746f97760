"""Guards for the ways a serving engine calls a kernel that one plain call does not
(property_tests/planted/serving.py plants a bug for each):

- guard:partial_refresh: new values written into the interior rows of the inputs only (a weight sync
  streamed in row chunks, one expert reloaded): a memo validated by a fingerprint of some rows, or
  keyed by anything the partial write leaves alone, answers for the old values;
- guard:state_chain: the next call fed the state the previous call wrote, in the same buffers, with
  new step inputs (a decode step): a kernel that keeps a shadow of the state it wrote and trusts it
  when the same bits come back misses what happened to the state in between (a block write);
- guard:out_omitted: a candidate that takes out= called without it (its allocating path);
- guard:owned_inputs: inputs that own their whole storage, with no canary buffer around them (how an
  engine's own allocations look): a kernel that takes such an input for a dead temporary writes into it;
- guard:thread_count: the call at another intra-op thread count (a host split over the threads that
  drops a remainder is exact wherever the count divides the work);
- guard:merged_inputs: inputs of one dtype and leading dims as adjacent column slices of one buffer,
  rows closed by a few spare elements (a merged projection's output, kda_in_proj's q|k|v|g|...): a
  fast path for adjacent slices that assumes the row stride is the sum of their widths reads other
  rows. A refusal that names contiguity or strides is a stated contract, as for strided views.

Each later call must give the first call's results (bitwise where the spec claims determinism and the
candidate is held to its claims) or, for new values, pass the comparison against the reference on them.
"""
from __future__ import annotations

import torch

from verify.judge.calls import Placed, call_failures, guarded_call, one_line
from verify.judge import placement as guards
from verify.judge.guards.refresh import stale_or_wrong
from verify.model.opdef import OpDef, OpInputs
from verify.model.verdict import Check

INDEX_DTYPES = (torch.int32, torch.int64)     # indices and lengths: a row-wise mix of two draws is no valid case
OTHER_THREADS = (3, 5)                       # thread counts that divide no power-of-two work split


def _mixed(op: OpDef, first: OpInputs, other: OpInputs) -> tuple[OpInputs, list[str]]:
    """first's values with the interior rows (dim 0, all but the first and last) of every tensor of 3 or
    more rows taken from other; index tensors kept. Returns the mix and the names changed."""
    tensors, changed = {}, []
    for k, v in first.tensors.items():
        v2 = other.tensors[k]
        if v.dim() >= 1 and v.shape[0] >= 3 and v.dtype not in INDEX_DTYPES and not torch.equal(v[1:-1], v2[1:-1]):
            v = v.clone()
            v[1:-1] = v2[1:-1]
            changed.append(k)
        tensors[k] = v
    return OpInputs(tensors, dict(first.params)), changed


def _second_call(ctx, name, placed: Placed, values: OpInputs, judged, where: str) -> Check:
    """Call again on what `placed` now holds (`values`), outputs poisoned; judge against `judged`."""
    inputs64_2, oracle2, base2 = judged
    placed.expected = base2                   # what poison is read against: these values' reference
    for g in placed.outs.values():
        g.view.fill_(guards.poison_value(g.view.dtype))
    try:
        returned = placed.call(ctx.fn, values.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return Check(name, False, f"{where}: the call raised {one_line(e)}")
    results, out_checks = placed.outputs(returned)
    bad = [c for c in out_checks + placed.unwritten(results) if not c.ok]
    bad = bad or [c for c in ctx.judge(results, oracle2, base2, values, inputs64_2) if not c.ok]
    if bad:
        return stale_or_wrong(ctx, name, values, judged, bad, where, where)
    return Check(name, True, f"{where}: judged like a first call")


def partial_refresh(ctx) -> list[Check]:
    """guard:partial_refresh (module doc)."""
    name, op, found = "guard:partial_refresh", ctx.op, ctx.refreshed()
    if found is None:
        return [Check(name, True, "not run: no other values with this case's shapes could be drawn")]
    mixed, changed = ctx.memoised(("mixed",), lambda: _mixed(op, ctx.inputs, found[1]))
    if not changed:
        return [Check(name, True, "not run: no tensor of 3 or more rows to rewrite in part")]
    judged = ctx.judged_on(mixed, ("mixed",))
    if judged is None:
        return [Check(name, True, "not run: the partly rewritten case is vacuous")]
    placed = Placed(ctx.fn, op, ctx.dinputs, judged[2], ctx.device)
    try:
        placed.call(ctx.fn, ctx.inputs.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return [Check(name, False, f"the first call raised {one_line(e)}")]
    new = ctx.on_device(mixed)
    for k, g in placed.inputs.items():
        if k in op.state:                      # the first call moved the state: the mix's, whole
            g.view.data.copy_(new.tensors[k])
        elif k in changed:                     # rows 1..n-2 only, as a streamed weight sync writes
            g.view.data[1:-1].copy_(new.tensors[k][1:-1])
    return [_second_call(ctx, name, placed, mixed, judged,
                         f"new values written into rows 1..n-2 of {', '.join(changed)} after a first call")]


def state_chain(ctx) -> list[Check]:
    """guard:state_chain (module doc): the second call's reference runs from the state the candidate's
    first call wrote, so the step is judged alone."""
    name, op, found = "guard:state_chain", ctx.op, ctx.refreshed()
    if not op.state:
        return [Check(name, True, "not run: the op keeps no state")]
    if found is None:
        return [Check(name, True, "not run: no other step inputs with this case's shapes could be drawn")]
    step2 = found[1]
    placed = Placed(ctx.fn, op, ctx.dinputs, ctx.base, ctx.device)
    try:
        placed.call(ctx.fn, ctx.inputs.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return [Check(name, False, f"the first call raised {one_line(e)}")]
    chained = OpInputs({k: placed.inputs[k].view.detach().cpu().clone() if k in op.state else step2.tensors[k]
                        for k in ctx.inputs.tensors}, dict(step2.params))
    try:
        judged = ctx.judged_on(chained)        # the chained state is this launch's own: not memoised
    except (ValueError, RuntimeError, IndexError) as e:    # a step the reference refuses (a full cache)
        return [Check(name, True, f"not run: the reference refuses the chained step ({one_line(e)})")]
    if judged is None:
        return [Check(name, True, "not run: the chained step is vacuous")]
    for k, g in placed.inputs.items():
        if k not in op.state:
            g.view.copy_(ctx.on_device(step2).tensors[k])
    return [_second_call(ctx, name, placed, chained, judged,
                         "a second step on the state the first call wrote, in the same buffers")]


def call_forms(ctx) -> list[Check]:
    """guard:out_omitted, guard:owned_inputs, guard:merged_inputs and guard:thread_count (module doc):
    each must give the first call's results. Not in the quick profile (with the strided runs)."""
    if not ctx.strided_run:
        return []
    checks = []
    if ctx.op.outputs and guards.accepts_out(ctx.fn):
        checks += _form_run(ctx, "guard:out_omitted", "a call without out=", use_out=False)
    checks += _form_run(ctx, "guard:owned_inputs", "inputs that own their whole storage", owned=True)
    if guards.merge_groups(ctx.dinputs.tensors, ctx.op.state):
        checks += _form_run(ctx, "guard:merged_inputs", "inputs side by side in one buffer (a merged projection's "
                            "output)", refusals=("contiguous", "stride"), merged=True)
    prev = torch.get_num_threads()
    threads = OTHER_THREADS[0] if prev != OTHER_THREADS[0] else OTHER_THREADS[1]
    torch.set_num_threads(threads)
    try:
        checks += _form_run(ctx, "guard:thread_count", f"{threads} intra-op threads (the process runs {prev})")
    finally:
        torch.set_num_threads(prev)
    return checks


def _form_run(ctx, name, where, refusals: tuple[str, ...] = (), **call) -> list[Check]:
    run = guarded_call(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.device, **call)
    checks, complete = call_failures(run, ctx.first, where)
    if run.error and not checks and any(w in run.error.lower() for w in refusals):
        return [Check(name, True, f"{where}: refused: {run.error}")]
    if run.error:
        return checks + [Check(name, False, f"{where}: raised {run.error}")]
    if not complete:
        return checks + [Check(name, False, f"{where}: the outputs are incomplete")]
    return checks + [ctx.same_as_first(name, where, run.results)]
