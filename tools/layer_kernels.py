"""Where a fused layer step's time goes: each kernel of one step at K3 per-rank shapes, in launch order,
with its device time, beside the step's CUDA-graph replay time and the sum of its kernels.

    python3 tools/layer_kernels.py --kinds kda,mla --tp 1,8 --batch 1 [--steps 5] [--json OUT.json]

One rank's step at T > 1 gathers with CopiesGather (the rank's own partials in every slot: its
compute and its folds, no transfer), as test_fused_layers_tp's K3 rank step. Kernel times are
torch.profiler's (CUPTI) over `--steps` replays of the step captured in a CUDA graph, the median
start and duration per position, with the stream each ran on; the replay time is CUDA events over
graph replays. The streams' overlap (verify.bench.overlap: each stream's busy time, the time two or
more were busy) shows what the fork to the shared experts' branch and l2_prefetch's (--prefetch) buy.
Weights are not rotated past L2 here (the bench's times are the record; these show the split).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_fn(kind: str, T: int, B: int, weights: dict, prefetch: bool = False):
    """(the step as a no-argument callable, the prepared layer) at K3 shapes, rank 0 of T."""
    import fused.layers as FL
    import fused.layers_tp as TP
    from property_tests.test_fused_layers_tp import KINDS, LAYER      # the K3 rank step's layers and state
    from references.config import K3
    from references.layers import new_layer_state

    if T == 1:
        layer = FL.prepare(kind, weights, K3, LAYER[kind], torch.bfloat16)
    else:
        layer = TP.prepare_rank(kind, weights, K3, LAYER[kind], torch.bfloat16, TP.CopiesGather(T),
                                prefetch=prefetch)
    st = new_layer_state(kind, K3, B, max_tokens=512)
    state = {n: getattr(st, n).cuda() for n in KINDS[kind]}
    if T > 1:
        state = TP.shard_state(kind, state, K3, T, 0)
    g = torch.Generator(device="cuda").manual_seed(B)
    blocks = torch.randn(B, 8, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
    prefix = torch.randn(B, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
    return (lambda: layer.step(prefix, blocks, *state.values())), layer


def replay_trace(fn, replays: int) -> list[list[dict]]:
    """The device work of `replays` CUDA-graph replays of fn (verify.bench.profile.profiled_intervals):
    per replay, [{name, stream, start, dur}] in start order (us from the replay's first op)."""
    from torch.profiler import ProfilerActivity, profile

    from verify.bench.profile import profiled_intervals

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    ops = profiled_intervals(prof)
    per = len(ops) // replays
    return [[{"name": iv.name, "stream": iv.stream, "start": iv.start - part[0].start, "dur": iv.end - iv.start}
             for iv in part] for part in (ops[r * per:(r + 1) * per] for r in range(replays))]


def kernel_times(fn, replays: int) -> list[dict]:
    """One replay's ops with each op's median start and duration over the replays."""
    runs = replay_trace(fn, replays)
    return [dict(runs[0][i], start=statistics.median(r[i]["start"] for r in runs),
                 dur=statistics.median(r[i]["dur"] for r in runs)) for i in range(len(runs[0]))]


def overlap(ops: list[dict]) -> dict:
    """verify.bench.overlap's summary of one (median) replay: each stream's busy time, the time two or
    more streams were busy, each kernel's time another stream's work covered."""
    from verify.bench.overlap import Interval, summarize

    return summarize([Interval(e["name"], e["stream"], e["start"], e["start"] + e["dur"]) for e in ops])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--tp", default="1,8")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--steps", type=int, default=5, help="graph replays profiled")
    ap.add_argument("--prefetch", action="store_true", help="at T > 1 also the step with l2_prefetch")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    from property_tests.gpu_timing import graph_us
    from references.config import K3
    from stock.weights import make_layer_weights_on

    rows = []
    for kind in args.kinds.split(","):
        w = make_layer_weights_on(kind, K3, 0, device="cuda").tensors
        for T in (int(t) for t in args.tp.split(",")):
            for B in (int(b) for b in args.batch.split(",")):
                for prefetch in ((False, True) if T > 1 and args.prefetch else (False,)):
                    fn, layer = step_fn(kind, T, B, w, prefetch)
                    fn()
                    torch.cuda.synchronize()
                    ops = kernel_times(fn, args.steps)
                    replay = graph_us(fn)
                    total = sum(e["dur"] for e in ops)
                    lap = overlap(ops)
                    print(f"\n{kind} T={T} B={B}{' +l2_prefetch' if prefetch else ''}: {len(ops)} device ops, "
                          f"their sum {total:.1f} us, graph replay {replay:.1f} us; unfused {sorted(layer.unfused)}")
                    print(f"  two or more streams busy {lap['concurrent_us']:.1f} us; busy per stream: "
                          + ", ".join(f"{st} {us:.1f} us" for st, us in lap["streams"].items()))
                    for i, e in enumerate(ops):
                        print(f"  {i:2d} s{e['stream']} {e['start']:8.1f} {e['dur']:7.1f}  {e['name'][:100]}")
                    rows.append({"kind": kind, "T": T, "B": B, "prefetch": prefetch, "replay_us": replay,
                                 "ops_us": total, "ops": ops, "overlap": lap, "unfused": dict(layer.unfused)})
                    del fn, layer
                torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
