"""mla_qkv_a in one launch at B = 1: the q_a / kv_a GEMV, then the two latent RMSNorms in the grid's
last CTA.

fused.mla_qkv_a runs two launches: skinny_gemm's GEMM of the N = q_lora + kv_lora + rope rows into a wd
scratch, then the norm kernel (one CTA of T_n threads per token row: fused.mla_qkv_a.MlaLatentNorms).
At one token the GEMM is the SIMT GEMV of 128 threads and the norm is one CTA. Here both run in one
grid, as fused.router_topk_onelaunch does:

- every CTA computes its columns of the row with the GEMV's device code (skinny_gemm.SkinnyGemm: the
  same bits), makes them visible at GPU scope (fence.acq_rel.gpu, a barrier) and takes a ticket from
  an int32 counter (atomic add, acq_rel, gpu scope);
- the CTA that draws the last ticket has seen every other CTA's release: it runs the norm kernel's
  arithmetic for the row and puts the counter back to 0 for the next launch and every graph replay.

The norm's bits depend on its thread count T_n (each thread's sum of squares over its vectors u,
u + T_n, ..., a butterfly per warp of 32, the warps' sums in warp order). The last CTA has 128 threads
and plays the T_n threads of the norm variant in rounds: in round i its thread t is the norm's thread
u = 128 i + t, with the same vectors, the same per-thread sums and, since 32 divides 128, the same lanes
in each warp's butterfly (its warp w is the norm's warp 4 i + w); the warps' sums go to shared memory
and are added in the norm's warp order. So q_c, kv_c and k_rot are mla_qkv_a's bits for each norm
variant (NormConfig), the dispatcher's pick included.

Above one token, or where skinny_gemm's pick is not the one-row SIMT GEMV, the call is fused.mla_qkv_a's
two launches. The counter and the scratch row are kept per (device, stream, dtype, N)
(fused.grid_sync.kept).

The candidate: `--candidate fused.mla_qkv_a_onelaunch:mla_qkv_a`; its variants are mla_qkv_a's.
"""
import operator

import torch

from fused import grid_sync
from fused import mla_qkv_a as mq
from fused import runtime
from fused import skinny_gemm as sg

DTYPES = mq.DTYPES
THREADS = sg.THREADS               # the GEMV's threads, the CTA that plays the norm's

one_launch_gemm = grid_sync.one_row_gemv   # the GEMM's pick where this form runs in one launch, else None


