"""Two ways a serving engine calls a kernel that single calls from one thread never show.

guard:grown_inputs  integer inputs grown in place between calls, as an engine grows seq_lens and
                    appends pages to block tables between decode steps (in persistent, graph-captured
                    buffers): the candidate must read the new values, not a plan cached for the old.
guard:host_threads  two host threads calling at once, each on tensors of its own (two engine workers
                    in one process): each must get the bits it gets alone.
"""
from __future__ import annotations

import threading

import torch

from verify.judge.calls import Placed, collect, one_line
from verify.judge.guards.refresh import stale_or_wrong
from verify.model.opdef import OpDef, OpInputs
from verify.model.verdict import Check

THREAD_ROUNDS = 40          # calls per thread in guard:host_threads, at least
THREAD_SECONDS = 2.0        # and more rounds (up to MAX_THREAD_ROUNDS) while they take less than this
MAX_THREAD_ROUNDS = 400     # (a race in a microsecond-long call needs hundreds of tries to show)


def grown_inputs(ctx) -> list[Check]:
    """guard:grown_inputs: call once, grow the integer inputs in place (through .data: no version bump,
    as a graph replay's copies write), call again on the same tensors, judge the second result against
    the reference on the grown inputs. Only for ops whose entry says how an engine grows them
    (OpDef.grow_inputs)."""
    name, op, fn, inputs, device = "guard:grown_inputs", ctx.op, ctx.fn, ctx.inputs, ctx.device
    grown = op.grow_inputs(inputs) if op.grow_inputs is not None else None
    if grown is None:
        return []
    inputs2 = OpInputs({**inputs.tensors, **grown}, dict(inputs.params))
    judged = ctx.judged_on(inputs2, ("grown",))
    if judged is None:
        return [Check(name, True, "not run: the grown case is vacuous")]
    inputs64_2, oracle2, base2 = judged
    placed = Placed(fn, op, inputs, base2, device)
    try:
        placed.call(fn, inputs.params)
        for k, t in grown.items():
            placed.inputs[k].view.data.copy_(t.to(device))
        for s in op.state:
            placed.inputs[s].view.data.copy_(inputs.tensors[s].to(device))
        returned = placed.call(fn, inputs2.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return [Check(name, False, f"a call after {', '.join(grown)} grew in place raised {one_line(e)}")]
    results, out_checks = placed.outputs(returned)
    bad = [c for c in out_checks + placed.unwritten(results) if not c.ok]
    if not bad:
        bad = [c for c in ctx.judge(results, oracle2, base2, inputs2, inputs64_2) if not c.ok]
    if bad:
        return [stale_or_wrong(ctx, name, inputs2, judged, bad,
                               f"{', '.join(grown)} grown in place after a first call (an engine's next step)",
                               f"the grown {', '.join(grown)}")]
    return [Check(name, True, f"{', '.join(grown)} grown in place after a first call: judged like a first call")]


def _plain_call(fn, op: OpDef, tensors: dict, params: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in collect(op, fn(**tensors, **params), tensors).items()}


def host_threads(ctx) -> list[Check]:
    """guard:host_threads: two threads, each on tensors of its own (this case's values and another
    case's of the same shapes), call the candidate THREAD_ROUNDS times at once (a barrier starts each
    round together); every result must be the bits that thread's values give in a call alone (judged
    within tolerance where the candidate is not held to bitwise claims). State is reset before each
    call. On the cases the plan marks (with guard:warmed_up), outside the quick profile."""
    found = ctx.refreshed() if ctx.warmup and ctx.strided_run else None
    if found is None:
        return []
    return [_host_threads(ctx, found)]


def _host_threads(ctx, found) -> Check:
    op, spec, fn, inputs, other, device, strict = ctx.op, ctx.spec, ctx.fn, ctx.inputs, found[1], ctx.device, ctx.strict
    name = "guard:host_threads"
    sets = [{k: v.to(device).clone() for k, v in x.tensors.items()} for x in (inputs, other)]
    params = [inputs.params, other.params]
    states = [{s: t[s].clone() for s in op.state} for t in sets]
    try:
        alone = []
        for i in range(2):
            for s in op.state:
                sets[i][s].copy_(states[i][s])
            alone.append(_plain_call(fn, op, sets[i], params[i]))
    except Exception as e:  # noqa: BLE001  (the candidate's failure: other guards report it)
        return Check(name, True, f"not run: a call alone raised {type(e).__name__}")
    import sys
    import time

    barrier, got, errors = threading.Barrier(2), [[], []], []
    deadline, go_on = time.monotonic() + THREAD_SECONDS, [True]

    def work(i: int) -> None:
        try:
            for r in range(MAX_THREAD_ROUNDS):
                barrier.wait()
                if i == 0:              # one decision for both threads: they stop together
                    go_on[0] = r < THREAD_ROUNDS or time.monotonic() < deadline
                barrier.wait()
                if not go_on[0]:
                    break
                for s in op.state:
                    sets[i][s].copy_(states[i][s])
                got[i].append(_plain_call(fn, op, sets[i], params[i]))
        except threading.BrokenBarrierError:
            pass
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {i}: {type(e).__name__}: {e}")
            barrier.abort()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)          # hand the GIL over often: the threads' Python steps interleave
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    if errors:
        return Check(name, False, f"two threads calling at once: {errors[0][:300]}")
    from verify.judge import compare

    for i, values in enumerate((inputs, other)):
        for r, res in enumerate(got[i]):
            if spec.claims.deterministic and strict:
                bad = [c for n, want in alone[i].items() if not (c := compare.compare_bitwise(n, res[n], want)).ok]
            else:                     # not held to bits (the CPU-BLAS stand-ins): judged like a first call
                judged = ctx.judged_on(values, ("threads", i))
                bad = [] if judged is None else \
                    [c for c in ctx.judge(res, judged[1], judged[2], values, judged[0]) if not c.ok]
            if bad:
                return Check(name, False, f"two host threads calling at once, each on its own tensors: round "
                             f"{r + 1} of thread {i}: {bad[0].name}: {bad[0].detail} (state shared across calls: "
                             "a workspace, an output buffer?)", bad[0].metrics, bad[0].worst)
    return Check(name, True, f"two host threads x {min(map(len, got))} calls at once: each got its own bits")
