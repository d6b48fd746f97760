"""Shared by the GPU tests that print times: microseconds per call of a CUDA-graph replay."""
from __future__ import annotations

import torch


def graph_us(fn, replays: int = 20) -> float:
    """fn captured once in a CUDA graph (fn must already have run eagerly: compiles, lazy init),
    replayed once untimed, then `replays` times between two CUDA events: us per replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3
