"""GPU-only guards: the candidate launched on a side stream and captured in a CUDA graph must give
the same bits as a plain launch (a kernel that ignores the caller's stream, or allocates, syncs or
reads host state during capture, fails here); its work must be ordered on the caller's stream
(`stream_order_check`); and two of its calls in flight at once on two streams must each give their
own bits (`concurrent_check`)."""
from __future__ import annotations

import torch

from verify.judge.calls import Placed, guarded_call, one_line, run_plain
from verify.model.opdef import OpInputs
from verify.model.verdict import Check

SLEEP_CYCLES = 50_000_000      # ~25-30 ms of the caller's stream at H100/H200 clocks


def _same(a: dict, b: dict) -> list[str]:
    from verify.judge.compare import compare_bitwise

    return [n for n in a if not compare_bitwise(n, b[n], a[n]).ok]


def side_stream_check(fn, op, inputs, base, first: dict, device) -> Check:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        res = guarded_call(fn, op, inputs, base, device)
    torch.cuda.synchronize()
    if res.error:
        return Check("guard:side_stream", False, f"launch on a side stream raised {res.error}")
    diff = _same(first, res.results)
    return Check("guard:side_stream", not diff, f"side-stream launch differs: {', '.join(diff)}" if diff
                 else "side-stream launch bitwise identical")


def cuda_graph_check(fn, op, inputs, first: dict, device) -> Check:
    """Capture one call in a CUDA graph (after a warm-up that compiles), replay it on fresh inputs."""
    tensors = {k: v.to(device).clone() for k, v in inputs.tensors.items()}
    pristine = {k: v.clone() for k, v in tensors.items()}
    try:
        fn(**{k: v.clone() for k, v in tensors.items()}, **inputs.params)      # warm-up: compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            out = fn(**tensors, **inputs.params)
        for k in tensors:                                      # capture does not run; reset state anyway
            tensors[k].copy_(pristine[k])
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:
        return Check("guard:cuda_graph", False, f"capture or replay failed: {type(e).__name__}: {str(e)[:200]}")
    names = op.outputs
    got = () if not names else ((out,) if len(names) == 1 and not isinstance(out, (tuple, list)) else tuple(out))
    results = dict(zip(names, got))
    results.update({s_: tensors[s_] for s_ in op.state})
    diff = _same(first, results)
    return Check("guard:cuda_graph", not diff, f"graph replay differs: {', '.join(diff)}" if diff
                 else "graph replay bitwise identical")


def stream_order_check(fn, op, dinputs: OpInputs, other: OpInputs, base: dict, first: dict, device) -> Check:
    """guard:stream_order: the input (and state) tensors hold another case's values (same shapes)
    until the caller's stream, a non-blocking side stream kept busy ~30 ms, writes this case's
    values into them; the candidate is called on that stream right after. Work the candidate
    launches anywhere else (the legacy default stream, a stream of its own, a host thread) runs
    before the values arrive and answers for the other ones; with no device-wide synchronize
    in between, the plain guarded calls could not see it."""
    name = "guard:stream_order"
    placed = Placed(fn, op, other, base, device)            # the other values, on the current stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for k, g in placed.inputs.items():
                g.view.copy_(dinputs.tensors[k])             # ordered after the sleep, on `side`
            returned = placed.call(fn, dinputs.params)
    except Exception as e:
        return Check(name, False, f"a call on a busy caller's stream raised {one_line(e)}")
    results, checks = placed.outputs(returned)
    bad = [c for c in checks + placed.unwritten(results) if not c.ok]
    if bad:
        return Check(name, False, "on a busy caller's stream: " + "; ".join(f"{c.name}: {c.detail}" for c in bad))
    diff = _same(first, results)
    return Check(name, not diff, f"{', '.join(diff)} differ when the caller's stream is busy: work not "
                 "ordered on the caller's stream read the inputs before they were written" if diff
                 else "work ordered on the caller's stream")


