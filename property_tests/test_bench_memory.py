"""The bench's memory across entries: a CUDA-graph capture that fails gives its memory pool back
(timing.capture_graph), because torch's CUDAGraph releases the private pool of a capture that did not
end never, with everything the launch allocated in it. CPU: the release under a stand-in of torch's
graph API. GPU: a launch that reads a value on the host, through the clock and the launch counter,
leaves nothing reserved, and torch by itself would have kept it."""
from __future__ import annotations

import gc

import pytest
import torch

from verify.bench import launches, timing

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Graphs:
    """torch.cuda's graph API stand-in: a capture whose body raises ends (ended=True: its pool is the
    graph's to release) or not (capture_end raised first), as `ended` says; every pool step recorded."""

    def __init__(self, monkeypatch, ended: bool):
        self.steps, self.ended, self.stream = [], ended, "main"
        outer = self

        class Graph:
            def __init__(self, keep_graph=False):
                self.capture_ended = False

            def pool(self):
                if not self.capture_ended:
                    raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
                return ("pool", 7)

        class Capture:
            def __init__(self, graph, pool=None, stream=None):
                self.graph, self.pool = graph, pool
                assert stream == "capture stream", stream

            def __enter__(self):
                outer.steps.append(("begin", self.pool))
                outer.stream = "capture"

            def __exit__(self, kind, *rest):
                if kind is None or outer.ended:
                    self.graph.capture_ended = True
                    outer.stream = "main"
                    return False
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 7))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: self.stream)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda s: setattr(self, "stream", s))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(timing, "capture_stream", lambda: "capture stream")
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: self.steps.append(("end", d, p)),
                            raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: self.steps.append(("release", d, p)),
                            raising=False)


def _host_read():
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_a_capture_that_did_not_end_gives_its_own_pool_back(monkeypatch):
    g = _Graphs(monkeypatch, ended=False)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        timing.capture_graph([lambda: None, _host_read])
    assert g.steps == [("begin", (0, 7)), ("end", 0, (0, 7)), ("release", 0, (0, 7))]
    assert g.stream == "main"


def test_a_capture_that_ended_leaves_its_pool_to_the_graph(monkeypatch):
    g = _Graphs(monkeypatch, ended=True)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        timing.capture_graph([_host_read])
    assert g.steps == [("begin", (0, 7))]


def test_a_capture_that_succeeds_returns_its_graph(monkeypatch):
    g = _Graphs(monkeypatch, ended=False)
    ran = []
    graph = timing.capture_graph([lambda: ran.append(1), lambda: ran.append(2)], keep_graph=True)
    assert ran == [1, 2] and graph.pool() == ("pool", 7) and g.steps == [("begin", (0, 7))]


def test_a_pool_step_that_fails_does_not_hide_the_capture_error(monkeypatch):
    g = _Graphs(monkeypatch, ended=False)

    def refuse(d, p):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", refuse, raising=False)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        timing.capture_graph([_host_read])
    assert g.steps == [("begin", (0, 7)), ("release", 0, (0, 7))]


# ------------------------------------------------------------------------------------------- on the GPU
def _reserved_after_release() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@needs_gpu
@pytest.mark.gpu
def test_a_launch_reading_a_value_on_the_host_is_timed_from_python_and_leaves_no_memory():
    x = torch.randn(1 << 20, device="cuda")

    def syncing():          # 512 MB of temporaries, then a value read on the host
        y = torch.empty(128 << 20, device="cuda").fill_(1.0)
        return (y.sum() + x[0]).item()

    def capturable():
        return x * 2
    base = _reserved_after_release()
    clock = timing.GraphClock()
    replay, method = clock.capture([syncing])
    assert method == "stream"
    del replay
    assert _reserved_after_release() - base < (64 << 20), "the failed capture left memory reserved"
    replay, method = clock.capture([capturable])
    assert method == "graph"
    del replay
    count = launches.count_launches(syncing)
    assert count.method == launches.PROFILER_METHOD and "CUDA graph count unavailable" in count.note
    assert _reserved_after_release() - base < (64 << 20)


@needs_gpu
@pytest.mark.gpu
def test_torch_keeps_the_pool_of_a_capture_a_host_sync_broke():
    """Why capture_graph gives the pool back: torch's own capture of the same launch leaves its
    temporaries reserved. Where a torch release frees them itself, this fails, and the release in
    capture_graph is then one its torch already did."""
    base = _reserved_after_release()
    stream = torch.cuda.current_stream()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(Exception):
        with torch.cuda.graph(g):
            y = torch.empty(128 << 20, device="cuda").fill_(1.0)
            y.sum().item()
    torch.cuda.set_stream(stream)
    del g, y
    assert _reserved_after_release() - base >= (512 << 20)


# ------------------------------------------------------------------------ per-stream buffers, on the GPU
class _PerStreamCounter:
    """A launch in the form the split-K kernels take: a zeroed int32 buffer per stream, made on first
    use and kept, then one kernel (an add into it)."""

    def __init__(self):
        self.buffers = {}

    def __call__(self):
        key = torch.cuda.current_stream().cuda_stream
        if key not in self.buffers:
            self.buffers[key] = torch.zeros(1024, dtype=torch.int32, device="cuda")
        self.buffers[key].add_(1)


@needs_gpu
@pytest.mark.gpu
def test_a_buffer_made_on_first_use_per_stream_is_made_in_the_warm_up_not_in_the_graph():
    """The launch counter and the clock warm up on the stream they capture on: the buffer of that
    stream is made then, so the graph holds the one add, not the buffer's zero-fill too (which a
    warm-up on another stream leaves inside the capture: two kernels, every replay)."""
    count = launches.count_launches(_PerStreamCounter(), warmup=1)
    assert count.kernels == 1, count
    fresh = _PerStreamCounter()
    timing.warm_up([fresh], 1)
    assert list(fresh.buffers) == [timing.capture_stream().cuda_stream]
