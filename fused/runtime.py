"""Shared runtime for the CuTe DSL kernels in `fused/`.

- `cutlass_modules()` imports cutlass lazily, with `CUTE_DSL_ARCH=sm_90a` unless the caller set one
  (the DSL latches the arch at import and would default to sm_100a on a GPU-less machine).
- One project-wide compile cache keyed by the static arguments (op, dtype, static shapes, variant):
  `compile_cache(op)` decorates a tensor-free `_compile(*static)` builder; `cache_info()` counts hits,
  misses and entries so a test can prove a new batch size does not recompile.
- `compile_for_cpu_check(op, *static)` compiles a registered builder without a GPU (CI).
- `sm_count(device)`: the device's SM count, cached.
- `st_async_cluster(dst, values, mbar)` / `wait_cluster_phase0(mbar)`: the inline PTX of a push into a
  peer CTA's shared memory that completes its bytes on the peer's mbarrier, and the wait that acquires
  those pushes at cluster scope (CuTe DSL 4.8 has neither).
- `aligned(t)` / `write_back(copy, t)`: a tensor whose base is not 16-byte aligned (x[1:] of a
  contiguous tensor) copied to fresh storage for the kernel, and an in-place update copied back.
- `register_op(name, mutates_args)` makes a destination-passing `verify_kernels::<name>` custom op
  with a no-op fake impl, so torch.compile and CUDA graphs can hold the launch.
- Kernels are compiled with TVM-FFI and an env stream: a launch runs on the caller's current
  CUDA stream (also the capture stream while a CUDA graph is being recorded).
Importing this module imports neither cutlass nor torch.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_ARCH = "sm_90a"
NAMESPACE = "verify_kernels"

_lock = threading.RLock()
_cache: dict[tuple, Any] = {}
_builders: dict[str, Callable[..., Any]] = {}
_stats = {"hits": 0, "misses": 0}


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    entries: int


def cutlass_modules():
    """(cutlass, cute), imported on first use with the Hopper arch pinned."""
    os.environ.setdefault("CUTE_DSL_ARCH", DEFAULT_ARCH)
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def cutlass_dtype(name: str):
    """cutlass element type for a torch dtype name ("bfloat16", "float32", ...)."""
    cutlass, _ = cutlass_modules()
    table = {
        "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
        "uint8": cutlass.Uint8, "int32": cutlass.Int32, "int64": cutlass.Int64,
    }
    if name not in table:
        raise TypeError(f"dtype: {name!r} has no CuTe DSL kernel here; supported: {sorted(table)}")
    return table[name]


def dtype_name(torch_dtype) -> str:
    """"bfloat16" for torch.bfloat16: the cache key holds names, not torch objects."""
    return str(torch_dtype).removeprefix("torch.")


def fake_tensor(dtype_name_: str, shape: tuple, *, align: int = 16):
    """Row-major fake tensor for compiling without data. A shape entry is an int (static) or a
    `cute.sym_int()` (dynamic, e.g. the batch dimension); the last mode has stride 1."""
    _, cute = cutlass_modules()
    order = tuple(range(len(shape) - 1, -1, -1))
    return cute.runtime.make_fake_compact_tensor(
        cutlass_dtype(dtype_name_), shape, stride_order=order, assumed_align=align)


def sym_int(divisibility: int = 1):
    _, cute = cutlass_modules()
    return cute.sym_int(divisibility=divisibility)


def compile_tvm_ffi(fn, *args):
    """cute.compile with the TVM-FFI call path and the caller's current stream as launch stream."""
    _, cute = cutlass_modules()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(fn, *args, stream, options="--enable-tvm-ffi")


def compile_cache(op: str):
    """Decorator: memoise a tensor-free builder `_compile(*static)` in the project-wide cache under
    key (op, *static). Static arguments must be hashable (names, ints, frozen dataclasses)."""

    def deco(build: Callable[..., Any]):
        def cached(*static):
            key = (op, *static)
            with _lock:
                hit = _cache.get(key)
                if hit is not None:
                    _stats["hits"] += 1
                    return hit
                _stats["misses"] += 1
                compiled = build(*static)
                _cache[key] = compiled
                return compiled

        cached.__wrapped__ = build
        cached.__name__ = getattr(build, "__name__", op)
        _builders[op] = cached
        return cached

    return deco


