"""allreduce_latent_norm_up: the MoE tail of a rank in one launch,
out[B, D] = wd(prefix + wd(wd(rms_norm(fold(y_parts), norm_w) @ w_up.T) + fold(shared_parts))),
fold = the rank 0..T-1 left fold in fp32 rounded once to wd (references/moe_tp.py).

`FoldNormUp` is latent_norm_up's GEMV (fused/latent_norm_up.py: a CTA owns `rows_per_warp` x 4
consecutive rows of w_up, lane l of a warp the 16-byte chunks l, l + 32, ... of each row) with the
all-reduce folds and the residual moved inside. Per pass of `tokens` tokens:

  1. Stage (the CTA's 128 threads): for each token, thread t takes the chunks t, t + 128, ... of the
     latent row, folds the T partials' chunks in rank order in fp32, rounds to wd (the reference's
     folded latent, bit for bit) and stores it to shared memory; it sums the squares of its chunks
     in order (fp32). The 128 sums are added by the warp's xor butterfly (offsets 16, .., 1), then
     warp 0 + warp 1 + warp 2 + warp 3 in that order: r = rsqrt(sum / L + eps). Each thread then
     rewrites its own chunks normed, xn = wd(norm_w * wd(x * r)) (both products in fp32, as the
     reference rounds them). The fold happens once per CTA and the norm once per element, not per
     warp: the warps read the normed row from shared memory.
  2. GEMV: per chunk, the R weight chunks from global memory and each token's normed chunk from
     shared memory, fp32 FMAs in chunk order per (token, row), then kda_decode's transpose_sum (the
     xor butterfly over the warp, all pairs at once).
  3. Epilogue (the lane holding a pair): o = wd(acc); s = the fold of the T shared partials at (b, n)
     in rank order, rounded to wd; mlp = wd(o + s); out = wd(prefix + mlp).

Every order above depends only on L and T (the staging order on the fixed 128 threads), never on B,
the pass size or the rows per warp: every variant gives the same bits, deterministic and batch
invariant. y_parts and shared_parts may be strided (the column halves of a gathered [T, B, L + D]
row): their rank and row strides are dynamic, the column stride 1. One compile per
(dtype, T, D, L, variant); the batch is dynamic.
"""

import torch

from fused import runtime
from fused.allreduce_fold import _loadable        # a gathered row's column half read in place where it can be
from fused.kda_decode import KdaDecode                # its transpose_sum: the warp's many-value reduce
from fused.latent_norm_up import VEC, WARPS, NormUpConfig, all_configs, default_config
from references.primitives import check_tensor

DTYPES = ("bfloat16", "float16")   # working dtypes of every operand (the harness draws only these)
THREADS = 32 * WARPS
MAX_PARTIALS = 16                  # K3's largest tensor-parallel degree
MAX_TOKENS = 8                     # tokens per pass: the staged normed rows, tokens x L x 2 bytes of shared memory


def configs(D: int) -> list[NormUpConfig]:
    """latent_norm_up's tiles whose staged rows fit (tokens <= MAX_TOKENS)."""
    return [c for c in all_configs(D) if c.tokens <= MAX_TOKENS]


def pick(B: int, D: int, sms: int = 132) -> NormUpConfig:
    """latent_norm_up's dispatcher, its tokens per pass capped at MAX_TOKENS."""
    c = default_config(B, D, sms)
    return NormUpConfig(c.rows_per_warp, min(c.tokens, MAX_TOKENS))


def variants(tensors: dict, params: dict) -> list[NormUpConfig]:
    """What the harness certifies: every tokens per pass with the rows per warp the dispatcher picks for
    this D (the dispatcher's pick at every B is one of them)."""
    D = tensors["w_up"].shape[0]
    rows = pick(1, D).rows_per_warp
    return [c for c in configs(D) if c.rows_per_warp == rows]


