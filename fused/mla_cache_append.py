"""mla_cache_append: cache[slot of seq_lens[b]] = cat(kv_c[b], k_rot[b]); seq_lens[b] += 1, one launch.

The slot is derived on the device: pos = seq_lens[b], page id = block_table[b, pos // page], slot =
page id * page + pos % page, in the index dtype (int32 or int64), so no host-built slot mapping and no
cat of the latent halves precede the launch. A sequence with no valid slot (pos < 0, no block-table
column for it, a page id outside the cache) writes nothing and keeps its length; the wrapper's
validate=True rejects those on the host first (one sync, skipped under CUDA-graph capture), as the
reference does.

Launch: grid ceil(B / seqs), block (threads, seqs): thread row y of a CTA owns sequence b; every
thread reads seq_lens[b] and its block-table entry, the CTA synchronises (so no thread reads a
length after it is advanced), then thread x copies 16-byte chunk x of the cache row (chunks of kv_c
first, then of k_rot; a chunk never straddles the two: vec divides both widths) and thread 0 stores
pos + 1. kv_c, k_rot and block_table may be strided (column slices of a merged projection), the
cache is taken as its contiguous [slots, C] view (32-bit slot offsets: slots * C < 2^31). One
compile per (dtype, kv_lora, rope, page, index dtypes, variant); batch and cache size dynamic.
"""
from dataclasses import dataclass

import torch

from fused import runtime
from fused.kda_verify_accept import capturing
from references.mla import INDEX_DTYPES
from references.mla_cache_append import check_append
from references.primitives import check_tensor


@dataclass(frozen=True)
class MlaCacheAppendConfig:
    seqs_per_cta: int = 1

    @property
    def name(self) -> str:
        return f"seqs{self.seqs_per_cta}"


def all_configs() -> list[MlaCacheAppendConfig]:
    return [MlaCacheAppendConfig(1), MlaCacheAppendConfig(4)]


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs."""
    return all_configs()


def vector_width(kv_lora: int, rope: int, elem_bytes: int) -> int:
    """Elements per copy: 16 bytes' worth where both widths are multiples of it, else the widest power of two dividing both."""
    vec = 16 // elem_bytes
    while kv_lora % vec or rope % vec:
        vec //= 2
    return vec