def cache_info() -> CacheInfo:
    with _lock:
        return CacheInfo(_stats["hits"], _stats["misses"], len(_cache))


def compile_for_cpu_check(op: str, *static):
    """Compile `op`'s kernel for the given static configuration without touching a GPU.
    Imports the kernel module so its builder is registered; returns the compiled function."""
    import importlib

    if op not in _builders:
        importlib.import_module(f"fused.{op}")
    if op not in _builders:
        raise KeyError(f"op: {op!r} registers no compile builder; known: {sorted(_builders)}")
    return _builders[op](*static)


def register_op(name: str, mutates_args: tuple[str, ...]):
    """Decorator: turn `impl(...) -> None` (destination-passing, writes into `mutates_args`) into
    the custom op `verify_kernels::<name>` with a fake impl that does nothing (outputs are
    allocated by the caller), so torch.compile traces through it and CUDA graphs capture it."""
    import torch

    def deco(impl):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args,
                                     device_types="cuda")(impl)

        @op.register_fake
        def _fake(*args, **kwargs):
            return None

        return op

    return deco


_sm_counts: dict[int, int] = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device, cached (persistent and resident grids are sized
    per launch from it)."""
    import torch

    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def aligned(t, align: int = 16):
    """`t` itself where its data starts `align`-byte aligned, else a contiguous copy in fresh storage.
    The kernels' 16-byte vector loads, bulk copies and TMA assume an aligned base (compiled with
    fake_tensor(..., align=16), the TVM-FFI call raises on a misaligned one), and a contiguous
    view such as x[1:] is not. State updated in place goes back with `write_back`."""
    if t.data_ptr() % align == 0:
        return t
    import torch

    return t.clone(memory_format=torch.contiguous_format)


def write_back(copy, caller) -> None:
    """The kernel's in-place update of an `aligned` copy, into the caller's tensor (on the current
    stream, after the launch); nothing where the kernel updated the caller's tensor itself."""
    if copy is not caller:
        caller.copy_(copy)


def require_cuda(name: str, t) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name}: the fused kernel needs a CUDA tensor, got device {t.device}; "
                         "use the reference on the CPU")


def st_async_cluster(dst, values, mbar) -> None:
    """Inside a kernel: `values` (1, 2 or 4 fp32 registers) stored at `dst`, an address in a cluster
    peer's shared memory (cute.arch.map_dsmem_ptr), by one st.async that completes its 4 x len(values)
    bytes on the peer's mbarrier at `mbar` (also mapped to the peer). No fence and no cluster barrier:
    the peer learns of the bytes from its mbarrier's transaction count."""
    _, cute = cutlass_modules()
    n = len(values)
    if n not in (1, 2, 4):
        raise ValueError(f"st_async_cluster: 1, 2 or 4 values, got {n}")
    regs = ", ".join("{$r%d}" % (i + 1) for i in range(n))
    src = regs if n == 1 else "{" + regs + "}"
    vec = "" if n == 1 else f".v{n}"
    cute.arch.inline_ptx(f"st.async.shared::cluster.mbarrier::complete_tx::bytes{vec}.f32 "
                         f"[{{$r0}}], {src}, [{{$r{n + 1}}}];",
                         read_only_args=[dst.toint(), *values, mbar.toint()])


def wait_cluster_phase0(mbar) -> None:
    """Inside a kernel: spin until phase 0 of this CTA's mbarrier at `mbar` completes, with acquire at
    cluster scope, so the peers' st.async bytes it counted are visible (the DSL's mbarrier_wait acquires
    at CTA scope only)."""
    _, cute = cutlass_modules()
    cute.arch.inline_ptx("{\n.reg .pred P1;\nWAIT:\n"
                         "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [{$r0}], 0;\n"
                         "@P1 bra.uni DONE;\nbra.uni WAIT;\nDONE:\n}",
                         read_only_args=[mbar.toint()])
