"""mla_cache_write: cache.view(-1, C)[slot_mapping[i]] = latent[i] for slot >= 0, in place.

One CTA per token row: thread t copies 16-byte chunk t of the row (C static, a multiple of
16 bytes). A negative slot (padding) writes nothing; no other cache byte is touched. The cache is
taken as the contiguous [slots, C] view (layout indices are 32-bit: slots * C < 2^31).
"""
from dataclasses import dataclass

import torch

from fused import runtime


@dataclass(frozen=True)
class MlaCacheWriteConfig:
    rows_per_cta: int = 1

    @property
    def name(self) -> str:
        return f"rows{self.rows_per_cta}"


def all_configs() -> list[MlaCacheWriteConfig]:
    return [MlaCacheWriteConfig(1), MlaCacheWriteConfig(4)]


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs."""
    return all_configs()


class MlaCacheWrite:
    def __init__(self, C: int, elem_bytes: int, cfg: MlaCacheWriteConfig):
        self.vec = 16 // elem_bytes
        self.chunks = C // self.vec
        self.threads = 32 * (-(-self.chunks // 32))
        self.cfg = cfg

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        rows = self.cfg.rows_per_cta

        @cute.jit
        def host(mL: cute.Tensor, mC: cute.Tensor, mSlot: cute.Tensor, stream):
            gL = cute.zipped_divide(mL, (1, self.vec))
            gC = cute.zipped_divide(mC, (1, self.vec))
            n = mL.shape[0]
            kernel(gL, gC, mSlot, n).launch(grid=[(n + rows - 1) // rows, 1, 1],
                                            block=[self.threads, rows, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32

        chunks, rows = self.chunks, self.cfg.rows_per_cta

        @cute.kernel
        def kernel(gL: cute.Tensor, gC: cute.Tensor, mSlot: cute.Tensor, n: Int32):
            tidx, tidy, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            i = bidx * rows + tidy
            if i < n:
                slot = mSlot[i]
                if slot >= 0:
                    if tidx < chunks:
                        gC[None, (Int32(slot), tidx)].store(gL[None, (i, tidx)].load())

        return kernel


@runtime.compile_cache("mla_cache_write")
def _compile(dtype: str, C: int, cfg: MlaCacheWriteConfig):
    n, slots = runtime.sym_int(), runtime.sym_int()
    op = MlaCacheWrite(C, torch.empty(0, dtype=getattr(torch, dtype)).element_size(), cfg)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(dtype, (n, C)),
        runtime.fake_tensor(dtype, (slots, C)),
        runtime.fake_tensor("int64", (n,), align=8))


def _check(latent, cache, slot_mapping):
    if latent.dim() != 2 or cache.dim() != 3 or cache.shape[2] != latent.shape[1]:
        raise ValueError(f"cache: expected [P, page, {latent.shape[1] if latent.dim() == 2 else 'C'}], "
                         f"got {tuple(cache.shape)} for latent {tuple(latent.shape)}")
    if cache.dtype != latent.dtype:
        raise TypeError(f"cache: dtype {cache.dtype} differs from latent's {latent.dtype}")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (latent.shape[0],):
        raise ValueError(f"slot_mapping: expected int64 [{latent.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if (latent.shape[1] * latent.element_size()) % 16:
        raise ValueError(f"latent: row of {latent.shape[1]} elements is not a multiple of 16 bytes")
    if not cache.is_contiguous():
        raise ValueError("cache: the fused kernel writes the contiguous [slots, C] view; got a strided cache")
    if cache.numel() >= 2**31:
        raise ValueError(f"cache: {cache.numel()} elements exceed the kernel's 32-bit indexing")
    runtime.require_cuda("latent", latent)


def launch(latent, cache, slot_mapping, variant=None) -> None:
    if latent.shape[0] == 0:
        return
    cfg = variant or MlaCacheWriteConfig()
    fn = _compile(runtime.dtype_name(latent.dtype), latent.shape[1], cfg)
    # 16-byte chunks of latent and cache rows: a misaligned base is copied first (the whole cache,
    # then copied back: only a caller's odd view pays it)
    src, dst = runtime.aligned(latent), runtime.aligned(cache)
    fn(src, dst.view(-1, latent.shape[1]), slot_mapping)
    runtime.write_back(dst, cache)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_cache_write", mutates_args=("cache",))
        def mla_cache_write_(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
            launch(latent.contiguous(), cache, slot_mapping.contiguous())

        _op = mla_cache_write_
    return _op


def mla_cache_write(latent, cache, slot_mapping, *, variant=None) -> None:
    """Fused replacement of references.mla.mla_cache_write (same signature; updates cache)."""
    _check(latent, cache, slot_mapping)
    if variant is not None:
        launch(latent.contiguous(), cache, slot_mapping.contiguous(), variant)
    else:
        _custom_op()(latent, cache, slot_mapping)
    return None