class MlaCacheAppend:
    def __init__(self, kv_lora: int, rope: int, page: int, vec: int, cfg: MlaCacheAppendConfig):
        self.page, self.vec, self.cfg = page, vec, cfg
        self.ckv, self.crot = kv_lora // vec, rope // vec
        self.threads = 32 * (-(-(self.ckv + self.crot) // 32))

    def jit_host(self):
        _, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        rows = self.cfg.seqs_per_cta

        @cute.jit
        def host(mKV: cute.Tensor, mRot: cute.Tensor, mC: cute.Tensor, mT: cute.Tensor, mL: cute.Tensor, stream):
            gKV = cute.zipped_divide(mKV, (1, self.vec))
            gRot = cute.zipped_divide(mRot, (1, self.vec))
            gC = cute.zipped_divide(mC, (1, self.vec))
            n = mKV.shape[0]
            kernel(gKV, gRot, gC, mT, mL).launch(grid=[(n + rows - 1) // rows, 1, 1],
                                                 block=[self.threads, rows, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32

        rows, page, ckv, crot = self.cfg.seqs_per_cta, self.page, self.ckv, self.crot

        @cute.kernel
        def kernel(gKV: cute.Tensor, gRot: cute.Tensor, gC: cute.Tensor, mT: cute.Tensor, mL: cute.Tensor):
            tidx, tidy, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            b = bidx * rows + tidy
            n, cols, n_slots = mL.shape[0], mT.shape[1], gC.shape[1][0]
            slot = Int32(-1)
            pos = mL.element_type(-1)
            if b < n:
                pos = mL[b]
                if pos >= 0:
                    col = pos // page
                    if col < cols:
                        pg = mT[b, col]
                        if pg >= 0:
                            if pg < n_slots // page:
                                slot = Int32(pg) * page + Int32(pos % page)
            cute.arch.sync_threads()                   # every thread has read pos before it advances
            if slot >= 0:
                if tidx < ckv:
                    gC[None, (slot, tidx)].store(gKV[None, (b, tidx)].load())
                elif tidx < ckv + crot:
                    gC[None, (slot, tidx)].store(gRot[None, (b, tidx - ckv)].load())
                if tidx == 0:
                    mL[b] = pos + 1

        return kernel


@runtime.compile_cache("mla_cache_append")
def _compile(dtype: str, kv_lora: int, rope: int, page: int, table_dtype: str, lens_dtype: str,
             cfg: MlaCacheAppendConfig):
    _, cute = runtime.cutlass_modules()
    dt = runtime.cutlass_dtype(dtype)
    e = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    vec = vector_width(kv_lora, rope, e)
    n, slots = runtime.sym_int(), runtime.sym_int()
    rowwise = lambda w: cute.runtime.make_fake_tensor(dt, (n, w), (cute.sym_int64(divisibility=vec), 1),
                                                      assumed_align=vec * e)
    ti, li = runtime.cutlass_dtype(table_dtype), runtime.cutlass_dtype(lens_dtype)
    table = cute.runtime.make_fake_tensor(ti, (n, runtime.sym_int()), (cute.sym_int64(), cute.sym_int64()),
                                          assumed_align=4 if table_dtype == "int32" else 8)
    lens = cute.runtime.make_fake_tensor(li, (n,), (cute.sym_int64(),), assumed_align=4 if lens_dtype == "int32" else 8)
    op = MlaCacheAppend(kv_lora, rope, page, vec, cfg)
    return runtime.compile_tvm_ffi(op.jit_host(), rowwise(kv_lora), rowwise(rope),
                                   runtime.fake_tensor(dtype, (slots, kv_lora + rope), align=16), table, lens)


def _check(kv_c, k_rot, cache, block_table, seq_lens) -> None:
    check_tensor("kv_c", kv_c, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    B = kv_c.shape[0]
    check_tensor("k_rot", k_rot, shape=(B, None), dtypes=(kv_c.dtype,))
    check_tensor("cache", cache, shape=(None, None, kv_c.shape[1] + k_rot.shape[1]), dtypes=(kv_c.dtype,))
    check_tensor("block_table", block_table, shape=(B, None), dtypes=INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=INDEX_DTYPES)
    if cache.numel() >= 2**31:
        raise ValueError(f"cache: {cache.numel()} elements exceed the kernel's 32-bit slot offsets")
    runtime.require_cuda("kv_c", kv_c)


def _rows(t, vec: int):
    """t itself where its rows can be copied in vec-element chunks (column stride 1, row stride and base
    on whole chunks), else a contiguous copy."""
    ok = t.stride(1) == 1 and t.stride(0) % vec == 0 and t.data_ptr() % (vec * t.element_size()) == 0
    return t if ok else t.contiguous()


def launch(kv_c, k_rot, cache, block_table, seq_lens, variant=None) -> None:
    if kv_c.shape[0] == 0:
        return
    cfg = variant or MlaCacheAppendConfig()
    kv_lora, rope = kv_c.shape[1], k_rot.shape[1]
    vec = vector_width(kv_lora, rope, kv_c.element_size())
    fn = _compile(runtime.dtype_name(kv_c.dtype), kv_lora, rope, cache.shape[1], runtime.dtype_name(block_table.dtype),
                  runtime.dtype_name(seq_lens.dtype), cfg)
    # the cache's [slots, C] view: a strided or misaligned cache goes through a copy, written back
    dst = runtime.aligned(cache) if cache.is_contiguous() else cache.contiguous()
    fn(_rows(kv_c, vec), _rows(k_rot, vec), dst.view(-1, kv_lora + rope), block_table, seq_lens)
    runtime.write_back(dst, cache)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_cache_append", mutates_args=("cache", "seq_lens"))
        def mla_cache_append_(kv_c: torch.Tensor, k_rot: torch.Tensor, cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
            launch(kv_c, k_rot, cache, block_table, seq_lens)

        _op = mla_cache_append_
    return _op


def mla_cache_append(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True, *, variant=None) -> None:
    """Fused replacement of references.mla_cache_append.mla_cache_append (same signature; updates cache
    and seq_lens in place). validate=True checks the lengths and the block table on the host as the
    reference does, except under CUDA-graph capture, where no host read is possible."""
    _check(kv_c, k_rot, cache, block_table, seq_lens)
    if validate and not capturing():
        check_append(cache, block_table, seq_lens)
    if variant is not None:
        launch(kv_c, k_rot, cache, block_table, seq_lens, variant)
    else:
        _custom_op()(kv_c, k_rot, cache, block_table, seq_lens)
    return None