class MlaQkvAOneLaunch:
    """Compile-time config: dtype, q_lora, kv_lora, rope (whole 16-byte vectors), D, the GEMV's config and
    the norm variant whose arithmetic the last CTA plays."""

    def __init__(self, dtype: str, q_lora: int, kv_lora: int, rope: int, D: int, gemm: sg.SkinnyGemmConfig,
                 norm: mq.NormConfig):
        self.dtype = runtime.cutlass_dtype(dtype)
        self.vec = 128 // self.dtype.width
        for name, n in (("q_lora", q_lora), ("kv_lora", kv_lora), ("rope", rope)):
            if n % self.vec or n == 0:
                raise ValueError(f"{name}: {n} must be a positive multiple of {self.vec} (16-byte vectors)")
        if norm.num_threads % 32 or norm.num_threads <= 0:
            raise ValueError(f"norm: {norm.num_threads} threads is not a whole number of warps")
        self.q_lora, self.kv_lora = q_lora, kv_lora
        self.N = q_lora + kv_lora + rope
        self.gemm = sg.SkinnyGemm(self.N, D, gemm)
        self.n_ctas = self.N // self.gemm.nt
        self.nq, self.nqkv, self.n_vec = q_lora // self.vec, (q_lora + kv_lora) // self.vec, self.N // self.vec
        self.tn = norm.num_threads                       # the norm variant's threads
        self.vpt = -(-self.n_vec // self.tn)             # its vectors per thread
        self.rounds = -(-self.tn // THREADS)             # rounds of 128 threads playing them

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        g = self.gemm
        body, draw = g.device_body(), grid_sync.make_draw()
        vec, dt, tn, vpt, rounds = self.vec, self.dtype, self.tn, self.vpt, self.rounds
        nq, nqkv, n_vec, n = self.nq, self.nqkv, self.n_vec, self.n_ctas
        warps_n, warps = tn // 32, THREADS // 32

        @cute.jit
        def norms(mM: cute.Tensor, mWq: cute.Tensor, mWkv: cute.Tensor, mQ: cute.Tensor, mKV: cute.Tensor,
                  mRot: cute.Tensor, eps: Float32, red: cute.Tensor):
            """The norm kernel's arithmetic for row 0, its tn threads played in rounds of 128."""
            tidx, _, _ = cute.arch.thread_idx()
            warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
            gX = cute.zipped_divide(mM[0, None], (vec,))
            gQ = cute.zipped_divide(mQ[0, None], (vec,))
            gKV = cute.zipped_divide(mKV[0, None], (vec,))
            gRot = cute.zipped_divide(mRot[0, None], (vec,))
            gWq, gWkv = cute.zipped_divide(mWq, (vec,)), cute.zipped_divide(mWkv, (vec,))
            part = cute.make_rmem_tensor(2, Float32)
            for i in cutlass.range_constexpr(rounds):
                u = tidx + i * THREADS                    # the norm's thread this one plays
                part.fill(0.0)
                if u < tn:
                    for j in cutlass.range_constexpr(vpt):
                        c = u + j * tn
                        if c < n_vec:
                            xv = gX[None, c].load()
                            v = xv.to(Float32)
                            s = (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                            if c < nq:
                                part[0] += s
                            elif c < nqkv:
                                part[1] += s
                            else:
                                gRot[None, c - nqkv].store(xv)
                for k in cutlass.range_constexpr(2):
                    t = cute.arch.warp_reduction(part[k], operator.add)
                    if i * warps + warp < warps_n:
                        if lane == 0:
                            red[k, i * warps + warp] = t
            cute.arch.sync_threads()
            for k in cutlass.range_constexpr(2):
                t = red[k, 0]
                for j in cutlass.range_constexpr(1, warps_n):
                    t = t + red[k, j]
                part[k] = t
            rstd_q = cute.math.rsqrt(part[0] / self.q_lora + eps)
            rstd_kv = cute.math.rsqrt(part[1] / self.kv_lora + eps)
            for i in cutlass.range_constexpr(rounds):
                u = tidx + i * THREADS
                if u < tn:
                    for j in cutlass.range_constexpr(vpt):
                        c = u + j * tn
                        if c < nqkv:
                            xv = gX[None, c].load().to(Float32)
                            if c < nq:
                                y = (xv * rstd_q).to(dt).to(Float32)
                                gQ[None, c].store((y * gWq[None, c].load().to(Float32)).to(dt))
                            else:
                                y = (xv * rstd_kv).to(dt).to(Float32)
                                gKV[None, c - nq].store((y * gWkv[None, c - nq].load().to(Float32)).to(dt))

        @cute.kernel
        def kernel(gX: cute.Tensor, gW: cute.Tensor, mM: cute.Tensor, mWq: cute.Tensor, mWkv: cute.Tensor,
                   mQ: cute.Tensor, mKV: cute.Tensor, mRot: cute.Tensor, mCnt: cute.Tensor, eps: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            body(gX, gW, mM)                              # this CTA's columns of the row
            smem = cutlass.memory.SmemAllocator()
            ticket = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
            red = smem.allocate_tensor(Float32, cute.make_layout((2, warps_n), stride=(warps_n, 1)), 16)
            draw(mCnt, ticket)
            if ticket[0] == Int32(n - 1):                 # every other CTA's columns are visible
                cute.arch.fence_acq_rel_gpu()
                norms(mM, mWq, mWkv, mQ, mKV, mRot, eps, red)
                if tidx == 0:
                    mCnt[0] = Int32(0)

        @cute.jit
        def host(mX: cute.Tensor, mW: cute.Tensor, mM: cute.Tensor, mWq: cute.Tensor, mWkv: cute.Tensor,
                 mQ: cute.Tensor, mKV: cute.Tensor, mRot: cute.Tensor, mCnt: cute.Tensor, eps: Float32, stream):
            gX = cute.zipped_divide(mX, (1, g.vec))
            gW = cute.zipped_divide(mW, (1, g.vec))
            kernel(gX, gW, mM, mWq, mWkv, mQ, mKV, mRot, mCnt, eps).launch(
                grid=[1, n, 1], block=[THREADS, 1, 1], stream=stream)

        return host


@runtime.compile_cache("mla_qkv_a_onelaunch")
def _compile(dtype: str, q_lora: int, kv_lora: int, rope: int, D: int, gemm: sg.SkinnyGemmConfig,
             norm: mq.NormConfig):
    cutlass, _ = runtime.cutlass_modules()
    op = MlaQkvAOneLaunch(dtype, q_lora, kv_lora, rope, D, gemm, norm)
    t = lambda *shape: runtime.fake_tensor(dtype, shape)
    return runtime.compile_tvm_ffi(op.jit_host(), t(1, D), t(op.N, D), t(1, op.N), t(q_lora), t(kv_lora),
                                   t(1, q_lora), t(1, kv_lora), t(1, rope),
                                   runtime.fake_tensor("int32", (1,), align=4), cutlass.Float32(1e-6))


def buffers(device, dtype: torch.dtype, N: int):
    """(the row's scratch [1, N] wd, counter [1] int32, zeroed once) kept for `device` and its current
    stream (grid_sync.kept): the kernel leaves the counter at zero."""
    return grid_sync.kept(device, ("mla_qkv_a_onelaunch", dtype, N),
                          lambda: (torch.empty(1, N, dtype=dtype, device=device),
                                   torch.zeros(1, dtype=torch.int32, device=device)))


def launch(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, q_c, kv_c, k_rot, eps: float, gemm: sg.SkinnyGemmConfig,
           norm: mq.NormConfig) -> None:
    """The one launch for one token (gemm: one_launch_gemm's pick); writes q_c, kv_c and k_rot."""
    B, D = x.shape
    if B != 1:
        raise ValueError(f"x: {B} tokens; the one-launch q_a / kv_a projection takes 1")
    N, q_lora, kv_lora = w_qkv_a.shape[0], q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
    scratch, counter = buffers(x.device, x.dtype, N)
    fn = _compile(runtime.dtype_name(x.dtype), q_lora, kv_lora, N - q_lora - kv_lora, D, gemm, norm)
    dst = [runtime.aligned(t) for t in (q_c, kv_c, k_rot)]   # 16-byte stores: misaligned views via a copy
    fn(runtime.aligned(x.contiguous()), runtime.aligned(w_qkv_a.contiguous()), scratch,
       runtime.aligned(q_a_norm_w.contiguous()), runtime.aligned(kv_a_norm_w.contiguous()), *dst, counter, eps)
    for copy, caller in zip(dst, (q_c, kv_c, k_rot)):
        runtime.write_back(copy, caller)


def _pick(x, w_qkv_a, variant: mq.MlaQkvAConfig | None):
    """(gemm, norm) where this call runs in one launch, else None."""
    (M, D), N = x.shape, w_qkv_a.shape[0]
    gemm = one_launch_gemm(M, N, D)
    if gemm is None:
        return None
    norm = mq.NormConfig.for_shape(N // (16 // x.element_size()))
    if variant is not None:
        if variant.gemm != gemm:
            return None
        norm = variant.norm
    return gemm, norm


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_qkv_a_onelaunch", mutates_args=("q_c", "kv_c", "k_rot"))
        def mla_qkv_a_onelaunch_out(x: torch.Tensor, w_qkv_a: torch.Tensor, q_a_norm_w: torch.Tensor,
                                    kv_a_norm_w: torch.Tensor, q_c: torch.Tensor, kv_c: torch.Tensor,
                                    k_rot: torch.Tensor, eps: float) -> None:
            launch(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, q_c, kv_c, k_rot, eps, *_pick(x, w_qkv_a, None))

        _op = mla_qkv_a_onelaunch_out
    return _op


def mla_qkv_a(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float, *, out=None, variant=None):
    """Fused replacement of references.mla.mla_qkv_a (same signature): (q_c, kv_c, k_rot), in one launch
    at one token where one_launch_gemm allows (any norm variant), else fused.mla_qkv_a's two."""
    mq._check(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, out)
    pick = _pick(x, w_qkv_a, variant)
    if pick is None:
        return mq.mla_qkv_a(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, out=out, variant=variant)
    if out is None:
        q_lora, kv_lora = q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
        out = tuple(torch.empty(1, n, dtype=x.dtype, device=x.device)
                    for n in (q_lora, kv_lora, w_qkv_a.shape[0] - q_lora - kv_lora))
    if variant is not None:
        launch(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, *out, float(eps), *pick)
    else:
        _custom_op()(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, *out, float(eps))
    return tuple(out)


variants = mq.variants
