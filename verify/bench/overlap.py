"""Which device work ran at the same time as which: a summary of a profiler trace by stream.

A fused layer step hides work behind other work on side streams (the shared experts beside the routed
experts, the L2 prefetch beside the attention's all-gather). Whether it did is a fact about one run's
kernel intervals, so the summary reads them from the Chrome trace torch.profiler writes (events of
category kernel, gpu_memcpy and gpu_memset, each with its stream in args) and gives, per stream, the
time it was busy, and per kernel name and stream, the time of it that another stream's work covered.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class Interval:
    name: str
    stream: int
    start: float       # us
    end: float
    category: str = "kernel"       # or gpu_memcpy, gpu_memset


def device_intervals(trace: dict) -> list[Interval]:
    """The device work of a Chrome trace (torch.profiler's export_chrome_trace), in start order."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in DEVICE_CATEGORIES:
            continue
        start = float(ev["ts"])
        out.append(Interval(ev.get("name", "?"), int(ev.get("args", {}).get("stream", -1)), start,
                            start + float(ev.get("dur", 0.0)), ev["cat"]))
    return sorted(out, key=lambda i: (i.start, i.end))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """Length of [a, b) inside the union `spans` (disjoint, sorted)."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans if x < b and y > a)


def summarize(intervals: list[Interval]) -> dict:
    """{"span_us", "streams": {stream: busy us}, "concurrent_us": time two or more streams were busy,
    "kernels": [{"name", "stream", "calls", "us", "overlapped_us"}]} (kernels by time, largest first;
    overlapped_us: the part of the kernel's time that another stream's work covered)."""
    if not intervals:
        return {"span_us": 0.0, "streams": {}, "concurrent_us": 0.0, "kernels": []}
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for iv in intervals:
        by_stream[iv.stream].append((iv.start, iv.end))
    busy = {s: _union(spans) for s, spans in by_stream.items()}
    others = {s: _union([sp for t, spans in by_stream.items() if t != s for sp in spans]) for s in by_stream}
    kernels: dict[tuple[str, int], dict] = {}
    for iv in intervals:
        k = kernels.setdefault((iv.name, iv.stream), {"name": iv.name, "stream": iv.stream, "calls": 0, "us": 0.0,
                                                      "overlapped_us": 0.0})
        k["calls"] += 1
        k["us"] += iv.end - iv.start
        k["overlapped_us"] += _covered(iv.start, iv.end, others[iv.stream])
    return {"span_us": max(i.end for i in intervals) - min(i.start for i in intervals),
            "streams": {s: sum(b - a for a, b in spans) for s, spans in sorted(busy.items())},
            "concurrent_us": _concurrent(busy),
            "kernels": sorted(kernels.values(), key=lambda k: -k["us"])}


def _concurrent(busy: dict[int, list[tuple[float, float]]]) -> float:
    """Time two or more streams were busy (a sweep over every stream's busy spans)."""
    edges = sorted([(a, 1) for spans in busy.values() for a, _ in spans] +       # an end sorts before a
                   [(b, -1) for spans in busy.values() for _, b in spans])          # start at the same instant
    total, depth, last = 0.0, 0, None
    for t, d in edges:
        if depth >= 2 and last is not None:
            total += t - last
        depth, last = depth + d, t
    return total


def format_summary(summary: dict, limit: int = 25) -> str:
    lines = [f"span {summary['span_us']:.1f} us; two or more streams busy {summary['concurrent_us']:.1f} us"]
    lines += [f"stream {s}: busy {us:.1f} us" for s, us in summary["streams"].items()]
    lines.append(f"{'kernel':60s} {'stream':>6s} {'calls':>5s} {'us':>9s} {'overlapped':>10s}")
    for k in summary["kernels"][:limit]:
        share = k["overlapped_us"] / k["us"] if k["us"] else 0.0
        lines.append(f"{k['name'][:60]:60s} {k['stream']:6d} {k['calls']:5d} {k['us']:9.1f} {share:9.0%}")
    return "\n".join(lines) + "\n"
