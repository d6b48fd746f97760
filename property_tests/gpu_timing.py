"""Shared by the GPU tests of layer steps and kernels: microseconds per call of a CUDA-graph replay, and
a layer step's graph checked against its eager steps."""
from __future__ import annotations

import torch


def graph_us(fn, replays: int = 20) -> float:
    """fn run once on the bench's capture stream (its per-stream buffers made there), captured once in a
    CUDA graph on it, replayed once untimed, then `replays` times between two CUDA events: us per
    replay (fn must already have run eagerly: compiles, lazy init)."""
    from verify.bench.timing import capture_graph, warm_up

    warm_up([fn], 1)
    graph = capture_graph([fn])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def assert_graph_replays_eager(layer, x_steps, blocks, state: dict):
    """The layer's steps over x_steps run eagerly, then one step captured in a CUDA graph (after a
    warm-up on copies on the same stream, so the graph's state starts fresh) and replayed with each x copied in: the
    replayed outputs, state and blocks must be the eager bits. Returns (prefix, blocks, state) the
    graph was captured on (for a launch count)."""
    eager_blocks, eager_state = blocks.clone(), {n: s.clone() for n, s in state.items()}
    eager = torch.stack([layer.step(x.clone(), eager_blocks, *eager_state.values()) for x in x_steps])
    g_blocks, g_state = blocks.clone(), {n: s.clone() for n, s in state.items()}
    from verify.bench.timing import capture_stream, warm_up

    prefix = x_steps[0].clone()
    warm_up([lambda: layer.step(prefix, g_blocks.clone(), *(s.clone() for s in g_state.values()))], 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream()):
        out = layer.step(prefix, g_blocks, *g_state.values())
    replayed = []
    for x in x_steps:
        prefix.copy_(x)
        graph.replay()
        replayed.append(out.clone())
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(replayed), eager)
    for n in state:
        assert torch.equal(g_state[n], eager_state[n]), n
    assert torch.equal(g_blocks, eager_blocks)
    return prefix, g_blocks, g_state
