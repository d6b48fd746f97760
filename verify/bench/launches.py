"""Launches per call of a step: the kernel nodes of one call captured in a CUDA graph, or, where the
call cannot be captured or the graph cannot be read, the kernels torch's profiler sees in one eager call.

`count_launches(fn)` returns a `LaunchCount`: kernels (what the layer table reports), the other
device work the call did (copies, memsets, graph-internal allocations), and how it was counted. The
graph is read through the CUDA driver (cuGraphGetNodes / cuGraphNodeGetType on the cudaGraph_t that
torch keeps with keep_graph=True); a child-graph node's kernels are counted inside it.
"""
from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field

# CUgraphNodeType (cuda.h); any other value is named by its number
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}
KERNEL, CHILD_GRAPH = 0, 4
GRAPH_METHOD = "cuda_graph_nodes"
PROFILER_METHOD = "profiler_kernels"
_NOT_KERNELS = ("memcpy", "memset")          # profiler CUDA events that are copies, not kernel launches


@dataclass(frozen=True)
class LaunchCount:
    kernels: int                       # kernel launches in one call
    method: str                        # GRAPH_METHOD or PROFILER_METHOD
    other: dict = field(default_factory=dict)   # non-kernel device work by kind (memcpy, memset, ...)
    note: str = ""                     # why the fallback was used, when it was

    def to_json(self) -> dict:
        return {"kernels": self.kernels, "method": self.method, "other": dict(self.other), "note": self.note}


def summarize_node_types(types: list[int]) -> tuple[int, dict]:
    """(kernel nodes, the other nodes counted by kind name) of a flat list of CUgraphNodeType values;
    empty nodes (graph structure only) are left out of `other`."""
    counts = Counter(NODE_TYPES.get(t, f"type_{t}") for t in types)
    kernels = counts.pop("kernel", 0)
    counts.pop("empty", None)
    return kernels, dict(sorted(counts.items()))


def summarize_profiler_events(names: list[str]) -> tuple[int, dict]:
    """(kernels, {"memcpy": n, "memset": n}) from the names of the CUDA-side events of one call."""
    other = Counter()
    kernels = 0
    for name in names:
        kind = next((k for k in _NOT_KERNELS if name.lower().startswith(k)), None)
        if kind:
            other[kind] += 1
        else:
            kernels += 1
    return kernels, dict(sorted(other.items()))


# ---------------------------------------------------------------------------------------------- graph
def _libcuda():
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("the CUDA driver library (libcuda) cannot be loaded")


def graph_node_types(raw_graph: int) -> list[int]:
    """CUgraphNodeType of every node of a cudaGraph_t (as the int torch's raw_cuda_graph() returns),
    child graphs expanded in place of their node."""
    lib = _libcuda()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def walk(graph) -> list[int]:
        n = ctypes.c_size_t(0)
        check(lib.cuGraphGetNodes(graph, None, ctypes.byref(n)), "cuGraphGetNodes")
        nodes = (ctypes.c_void_p * n.value)()
        check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(n)), "cuGraphGetNodes")
        out = []
        for node in nodes[:n.value]:
            t = ctypes.c_int(0)
            check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
            if t.value == CHILD_GRAPH:
                child = ctypes.c_void_p(0)
                check(lib.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(node), ctypes.byref(child)),
                      "cuGraphChildGraphNodeGetGraph")
                out += walk(child)
            else:
                out.append(t.value)
        return out

    return walk(ctypes.c_void_p(raw_graph))


def _count_in_graph(fn, warmup: int) -> LaunchCount:
    from verify.bench.timing import capture_graph, warm_up

    warm_up([fn], warmup)                    # on the capture stream: its lazy buffers made outside the graph
    return count_graph(capture_graph([fn], keep_graph=True))     # a failed capture gives its pool back


# ---------------------------------------------------------------------------------------------- profiler
def _count_in_profiler(fn, warmup: int, note: str) -> LaunchCount:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    kernels, other = summarize_profiler_events(names)
    return LaunchCount(kernels, PROFILER_METHOD, other, note)


