"""mla_q_absorb and mla_cache_append at one token in two launches instead of three.

In the MLA step, after mla_qkv_a, the layer runs mla_q_absorb (two launches: skinny_gemm's q_b GEMM into
a wd scratch q, then the absorption kernel) and mla_cache_append (one launch: kv_c and k_rot copied into
the paged cache at the slot of seq_lens, seq_lens advanced). The append reads nothing the q_b GEMM
writes and the GEMM reads nothing the append writes, so at one token they share one grid [1, n + 1, 1]
of 128 threads:

- blocks y < n are the q_b GEMV's CTAs: skinny_gemm.SkinnyGemm's device code of (N = H (Dh + rope),
  q_lora), each reading its column block from block y as in its own launch: q's bits;
- block y = n appends the one sequence with mla_cache_append's arithmetic: pos = seq_lens[0], page id =
  block_table[0, pos // page], slot = page id * page + pos % page, nothing written for a position with
  no valid slot; thread x copies 16-byte chunk x of the cache row (kv_c's chunks, then k_rot's), and
  thread 0 stores pos + 1 after the CTA has read pos: the cache row's and seq_lens' bits.

Then mla_q_absorb's absorption kernel runs on q unchanged (its compile, its dispatcher's config at one
token). Elsewhere (B > 1, a q_b pick other than the one-token SIMT GEMV, more cache-row chunks than the
GEMV's threads) the call is the two ops' own launches.

The layer step calls it through fused.layers.JOINT where it lists it (the two ops are consecutive
there). There is no registry op of the pair: each half is its op's kernel, and the pair's bits against
the two ops' launches are its GPU tests'.
"""
import torch

from fused import grid_sync
from fused import mla_cache_append as ca
from fused import mla_q_absorb as mq
from fused import runtime
from fused import skinny_gemm as sg
from fused.kda_verify_accept import capturing
from references.mla_cache_append import check_append

DTYPES = mq.DTYPES


def one_launch_config(B: int, H: int, Dh: int, rope: int, q_lora: int, kv_lora: int, elem_bytes: int = 2):
    """The q_b GEMV's config where the GEMV and the append share a launch (one token, skinny_gemm's pick
    the SIMT GEMV of one row, the cache row in at most 128 chunks), else None."""
    cfg = grid_sync.one_row_gemv(B, H * (Dh + rope), q_lora)      # its CTAs run skinny_gemm's 128 threads
    if cfg is None:
        return None
    vec = ca.vector_width(kv_lora, rope, elem_bytes)
    return cfg if (kv_lora + rope) // vec <= mq.THREADS else None