class FoldNormUp:
    """Compile-time configuration: working dtype, T partials, D output columns, latent width L, tile."""

    def __init__(self, dtype, n_parts: int, D: int, L: int, cfg: NormUpConfig):
        if not 1 <= n_parts <= MAX_PARTIALS:
            raise ValueError(f"y_parts: {n_parts} partials; the fused tail takes 1..{MAX_PARTIALS}")
        if L % VEC or D % cfg.rows_per_cta:
            raise ValueError(f"variant: {cfg.name} needs L % {VEC} == 0 and D % {cfg.rows_per_cta} == 0, "
                             f"got L={L}, D={D}")
        pairs = cfg.rows_per_warp * cfg.tokens
        if pairs > 32 or pairs & (pairs - 1) or cfg.tokens > MAX_TOKENS:
            raise ValueError(f"variant: {cfg.name}: rows_per_warp x tokens = {pairs} must be a power of two "
                             f"<= 32, tokens <= {MAX_TOKENS}")
        self.dtype, self.T, self.D, self.L, self.cfg = dtype, n_parts, D, L, cfg
        self.chunks = L // VEC                         # 16-byte chunks per row
        self.iters = -(-self.chunks // 32)             # GEMV chunks per lane
        self.even = self.chunks % 32 == 0
        self.stage_iters = -(-self.chunks // THREADS)  # staged chunks per thread and token

    def jit_host(self):
        _, cute = runtime.cutlass_modules()
        from cutlass import Float32
        kernel = self.device_kernel()

        @cute.jit
        def host(mPre: cute.Tensor, mY: cute.Tensor, mS: cute.Tensor, mN: cute.Tensor, mW: cute.Tensor,
                 mO: cute.Tensor, eps: Float32, stream):
            gN = cute.zipped_divide(mN, (1, VEC))
            gW = cute.zipped_divide(mW, (1, VEC))
            kernel(mPre, mY, mS, gN, gW, mO, eps).launch(grid=[self.D // self.cfg.rows_per_cta, 1, 1],
                                                          block=[THREADS, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32

        R, MT, IT, CH, L, T = self.cfg.rows_per_warp, self.cfg.tokens, self.iters, self.chunks, self.L, self.T
        SI, even, wd = self.stage_iters, self.even, self.dtype
        span = 32 // (MT * R)                               # lanes holding one (token, row) sum

        @cute.kernel
        def kernel(mPre: cute.Tensor, mY: cute.Tensor, mS: cute.Tensor, gN: cute.Tensor, gW: cute.Tensor,
                   mO: cute.Tensor, eps: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
            bidx, _, _ = cute.arch.block_idx()
            n0 = bidx * (WARPS * R) + warp * R              # this warp's first output column
            B = mO.shape[0]
            smem = cutlass.memory.SmemAllocator()
            sX = smem.allocate_tensor(wd, cute.make_layout((MT, L), stride=(L, 1)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((WARPS, MT), stride=(MT, 1)), 16)
            gX = cute.zipped_divide(sX, (1, VEC))
            xc = cute.make_rmem_tensor(cute.make_layout((VEC, MT)), wd)
            wc = cute.make_rmem_tensor(cute.make_layout((VEC, R)), wd)
            rsr = cute.make_rmem_tensor(cute.make_layout((MT,)), Float32)
            accr = cute.make_rmem_tensor(cute.make_layout((MT * R,)), Float32)
            xn = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            xc.fill(0.0)
            wc.fill(0.0)
            for p in cutlass.range((B + MT - 1) // MT):
                b0 = p * MT
                # 1. stage: the folded latent rows (clamped past B: computed, never stored) and their squares
                for m in cutlass.range_constexpr(MT):
                    b = cutlass.min(b0 + m, B - 1)
                    ss = Float32(0.0)
                    for i in cutlass.range_constexpr(SI):
                        kv = tidx + THREADS * i
                        if kv < CH:
                            acc = cute.zipped_divide(mY[0, b, None], (VEC,))[None, kv].load().to(Float32)
                            for r in cutlass.range_constexpr(1, T):
                                acc = acc + cute.zipped_divide(mY[r, b, None], (VEC,))[None, kv].load().to(Float32)
                            yv = acc.to(wd)
                            gX[None, (m, kv)].store(yv)
                            yf = yv.to(Float32)
                            for e in cutlass.range_constexpr(VEC):
                                ss = ss + yf[e] * yf[e]
                    for off in (16, 8, 4, 2, 1):
                        ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=off)
                    if lane == 0:
                        sRed[warp, m] = ss
                cute.arch.sync_threads()
                for m in cutlass.range_constexpr(MT):
                    tot = sRed[0, m]
                    for w in cutlass.range_constexpr(1, WARPS):
                        tot = tot + sRed[w, m]
                    rsr[m] = cute.math.rsqrt(tot / Float32(L) + eps)
                # ... each thread's own chunks normed in place (no other thread reads them before the barrier)
                for m in cutlass.range_constexpr(MT):
                    rm = rsr[m]
                    for i in cutlass.range_constexpr(SI):
                        kv = tidx + THREADS * i
                        if kv < CH:
                            xf = gX[None, (m, kv)].load().to(Float32)
                            nf = gN[None, (0, kv)].load().to(Float32)
                            for e in cutlass.range_constexpr(VEC):
                                xn[e] = (nf[e] * (xf[e] * rm).to(wd).to(Float32)).to(wd).to(Float32)
                            gX[None, (m, kv)].store(xn.load().to(wd))
                cute.arch.sync_threads()
                # 2. the GEMV on the staged rows: fp32 FMAs in chunk order per (token, row)
                accr.fill(0.0)
                for i in cutlass.range(IT, unroll=2):
                    kv = lane + 32 * i
                    if cutlass.const_expr(even) or kv < CH:
                        for r in cutlass.range_constexpr(R):
                            wc[None, r].store(gW[None, (n0 + r, kv)].load())
                        for m in cutlass.range_constexpr(MT):
                            xc[None, m].store(gX[None, (m, kv)].load())
                    wf = [wc[None, r].load().to(Float32) for r in range(R)]
                    for m in cutlass.range_constexpr(MT):
                        xf = xc[None, m].load().to(Float32)
                        acc = [accr[m * R + r] for r in range(R)]
                        for e in cutlass.range_constexpr(VEC):
                            for r in cutlass.range_constexpr(R):
                                acc[r] = acc[r] + xf[e] * wf[r][e]
                        for r in cutlass.range_constexpr(R):
                            accr[m * R + r] = acc[r]
                    if cutlass.const_expr(not even):
                        wc.fill(0.0)                        # a lane past the last chunk adds zeros next step
                        xc.fill(0.0)
                acc = [accr[j] for j in range(MT * R)]
                s = KdaDecode.transpose_sum(None, acc, lane)
                # 3. epilogue: GEMM rounded, + the shared fold (rounded), + prefix, each sum rounded once
                if lane % span == 0:
                    v = lane // span
                    b = b0 + v // R
                    if b < B:
                        n = n0 + v % R
                        sh = mS[0, b, n].to(Float32)
                        for r in cutlass.range_constexpr(1, T):
                            sh = sh + mS[r, b, n].to(Float32)
                        o = s.to(wd).to(Float32)
                        mlp = (o + sh.to(wd).to(Float32)).to(wd).to(Float32)
                        mO[b, n] = (mPre[b, n].to(Float32) + mlp).to(wd)
                cute.arch.sync_threads()                   # the next pass restages sX

        return kernel


@runtime.compile_cache("allreduce_latent_norm_up")
def _compile(dtype: str, n_parts: int, D: int, L: int, cfg: NormUpConfig):
    """prefix and out (?, D) compact; y_parts (T, ?, L) and shared_parts (T, ?, D) with dynamic rank and
    row strides (multiples of 8 elements), column stride 1; norm_w (1, L); w_up (D, L); eps."""
    _, cute = runtime.cutlass_modules()
    from cutlass import Float32
    dt = runtime.cutlass_dtype(dtype)
    b = runtime.sym_int()

    def parts(N):
        return cute.runtime.make_fake_tensor(dt, (n_parts, b, N), (cute.sym_int64(divisibility=VEC),
                                                                   cute.sym_int64(divisibility=VEC), 1),
                                             assumed_align=16)
    return runtime.compile_tvm_ffi(
        FoldNormUp(dt, n_parts, D, L, cfg).jit_host(),
        runtime.fake_tensor(dtype, (b, D)), parts(L), parts(D), runtime.fake_tensor(dtype, (1, L)),
        runtime.fake_tensor(dtype, (D, L)), runtime.fake_tensor(dtype, (b, D)), Float32(1e-5))


def _check(prefix, y_parts, shared_parts, norm_w, w_up, eps):
    check_tensor("prefix", prefix, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    B, D = prefix.shape
    wd = (prefix.dtype,)
    check_tensor("y_parts", y_parts, ndim=3, dtypes=wd)
    T, L = y_parts.shape[0], y_parts.shape[2]
    if not 1 <= T <= MAX_PARTIALS:
        raise ValueError(f"y_parts: {T} partials (dim 0); the fused tail takes 1..{MAX_PARTIALS}")
    check_tensor("y_parts", y_parts, shape=(T, B, L))
    check_tensor("shared_parts", shared_parts, shape=(T, B, D), dtypes=wd)
    check_tensor("norm_w", norm_w, shape=(L,), dtypes=wd)
    check_tensor("w_up", w_up, shape=(D, L), dtypes=wd)
    if L % VEC:
        raise ValueError(f"y_parts: latent={L} must be a multiple of {VEC} (16-byte loads)")
    if D % WARPS:
        raise ValueError(f"w_up: hidden={D} must be a multiple of {WARPS} (one row per warp of a CTA)")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: {eps!r} must be a positive float")
    runtime.require_cuda("prefix", prefix)


def launch(prefix, y_parts, shared_parts, norm_w, w_up, eps: float, out, variant: NormUpConfig | None = None) -> None:
    """The one launch on the current stream; writes out [B, D]."""
    B, D = prefix.shape
    T, _, L = y_parts.shape
    if B == 0:
        return
    cfg = variant if variant is not None else pick(B, D, runtime.sm_count(prefix.device))
    fn = _compile(runtime.dtype_name(prefix.dtype), T, D, L, cfg)
    dst = runtime.aligned(out)
    fn(runtime.aligned(prefix), _loadable(y_parts, VEC), _loadable(shared_parts, VEC), runtime.aligned(norm_w.reshape(1, L)),
       runtime.aligned(w_up), dst, float(eps))
    runtime.write_back(dst, out)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("allreduce_latent_norm_up", mutates_args=("out",))
        def allreduce_latent_norm_up_out(prefix: torch.Tensor, y_parts: torch.Tensor, shared_parts: torch.Tensor,
                                         norm_w: torch.Tensor, w_up: torch.Tensor, eps: float,
                                         out: torch.Tensor) -> None:
            launch(prefix.contiguous(), y_parts, shared_parts, norm_w.contiguous(), w_up.contiguous(), eps, out)

        _op = allreduce_latent_norm_up_out
    return _op


def allreduce_latent_norm_up(prefix, y_parts, shared_parts, norm_w, w_up, eps: float, *,
                             variant: NormUpConfig | None = None):
    """Fused replacement of references.moe_tp.allreduce_latent_norm_up (same signature) -> out [B, D]."""
    _check(prefix, y_parts, shared_parts, norm_w, w_up, eps)
    out = torch.empty_like(prefix, memory_format=torch.contiguous_format)
    if variant is not None:
        launch(prefix.contiguous(), y_parts, shared_parts, norm_w.contiguous(), w_up.contiguous(), eps, out, variant)
    else:
        _custom_op()(prefix, y_parts, shared_parts, norm_w, w_up, float(eps), out)
    return out
