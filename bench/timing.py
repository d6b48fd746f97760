"""Shared GPU timing for the bench scripts: CUDA events over CUDA-graph replays."""
from __future__ import annotations


def graph_time_us(fn_list, reps: int = 20, trials: int = 5) -> float:
    """Median per-call time (us) of fn_list[i % n] over CUDA-graph replays of `reps` calls: the
    launches a serving engine would replay, without Python call overhead. Warm-up (compiles) runs on
    a side stream before capture."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn_list[i % len(fn_list)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (10 * reps))
    times.sort()
    return times[len(times) // 2]


def save_outputs(out_dir: str, stem: str, results, lines=None) -> None:
    """A bench's records as OUT/STEM.json and, given its log lines, OUT/STEM.log."""
    import json
    import os

    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    if lines is not None:
        with open(os.path.join(out_dir, f"{stem}.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
