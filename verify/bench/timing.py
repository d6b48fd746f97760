"""The timing core: per-call device time of a rotation of launches, as a serving engine replays them.

A timed thing is a list of zero-argument launches, one per input set. The sets are rotated so that
together they hold more bytes than L2 (every call reads its operands from HBM, as a decode step
does), and the rotation is repeated until one CUDA graph holds at least MIN_CALLS calls (a replay's
own launch gap is then not charged to the 1-2 calls of a graph of large sets). Each sample is the
time of a few graph replays between two CUDA events, divided by the calls replayed; the result is
the median and the 10th / 90th percentiles of the samples.

A call of LONG_CALL_MS or more (a reference layer launched from Python, tens of milliseconds) is
timed in a graph of one pass over its sets: a replay's launch gap is then under 0.5 % of a call, and
repeating it 20 times would spend a minute of the bench's budget on one baseline.

How many: a timed probe replay gives the graph's length, and the replays are dealt so that the
timed ones add up to about MEASURE_MS: SAMPLES samples of REPLAYS replays for a short graph, down
to MIN_SAMPLES samples of one replay for a long one (a reference composition's eager graph of 64
calls runs for milliseconds; each of its samples already averages over those calls).

The clock is an argument: `GraphClock` on a CUDA device, a fake one in the CPU tests.

A capture that fails (a launch that reads a value on the host, a CPU fallback) gives its memory pool
back (`capture_graph`): torch's CUDAGraph releases its private pool only after a capture that ended,
so without that, everything a failed capture allocated stays reserved for the rest of the process
(measured: a K3 reference layer's failed captures left tens of GB reserved, and the next rows of the
run ran out of memory).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Protocol, Sequence

ROTATE_BYTES = 256 << 20        # >= 5 x the H200's 50 MB L2
MAX_SETS = 64
MIN_CALLS = 20
SAMPLES = 25
REPLAYS = 3
MIN_SAMPLES = 10
LONG_CALL_MS = 2.0         # a call at least this long is not repeated to MIN_CALLS in its graph
MEASURE_MS = 60.0          # timed replays per entry add up to about this (at least MIN_SAMPLES replays)

Launch = Callable[[], object]


@dataclass(frozen=True)
class Stats:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    sets: int              # input sets rotated
    calls: int             # calls per graph (the rotation repeated)
    method: str            # "graph" | "stream" (not capturable: launched from Python, events around)
    replays: int = 1       # graph replays per sample

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class Clock(Protocol):
    """Captures a list of launches into one replayable unit, and times n replays of it in ms."""

    def capture(self, calls: Sequence[Launch]) -> tuple[Callable[[], None], str]: ...

    def elapsed_ms(self, replay: Callable[[], None], n: int) -> float: ...


def sets_needed(set_bytes: int, rotate_bytes: int = ROTATE_BYTES, max_sets: int = MAX_SETS) -> int:
    """Input sets to rotate so that they hold >= rotate_bytes together (1 when one set already does)."""
    if set_bytes <= 0:
        return max_sets
    return max(1, min(max_sets, math.ceil(rotate_bytes / set_bytes)))


def rotation(n_sets: int, min_calls: int = MIN_CALLS) -> list[int]:
    """Set index of each call in one graph: 0..n-1 repeated until >= min_calls calls."""
    if n_sets < 1:
        raise ValueError(f"n_sets: {n_sets} must be 1 or more")
    reps = max(1, math.ceil(min_calls / n_sets))
    return [i % n_sets for i in range(n_sets * reps)]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def plan_samples(replay_ms: float, measure_ms: float = MEASURE_MS, samples: int = SAMPLES,
                 replays: int = REPLAYS, min_samples: int = MIN_SAMPLES) -> tuple[int, int]:
    """(samples, replays per sample) whose timed replays add up to about `measure_ms` for a graph
    replay of `replay_ms`: at most samples x replays, at least min_samples x 1."""
    total = samples * replays if replay_ms <= 0 else int(measure_ms // replay_ms)
    total = max(min_samples, min(samples * replays, total))
    n = min(samples, total)
    return n, max(1, min(replays, total // n))


def time_launches(per_set: Sequence[Launch], clock: Clock, *, min_calls: int = MIN_CALLS,
                  samples: int | None = None, replays: int | None = None,
                  measure_ms: float = MEASURE_MS) -> Stats:
    """Per-call time of the launches in `per_set` (one per input set), rotated as `rotation` says, or in
    one pass over the sets when a probe of the first set's call takes LONG_CALL_MS or more.
    samples and replays fixed, or None: dealt by `plan_samples` from a timed probe replay."""
    if (samples is not None and samples < 1) or (replays is not None and replays < 1):
        raise ValueError(f"samples {samples} and replays {replays} must be 1 or more")
    if min_calls > len(per_set):
        probe, _ = clock.capture(per_set[:1])
        if clock.elapsed_ms(probe, 1) >= LONG_CALL_MS:
            min_calls = len(per_set)
    order = rotation(len(per_set), min_calls)
    replay, method = clock.capture([per_set[i] for i in order])
    clock.elapsed_ms(replay, 1)                        # one untimed replay: first-touch costs
    if samples is None or replays is None:
        n, r = plan_samples(clock.elapsed_ms(replay, 1), measure_ms)     # the probe: one warm replay
        samples, replays = samples or n, replays or r
    per_call = sorted(clock.elapsed_ms(replay, replays) * 1e3 / (replays * len(order)) for _ in range(samples))
    return Stats(statistics.median(per_call), percentile(per_call, 10), percentile(per_call, 90), samples,
                 len(per_set), len(order), method, replays)


_capture_streams: dict = {}


def capture_stream():
    """The stream launches are warmed up on and captured on (one per device, made once). A kernel that
    keeps a buffer per stream, made on first use (a split-K counter zeroed, a workspace), then makes
    it in the warm-up: were the warm-up on another stream, the buffer of the capture stream would be
    made inside the capture, and the graph would carry its zero-fill into every replay and count."""
    import torch

    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream()
    return _capture_streams[device]


def warm_up(calls: Sequence[Launch], times: int) -> None:
    """The calls `times` times over on capture_stream(), ordered after the current stream's work and
    before its next, then a device sync (capture needs warm launches: compiled, tuned, allocated)."""
    import torch

    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(calls: Sequence[Launch], keep_graph: bool = False):
    """The calls captured in a new torch.cuda.CUDAGraph on a memory pool of its own, on
    capture_stream(). Where the capture fails, its error propagates after the current stream is put
    back (a failed capture_end leaves the capture stream current) and, where the capture did not end,
    after its pool is ended and released: torch releases the pool of a graph only once its capture
    ended."""
    import torch

    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream()):
            for call in calls:
                call()
    except BaseException:
        torch.cuda.set_stream(stream)
        try:
            graph.pool()            # raises where the capture did not end: its pool is still ours to give back
            ended = True
        except RuntimeError:
            ended = False
        del graph
        if not ended:
            give_back_pool(pool)
        raise
    return graph


def give_back_pool(pool) -> None:
    """End allocation to a failed capture's pool (its capture_end raised before doing so) and release
    it, so that the allocator frees its blocks once they are unused (the next empty_cache)."""
    import torch

    device = torch.cuda.current_device()
    for step in (torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool):
        try:
            step(device, pool)
        except Exception:  # noqa: BLE001  (a step the failure already did, or a torch without it)
            pass


class GraphClock:
    """CUDA events around CUDA-graph replays. Launches warm up (compile, autotune, per-stream buffers)
    on the capture stream before capture; a sequence that cannot be captured (a host sync, a CPU
    fallback) is timed as launched from Python on the current stream, and its Stats say "stream"."""

    def capture(self, calls: Sequence[Launch]) -> tuple[Callable[[], None], str]:
        import torch

        def launch_all():
            for call in calls:
                call()

        warm_up(calls, 2)               # the first call compiles or autotunes; the second runs warm
        try:
            graph = capture_graph(calls)
        except Exception:  # noqa: BLE001  (not capturable: time it launched from Python)
            torch.cuda.synchronize()
            return launch_all, "stream"
        return graph.replay, "graph"

    def elapsed_ms(self, replay: Callable[[], None], n: int) -> float:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