def count_graph(graph) -> LaunchCount:
    """Kernel nodes of a captured torch.cuda.CUDAGraph made with keep_graph=True."""
    kernels, other = summarize_node_types(graph_node_types(graph.raw_cuda_graph()))
    return LaunchCount(kernels, GRAPH_METHOD, other)


def count_launches(fn, warmup: int = 2) -> LaunchCount:
    """Kernel launches of one call of `fn` (no arguments) on the current CUDA device: the kernel nodes of
    the graph fn replays when it exposes one as `fn.cuda_graph` (kept, not re-captured), else of one call
    captured in a CUDA graph; where capture or reading the graph fails (a host sync
    in fn, an old torch without keep_graph, no driver symbols), the kernels of one eager call under
    torch.profiler, with the reason in `note`. `warmup` eager calls come first (allocator, autotuning,
    lazy init are not part of a step). fn must be safe to call warmup + 1 (or + 2) times."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("count_launches needs a CUDA device (it counts GPU kernel launches)")
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup: {warmup!r} must be an int >= 1 (capture needs one eager call first)")
    kept = getattr(fn, "cuda_graph", None)       # a launch that replays a graph it captured (keep_graph=True)
    if kept is not None:
        try:
            return count_graph(kept)
        except Exception:  # noqa: BLE001  (not kept, or unreadable: capture the launch itself below)
            pass
    stream = torch.cuda.current_stream()
    try:
        return _count_in_graph(fn, warmup)
    except Exception as e:  # noqa: BLE001  (capture refused, or the graph unreadable here)
        torch.cuda.set_stream(stream)        # a failed capture_end leaves the capture stream current
        torch.cuda.synchronize()
        return _count_in_profiler(fn, warmup, f"CUDA graph count unavailable: {type(e).__name__}: "
                                              f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")


# ---------------------------------------------------------------------------------------------- certificate
STEP_CASE = {"batch": 4, "config": "small", "seed": 0}       # the case whose one step is counted


def record_layer_launches(cert: dict, verdicts, device: str, count=None, place=None) -> list[str]:
    """Into `cert` (verify.record.certificate.build's dict): for every passing verdict of a layer op
    (family "layers") on a CUDA device whose candidate declares a step launch (its module's
    `<op>_step_peer`, the bench peer protocol), the kernel launches of one decode step on STEP_CASE's
    inputs (ops[op]["launches"][candidate]: the count, its method and the case; or the error that
    stopped it). `count` (count_launches) and `place` (a tensor onto the device) are the tests' seams.
    Returns a line per entry, for the summary."""
    if not str(device).startswith("cuda"):
        return []
    from verify.bench.run import step_launch_of
    from verify.model.case import Case
    from verify.model.opdef import OpInputs
    from verify.ops.registry import all_ops

    count = count or count_launches
    place = place or (lambda t: t.to(device))
    lines = []
    for v in verdicts:
        op = all_ops().get(v.op)
        if op is None or op.family != "layers" or v.status != "pass" or v.op not in cert.get("ops", {}):
            continue
        case = Case(op.name, STEP_CASE["seed"], STEP_CASE["batch"], STEP_CASE["config"], extra=(("steps", 1),))
        entry: dict = {"case": case.to_json()}
        try:
            peer = step_launch_of(op, v.candidate)
            if peer is None:
                continue
            inputs = op.make_inputs(case)
            moved = OpInputs({k: place(t) for k, t in inputs.tensors.items()}, dict(inputs.params))
            entry.update(count(peer(moved.tensors, moved.params), warmup=1).to_json())
            lines.append(f"{v.op} {v.candidate}: {entry['kernels']} kernel launches per step ({entry['method']})")
        except Exception as e:  # noqa: BLE001  (a count that fails is recorded, never the end of the run)
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            lines.append(f"{v.op} {v.candidate}: launches not counted ({entry['error']})")
        cert["ops"][v.op].setdefault("launches", {})[v.candidate] = entry
    return lines