CONCURRENT_ROUNDS = 3


def concurrent_check(fn, op, dinputs: OpInputs, other: OpInputs, base: dict, first: dict, device, reference) -> Check:
    """guard:concurrent: two calls in flight at once, each on tensors of its own: this case's values
    on a low-priority stream, another case's (same shapes) on a high-priority one, both held back by
    equal sleeps so they start together, in CONCURRENT_ROUNDS rounds with the second start moved a
    little later each round. Each must give the bits it gives alone. A decode layer runs the shared
    expert on a side stream beside the routed ones: a candidate that keeps one workspace, counter or
    output buffer for every call (not one per stream or per call) mixes the two calls' data here,
    while sequential calls, a single side-stream call and a graph replay all pass; one whose CTAs
    spin on other CTAs of the same launch can deadlock when the other launch holds SMs (the
    per-case timeout reports that when candidates run isolated, the default)."""
    name = "guard:concurrent"
    # The other call is held to the other values' own reference: a hole (poison left in an output)
    # is NaN where that reference is finite, and the other values may give NaN where this case's
    # do not (an E8M0 scale of 0xFF, say).
    base2 = run_plain(reference, op, other, device)
    alone = guarded_call(fn, op, other, base2, device)           # the other values' own bits, sequential
    if alone.error:
        return Check(name, False, f"a call on another case's values raised {alone.error}")
    second = {k: v.clone() for k, v in alone.results.items()}
    cur = torch.cuda.current_stream()
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    for r in range(CONCURRENT_ROUNDS):
        a = Placed(fn, op, dinputs, base, device)
        b = Placed(fn, op, other, base2, device)
        low.wait_stream(cur)
        high.wait_stream(cur)
        try:
            with torch.cuda.stream(low):
                torch.cuda._sleep(SLEEP_CYCLES // 10)
                ret_a = a.launch(fn, dinputs.params)
            with torch.cuda.stream(high):
                torch.cuda._sleep(SLEEP_CYCLES // 10 + r * 20_000)      # 0, ~10, ~20 us later
                ret_b = b.launch(fn, other.params)
            torch.cuda.synchronize()
        except Exception as e:
            return Check(name, False, f"two calls in flight on two streams raised {one_line(e)}")
        for label, placed, ret, want in (("this case", a, ret_a, first), ("the other case", b, ret_b, second)):
            results, checks = placed.outputs(ret)
            bad = [c for c in checks + placed.unwritten(results) if not c.ok]
            if bad:
                return Check(name, False, f"round {r}, {label}: " + "; ".join(f"{c.name}: {c.detail}" for c in bad))
            diff = _same(want, results)
            if diff:
                return Check(name, False, f"{', '.join(diff)} of {label} differ when another call runs at the "
                             f"same time on another stream (round {r}): state shared across calls (one "
                             "workspace, counter or buffer for all streams) mixes their data")
    return Check(name, True, f"{CONCURRENT_ROUNDS} rounds of two calls in flight on two streams: each bitwise its own")


def check(ctx) -> list[Check]:
    """The GPU guards of one launch (on a CUDA device, where the spec claims determinism)."""
    if not str(ctx.device).startswith("cuda") or not ctx.spec.claims.deterministic:
        return []
    out = [side_stream_check(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.first, ctx.device),
           cuda_graph_check(ctx.fn, ctx.op, ctx.dinputs, ctx.first, ctx.device)]
    other = ctx.refreshed()
    if other is not None:
        other = ctx.on_device(other[1])          # placed from the device, as this case's values are
        out.append(stream_order_check(ctx.fn, ctx.op, ctx.dinputs, other, ctx.base, ctx.first, ctx.device))
        out.append(concurrent_check(ctx.fn, ctx.op, ctx.dinputs, other, ctx.base, ctx.first, ctx.device,
                                    ctx.reference))
    return out
