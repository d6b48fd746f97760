"""Where a fused layer step's time goes: each kernel of one step at K3 per-rank shapes, in launch order,
with its device time, beside the step's CUDA-graph replay time and the sum of its kernels.

    python3 tools/layer_kernels.py --kinds kda,mla --tp 1,8 --batch 1 [--steps 5] [--json OUT.json]

One rank's step at T > 1 gathers with CopiesGather (the rank's own partials in every slot: its
compute and its folds, no transfer), as test_fused_layers_tp's K3 rank step. Kernel times are
torch.profiler's (CUPTI) over `--steps` replays of the step captured in a CUDA graph, the median
start and duration per position, with the stream each ran on; the replay time is CUDA events over
graph replays. Each side stream (the shared experts', l2_prefetch's with --prefetch) is summed up as
its busy time and the part of it that ran beside the main stream: the overlap the side streams buy.
Weights are not rotated past L2 here (the bench's times are the record; these show the split).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STATE = {"kda": ("conv_state", "recurrent_state"), "mla": ("cache", "block_table", "seq_lens")}
LAYER = {"kda": 12, "mla": 15}


def step_fn(kind: str, T: int, B: int, weights: dict, prefetch: bool = False):
    """(the step as a no-argument callable, the prepared layer) at K3 shapes, rank 0 of T."""
    import fused.layers as FL
    import fused.layers_tp as TP
    from references.config import K3
    from references.layers import new_layer_state

    if T == 1:
        layer = FL.prepare(kind, weights, K3, LAYER[kind], torch.bfloat16)
    else:
        layer = TP.prepare_rank(kind, weights, K3, LAYER[kind], torch.bfloat16, TP.CopiesGather(T),
                                prefetch=prefetch)
    st = new_layer_state(kind, K3, B, max_tokens=512)
    state = {n: getattr(st, n).cuda() for n in STATE[kind]}
    if T > 1:
        state = TP.shard_state(kind, state, K3, T, 0)
    g = torch.Generator(device="cuda").manual_seed(B)
    blocks = torch.randn(B, 8, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
    prefix = torch.randn(B, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
    return (lambda: layer.step(prefix, blocks, *state.values())), layer


def replay_trace(fn, replays: int) -> list[list[dict]]:
    """The kernels and copies of `replays` CUDA-graph replays of fn, from torch.profiler's trace:
    per replay, [{name, stream, start, dur}] in start order (us, start from the replay's first)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    finally:
        os.unlink(path)
    ops = sorted(({"name": e["name"], "stream": e.get("args", {}).get("stream", e.get("tid")),
                   "start": float(e["ts"]), "dur": float(e["dur"])}
                  for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["start"])
    per = len(ops) // replays
    out = []
    for r in range(replays):
        part = ops[r * per:(r + 1) * per]
        t0 = part[0]["start"]
        out.append([dict(e, start=e["start"] - t0) for e in part])
    return out


def kernel_times(fn, replays: int) -> list[dict]:
    """One replay's ops with each op's median start and duration over the replays."""
    runs = replay_trace(fn, replays)
    return [dict(runs[0][i], start=statistics.median(r[i]["start"] for r in runs),
                 dur=statistics.median(r[i]["dur"] for r in runs)) for i in range(len(runs[0]))]


def overlap(ops: list[dict]) -> dict:
    """Per stream other than the step's main one (the stream of the first op): its busy time and how
    much of it ran while the main stream was busy."""
    main = ops[0]["stream"]
    busy = [(e["start"], e["start"] + e["dur"]) for e in ops if e["stream"] == main]
    out = {}
    for e in ops:
        if e["stream"] == main:
            continue
        a, b = e["start"], e["start"] + e["dur"]
        shared = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)
        s = out.setdefault(str(e["stream"]), {"kernels": 0, "busy_us": 0.0, "overlapped_us": 0.0})
        s["kernels"] += 1
        s["busy_us"] += e["dur"]
        s["overlapped_us"] += shared
    return out


def graph_us(fn, replays: int = 50) -> float:
    """us per CUDA-graph replay of fn (CUDA events over `replays` replays)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--tp", default="1,8")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--steps", type=int, default=5, help="graph replays profiled")
    ap.add_argument("--prefetch", action="store_true", help="at T > 1 also the step with l2_prefetch")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
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
                    for s, v in lap.items():
                        print(f"  side stream {s}: {v['kernels']} kernels, {v['busy_us']:.1f} us busy, "
                              f"{v['overlapped_us']:.1f} us of it beside the main stream")
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
