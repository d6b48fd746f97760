"""Where a fused layer step's time goes: each kernel of one step at K3 per-rank shapes, in launch order,
with its device time, beside the step's CUDA-graph replay time and the sum of its kernels.

    python3 tools/layer_kernels.py --kinds kda,mla --tp 1,8 --batch 1 [--steps 5] [--json OUT.json]

One rank's step at T > 1 gathers with CopiesGather (the rank's own partials in every slot: its
compute and its folds, no transfer), as test_fused_layers_tp's K3 rank step. Kernel times are
torch.profiler's (CUPTI) over `--steps` eager steps after a warm-up, the median per launch position;
the replay time is CUDA events over graph replays. replay - sum(kernels) is what the launches cost
beyond their kernels (ramp, tail, dependency waits): the room a fewer-launch step could win.
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


def step_fn(kind: str, T: int, B: int, weights: dict):
    """(the step as a no-argument callable, the prepared layer) at K3 shapes, rank 0 of T."""
    import fused.layers as FL
    import fused.layers_tp as TP
    from references.config import K3
    from references.layers import new_layer_state

    if T == 1:
        layer = FL.prepare(kind, weights, K3, LAYER[kind], torch.bfloat16)
    else:
        layer = TP.prepare_rank(kind, weights, K3, LAYER[kind], torch.bfloat16, TP.CopiesGather(T))
    st = new_layer_state(kind, K3, B, max_tokens=512)
    state = {n: getattr(st, n).cuda() for n in STATE[kind]}
    if T > 1:
        state = TP.shard_state(kind, state, K3, T, 0)
    g = torch.Generator(device="cuda").manual_seed(B)
    blocks = torch.randn(B, 8, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
    prefix = torch.randn(B, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
    return (lambda: layer.step(prefix, blocks, *state.values())), layer


def kernel_times(fn, steps: int) -> list[tuple[str, float]]:
    """(name, median us) per launch position of one step, over `steps` profiled eager steps."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    per_step = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        per_step.append([(e.name, e.time_range.elapsed_us()) for e in evs])
    n = min(len(s) for s in per_step)
    return [(per_step[0][i][0], statistics.median(s[i][1] for s in per_step)) for i in range(n)]


def graph_us(fn, replays: int = 50) -> float:
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
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    from references.config import K3
    from stock.weights import make_layer_weights_on

    rows = []
    for kind in args.kinds.split(","):
        w = make_layer_weights_on(kind, K3, 0, device="cuda").tensors
        for T in (int(t) for t in args.tp.split(",")):
            for B in (int(b) for b in args.batch.split(",")):
                fn, layer = step_fn(kind, T, B, w)
                kernels = kernel_times(fn, args.steps)
                replay = graph_us(fn)
                total = sum(us for _, us in kernels)
                print(f"\n{kind} T={T} B={B}: {len(kernels)} device ops, kernels {total:.1f} us, "
                      f"graph replay {replay:.1f} us, replay - kernels {replay - total:.1f} us; "
                      f"unfused {sorted(layer.unfused)}")
                for i, (name, us) in enumerate(kernels):
                    print(f"  {i:2d} {us:8.1f}  {name[:110]}")
                rows.append({"kind": kind, "T": T, "B": B, "replay_us": replay, "kernels_us": total,
                             "kernels": kernels, "unfused": dict(layer.unfused)})
                del fn, layer
                torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