class QbAppend:
    """Compile-time config: dtype, the q_b GEMV (N, q_lora, its config), the cache row (kv_lora, rope,
    page, its chunk width)."""

    def __init__(self, dtype: str, N: int, q_lora: int, gemm: sg.SkinnyGemmConfig, kv_lora: int, rope: int,
                 page: int):
        self.dtype = runtime.cutlass_dtype(dtype)
        self.gemm = sg.SkinnyGemm(N, q_lora, gemm)
        if self.gemm.threads != mq.THREADS:
            raise ValueError(f"the q_b GEMV runs {self.gemm.threads} threads; the shared grid runs {mq.THREADS}")
        self.n = N // self.gemm.nt
        self.vec = ca.vector_width(kv_lora, rope, self.dtype.width // 8)
        self.ckv, self.crot, self.page = kv_lora // self.vec, rope // self.vec, page
        if self.ckv + self.crot > mq.THREADS:
            raise ValueError(f"the cache row is {self.ckv + self.crot} chunks; the append CTA has {mq.THREADS} threads")

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32

        body, n, page, ckv, crot, vec = self.gemm.device_body(), self.n, self.page, self.ckv, self.crot, self.vec

        @cute.kernel
        def kernel(gX: cute.Tensor, gW: cute.Tensor, mQ: cute.Tensor, gKV: cute.Tensor, gRot: cute.Tensor,
                   gC: cute.Tensor, mT: cute.Tensor, mL: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            _, by, _ = cute.arch.block_idx()
            if by < n:                                 # the q_b GEMV's CTA `by`
                body(gX, gW, mQ)
            else:                                      # the append of sequence 0
                cols, n_slots = mT.shape[1], gC.shape[1][0]
                slot = Int32(-1)
                pos = mL[0]
                if pos >= 0:
                    col = pos // page
                    if col < cols:
                        pg = mT[0, col]
                        if pg >= 0:
                            if pg < n_slots // page:
                                slot = Int32(pg) * page + Int32(pos % page)
                cute.arch.sync_threads()               # every thread has read pos before it advances
                if slot >= 0:
                    if tidx < ckv:
                        gC[None, (slot, tidx)].store(gKV[None, (0, tidx)].load())
                    elif tidx < ckv + crot:
                        gC[None, (slot, tidx)].store(gRot[None, (0, tidx - ckv)].load())
                    if tidx == 0:
                        mL[0] = pos + 1

        @cute.jit
        def host(mX: cute.Tensor, mW: cute.Tensor, mQ: cute.Tensor, mKV: cute.Tensor, mRot: cute.Tensor,
                 mC: cute.Tensor, mT: cute.Tensor, mL: cute.Tensor, stream):
            gX = cute.zipped_divide(mX, (1, self.gemm.vec))
            gW = cute.zipped_divide(mW, (1, self.gemm.vec))
            gKV = cute.zipped_divide(mKV, (1, vec))
            gRot = cute.zipped_divide(mRot, (1, vec))
            gC = cute.zipped_divide(mC, (1, vec))
            kernel(gX, gW, mQ, gKV, gRot, gC, mT, mL).launch(grid=[1, n + 1, 1], block=[mq.THREADS, 1, 1],
                                                             stream=stream)

        return host


@runtime.compile_cache("mla_q_absorb_cache_append")
def _compile(dtype: str, N: int, q_lora: int, gemm: sg.SkinnyGemmConfig, kv_lora: int, rope: int, page: int,
             table_dtype: str, lens_dtype: str):
    _, cute = runtime.cutlass_modules()
    op = QbAppend(dtype, N, q_lora, gemm, kv_lora, rope, page)
    dt, e, vec = op.dtype, op.dtype.width // 8, op.vec
    row = lambda w: cute.runtime.make_fake_tensor(dt, (1, w), (cute.sym_int64(divisibility=vec), 1),
                                                  assumed_align=vec * e)
    ti, li = runtime.cutlass_dtype(table_dtype), runtime.cutlass_dtype(lens_dtype)
    table = cute.runtime.make_fake_tensor(ti, (1, runtime.sym_int()), (cute.sym_int64(), cute.sym_int64()),
                                          assumed_align=4 if table_dtype == "int32" else 8)
    lens = cute.runtime.make_fake_tensor(li, (1,), (cute.sym_int64(),), assumed_align=4 if lens_dtype == "int32" else 8)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(dtype, (1, q_lora)),
        runtime.fake_tensor(dtype, (N, q_lora)),
        runtime.fake_tensor(dtype, (1, N), align=2),
        row(kv_lora), row(rope),
        runtime.fake_tensor(dtype, (runtime.sym_int(), kv_lora + rope), align=16), table, lens)


def launch(q_c, w_q_b, w_uk, out, kv_c, k_rot, cache, block_table, seq_lens, gemm: sg.SkinnyGemmConfig) -> None:
    """The two launches for one token (gemm: one_launch_config's pick): q_abs into `out`, the append."""
    H, Dh, kv_lora = w_uk.shape
    N, q_lora = w_q_b.shape
    rope = N // H - Dh
    if q_c.shape[0] != 1:
        raise ValueError(f"q_c: {q_c.shape[0]} tokens; the shared q_b + append launch takes 1")
    vec = ca.vector_width(kv_lora, rope, kv_c.element_size())
    q = torch.empty(1, N, dtype=q_c.dtype, device=q_c.device)
    dst = runtime.aligned(cache) if cache.is_contiguous() else cache.contiguous()
    fn = _compile(runtime.dtype_name(q_c.dtype), N, q_lora, gemm, kv_lora, rope, cache.shape[1],
                  runtime.dtype_name(block_table.dtype), runtime.dtype_name(seq_lens.dtype))
    fn(runtime.aligned(q_c.contiguous()), runtime.aligned(w_q_b.contiguous()), q, ca._rows(kv_c, vec),
       ca._rows(k_rot, vec), dst.view(-1, kv_lora + rope), block_table, seq_lens)
    runtime.write_back(dst, cache)
    absorb = mq._compile(runtime.dtype_name(q_c.dtype), H, Dh, rope, kv_lora, mq.default_absorb(1, H))
    o = runtime.aligned(out)
    absorb(q, runtime.aligned(w_uk.contiguous().reshape(H * Dh, kv_lora)), o.view(1, -1))
    runtime.write_back(o, out)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_q_absorb_cache_append", mutates_args=("out", "cache", "seq_lens"))
        def mla_q_absorb_cache_append_(q_c: torch.Tensor, w_q_b: torch.Tensor, w_uk: torch.Tensor,
                                       out: torch.Tensor, kv_c: torch.Tensor, k_rot: torch.Tensor,
                                       cache: torch.Tensor, block_table: torch.Tensor,
                                       seq_lens: torch.Tensor) -> None:
            H, Dh, kv_lora = w_uk.shape
            gemm = one_launch_config(1, H, Dh, w_q_b.shape[0] // H - Dh, w_q_b.shape[1], kv_lora, q_c.element_size())
            launch(q_c, w_q_b, w_uk, out, kv_c, k_rot, cache, block_table, seq_lens, gemm)

        _op = mla_q_absorb_cache_append_
    return _op


def mla_q_absorb_cache_append(q_c, w_q_b, w_uk, kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True,
                              *, out=None):
    """q_abs [B, H, kv_lora + rope] = references.mla.mla_q_absorb(q_c, w_q_b, w_uk), and cache and
    seq_lens updated in place as references.mla_cache_append.mla_cache_append(kv_c, k_rot, cache,
    block_table, seq_lens, validate) updates them: at one token in two launches where one_launch_config
    allows, else mla_q_absorb's and mla_cache_append's own. out: q_abs's tensor."""
    mq._check(q_c, w_q_b, w_uk, out)
    ca._check(kv_c, k_rot, cache, block_table, seq_lens)
    B, (H, Dh, kv_lora) = q_c.shape[0], w_uk.shape
    rope = w_q_b.shape[0] // H - Dh
    if kv_c.shape[0] != B:
        raise ValueError(f"kv_c: {kv_c.shape[0]} rows; q_c has {B}")
    if kv_c.shape[1] != kv_lora or k_rot.shape[1] != rope:
        raise ValueError(f"kv_c, k_rot: widths {kv_c.shape[1]}, {k_rot.shape[1]}; w_uk and w_q_b give "
                         f"kv_lora {kv_lora}, rope {rope}")
    if one_launch_config(B, H, Dh, rope, q_c.shape[1], kv_lora, q_c.element_size()) is None:
        q_abs = mq.mla_q_absorb(q_c, w_q_b, w_uk, out=out)
        ca.mla_cache_append(kv_c, k_rot, cache, block_table, seq_lens, validate)
        return q_abs
    if validate and not capturing():
        check_append(cache, block_table, seq_lens)
    if out is None:
        out = torch.empty(B, H, kv_lora + rope, dtype=q_c.dtype, device=q_c.device)
    _custom_op()(q_c, w_q_b, w_uk, out, kv_c, k_rot, cache, block_table, seq_lens)
    return out
