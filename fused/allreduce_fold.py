"""allreduce_fold: out[B, N] = wd(sum over r = 0..T-1, in rank order, of fp32 parts[r, B, N]), one launch.

The reduce half of an all-reduce done as all-gather + fold: the T ranks' partials arrive stacked in
rank order (an NCCL all-gather or peer-to-peer stores), and every rank folds them in the declared
order (references.primitives.fold_ranks), so every rank keeps the same bits. The fold is T static
loads per vector and T - 1 fp32 adds in registers; nothing but out is written.

Launch: grid (ceil(N / vec / threads), B), `threads` threads per CTA; thread t of CTA (x, b) owns
vector x * threads + t of row b: `vec` elements (16 bytes where N and the strides allow, down to one
element), partial 0..T-1 loaded, each widened to fp32 and added in that order, the sum rounded once
to wd and stored. parts may be strided (a column slice of a gathered [T, B, L + D] tensor): its rank
and row strides are dynamic, the column stride 1. Every variant gives the same bits (the order is
per element, fixed by T). One compile per (dtype, T, N, vec, variant); the batch is dynamic.
"""

from dataclasses import dataclass

import torch

from fused import runtime
from references.primitives import check_tensor

DTYPES = ("bfloat16", "float16", "float32")
MAX_PARTIALS = 16                   # K3's largest tensor-parallel degree


@dataclass(frozen=True)
class FoldConfig:
    """Threads per CTA (vectors of a row per CTA)."""
    threads: int = 128

    @property
    def name(self) -> str:
        return f"t{self.threads}"


def all_configs() -> list[FoldConfig]:
    return [FoldConfig(64), FoldConfig(128), FoldConfig(256)]


def default_config(B: int, N: int, vec: int, sms: int = 132) -> FoldConfig:
    """The widest CTA that still puts >= 2 CTAs per SM (a small grid is latency bound: more, smaller
    CTAs spread the loads over more SMs)."""
    chunks = -(-N // vec)
    for threads in (256, 128):
        if B * -(-chunks // threads) >= 2 * sms:
            return FoldConfig(threads)
    return FoldConfig(64)


def variants(tensors: dict, params: dict) -> list[FoldConfig]:
    """Every variant: the dispatcher may pick any of them at some B."""
    return all_configs()


def vector_width(N: int, elem_bytes: int) -> int:
    """Elements per load: 16 bytes' worth where N is a multiple of it, else the widest power of two dividing N."""
    vec = 16 // elem_bytes
    while N % vec:
        vec //= 2
    return vec


class AllreduceFold:
    """Compile-time configuration: working dtype, T partials, row width N, vector width, variant."""

    def __init__(self, dtype, n_parts: int, N: int, vec: int, cfg: FoldConfig):
        if not 1 <= n_parts <= MAX_PARTIALS:
            raise ValueError(f"parts: {n_parts} partials; the fused fold takes 1..{MAX_PARTIALS}")
        if N % vec:
            raise ValueError(f"variant: vector width {vec} does not divide N={N}")
        self.dtype, self.n_parts, self.N, self.vec, self.cfg = dtype, n_parts, N, vec, cfg
        self.chunks = N // vec

    def jit_host(self):
        _, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        threads = self.cfg.threads

        @cute.jit
        def host(mP: cute.Tensor, mO: cute.Tensor, stream):
            B = mO.shape[0]
            kernel(mP, mO).launch(grid=[(self.chunks + threads - 1) // threads, B, 1], block=[threads, 1, 1],
                                  stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32

        T, vec, chunks, threads, wd = self.n_parts, self.vec, self.chunks, self.cfg.threads, self.dtype

        @cute.kernel
        def kernel(mP: cute.Tensor, mO: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, row, _ = cute.arch.block_idx()
            c = bx * threads + tidx
            if c < chunks:
                part = lambda r: cute.zipped_divide(mP[r, row, None], (vec,))[None, c].load()
                acc = part(0).to(Float32)
                for r in cutlass.range_constexpr(1, T):
                    acc = acc + part(r).to(Float32)
                cute.zipped_divide(mO[row, None], (vec,))[None, c].store(acc.to(wd))

        return kernel


@runtime.compile_cache("allreduce_fold")
def _compile(dtype: str, n_parts: int, N: int, vec: int, cfg: FoldConfig):
    """parts (T, ?, N) with dynamic rank and row strides (multiples of vec), out (?, N) compact."""
    _, cute = runtime.cutlass_modules()
    dt = runtime.cutlass_dtype(dtype)
    align = vec * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    b = runtime.sym_int()
    parts = cute.runtime.make_fake_tensor(dt, (n_parts, b, N), (cute.sym_int64(divisibility=vec),
                                                                 cute.sym_int64(divisibility=vec), 1),
                                          assumed_align=align)
    op = AllreduceFold(dt, n_parts, N, vec, cfg)
    return runtime.compile_tvm_ffi(op.jit_host(), parts, runtime.fake_tensor(dtype, (b, N), align=align))


def _check(parts) -> None:
    check_tensor("parts", parts, ndim=3, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if not 1 <= parts.shape[0] <= MAX_PARTIALS:
        raise ValueError(f"parts: {parts.shape[0]} partials (dim 0); the fused fold takes 1..{MAX_PARTIALS}")
    if parts.shape[1] >= 65536:
        raise ValueError(f"parts: batch {parts.shape[1]} (dim 1) exceeds the grid's 65535 rows")
    runtime.require_cuda("parts", parts)


def _loadable(parts, vec: int):
    """parts itself where the kernel's vector loads can read it (column stride 1, rank and row strides
    and the base on whole vectors), else a contiguous copy."""
    e = parts.element_size()
    ok = (parts.stride(2) == 1 and parts.stride(0) % vec == 0 and parts.stride(1) % vec == 0
          and parts.data_ptr() % (vec * e) == 0)
    return parts if ok else parts.contiguous()


def launch(parts, out, variant=None) -> None:
    """The one launch on the current stream; writes out [B, N]."""
    T, B, N = parts.shape
    if B == 0 or N == 0:
        return
    vec = vector_width(N, parts.element_size())
    cfg = variant if variant is not None else default_config(B, N, vec, runtime.sm_count(parts.device))
    fn = _compile(runtime.dtype_name(parts.dtype), T, N, vec, cfg)
    dst = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
    fn(_loadable(parts, vec), dst)
    runtime.write_back(dst, out)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("allreduce_fold", mutates_args=("out",))
        def allreduce_fold_out(parts: torch.Tensor, out: torch.Tensor) -> None:
            launch(parts, out)

        _op = allreduce_fold_out
    return _op


def allreduce_fold(parts, *, variant=None):
    """Fused replacement of references.allreduce.allreduce_fold (same signature) -> out [B, N]."""
    _check(parts)
    out = torch.empty(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    if variant is not None:
        launch(parts, out, variant)
    else:
        _custom_op()(parts, out)
    return out
