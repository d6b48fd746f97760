"""latent_norm_up: out[B, D] = wd(wd(rms_norm(y_latent, norm_w) @ w_up.T) + shared_out), one launch.

`NormUp` is a GEMV over the rows of w_up [D, L] with the RMSNorm as its prologue and the shared add
as its epilogue. A CTA owns `rows_per_warp` x 4 consecutive output columns (one warp per
`rows_per_warp` rows). Lane l of a warp takes the 16-byte chunks l, l + 32, ... of a row, so a warp
reads 512 contiguous bytes of a row per step; each weight chunk loaded serves every token of a pass
of `tokens` tokens. Per pass:

  1. RMS: each lane sums the squares of its chunks of each token's latent row in order (fp32), the
     lanes are added by the xor butterfly (offsets 16, 8, .., 1; every lane ends with the same sum),
     r = rsqrt(sum / L + eps). The warp computes the RMS itself from the row it is about to read
     anyway (L is small: the row stays in L1 for step 2), so no second launch and no scratch.
  2. GEMV: per chunk, the token's normed values in the reference's rounding order,
     xn = wd(norm_w * wd(x * r)) (both products in fp32, each rounded to wd), times the weight chunk
     of each row, fp32 FMAs in chunk order; then the lanes are added by kda_decode's transpose_sum
     (the same xor butterfly, all tokens x rows of a pass at once).
  3. Epilogue: o = wd(acc), out = wd(float(o) + float(shared_out)) (the reference's wd add: the
     GEMM rounded, then one rounding of the sum).

Every order above depends only on L, never on B, the pass size or the rows per warp: every variant
gives the same bits, deterministic and batch invariant. The batch is dynamic: one compile per
(dtype, D, L, variant).
"""

from dataclasses import dataclass

import torch

from fused import runtime
from fused.kda_decode import KdaDecode                # its transpose_sum: the warp's many-value reduce
from references.primitives import check_tensor

DTYPES = ("bfloat16", "float16")   # working dtypes of every operand (the harness draws only these)
WARPS = 4                          # warps per CTA
VEC = 8                            # elements of a 16-byte chunk (2-byte dtypes)
UNROLL = 2                         # chunk steps unrolled per loop trip (loads in flight vs registers)


@dataclass(frozen=True)
class NormUpConfig:
    """The kernel's tile: w_up rows per warp and tokens per pass over the batch (rows x tokens
    accumulators per lane, a power of two <= 32)."""
    rows_per_warp: int = 1
    tokens: int = 8

    @property
    def rows_per_cta(self) -> int:
        return WARPS * self.rows_per_warp

    @property
    def name(self) -> str:
        return f"r{self.rows_per_warp}_t{self.tokens}"


def all_configs(D: int) -> list[NormUpConfig]:
    """Every tile whose CTA rows divide D (rows x tokens <= 32 accumulators: 16 tokens a pass only with
    1 or 2 rows per warp, which hold the weight chunks for fewer passes over a large batch)."""
    return [NormUpConfig(r, t) for r in (1, 2, 4) for t in (1, 4, 8, 16) if r * t <= 32 and D % (WARPS * r) == 0]


def default_config(B: int, D: int, sms: int = 132) -> NormUpConfig:
    """The most rows per warp that still leaves >= 2 CTAs per SM (fewer re-reads of the latent rows
    by the CTAs); tokens per pass 1 at B = 1, 4 up to B = 4 (no clamped rows computed), 8 beyond."""
    tokens = 1 if B <= 1 else 4 if B <= 4 else 8
    for r in (4, 2, 1):
        if D % (WARPS * r) == 0 and D // (WARPS * r) >= 2 * sms:
            return NormUpConfig(r, tokens)
    return NormUpConfig(1, tokens)


class NormUp:
    """Compile-time configuration: D output columns (rows of w_up), latent width L, tile."""

    def __init__(self, D: int, L: int, cfg: NormUpConfig):
        if L % VEC or D % cfg.rows_per_cta:
            raise ValueError(f"variant: {cfg.name} needs L % {VEC} == 0 and D % {cfg.rows_per_cta} == 0, "
                             f"got L={L}, D={D}")
        pairs = cfg.rows_per_warp * cfg.tokens
        if pairs > 32 or pairs & (pairs - 1):
            raise ValueError(f"variant: {cfg.name}: rows_per_warp x tokens = {pairs} must be a power of two <= 32")
        self.D, self.L, self.cfg = D, L, cfg
        self.chunks = L // VEC                         # 16-byte chunks per row
        self.iters = -(-self.chunks // 32)             # chunks per lane
        self.even = self.chunks % 32 == 0

    def jit_host(self):
        _, cute = runtime.cutlass_modules()
        from cutlass import Float32
        kernel = self.device_kernel()

        @cute.jit
        def host(mX: cute.Tensor, mN: cute.Tensor, mW: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor,
                 eps: Float32, stream):
            gX = cute.zipped_divide(mX, (1, VEC))
            gN = cute.zipped_divide(mN, (1, VEC))
            gW = cute.zipped_divide(mW, (1, VEC))
            kernel(gX, gN, gW, mS, mO, eps).launch(grid=[self.D // self.cfg.rows_per_cta, 1, 1],
                                                   block=[32 * WARPS, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32

        R, MT, IT, CH, L = self.cfg.rows_per_warp, self.cfg.tokens, self.iters, self.chunks, self.L
        even = self.even
        span = 32 // (MT * R)                               # lanes holding one (token, row) sum

        @cute.kernel
        def kernel(gX: cute.Tensor, gN: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor,
                   eps: Float32):
            warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
            bidx, _, _ = cute.arch.block_idx()
            n0 = bidx * (WARPS * R) + warp * R              # this warp's first output column
            B = mO.shape[0]
            wd = mO.element_type
            xc = cute.make_rmem_tensor(cute.make_layout((VEC, MT)), wd)
            wc = cute.make_rmem_tensor(cute.make_layout((VEC, R)), wd)
            nc = cute.make_rmem_tensor(cute.make_layout((VEC,)), wd)
            ssr = cute.make_rmem_tensor(cute.make_layout((MT,)), Float32)
            rsr = cute.make_rmem_tensor(cute.make_layout((MT,)), Float32)
            accr = cute.make_rmem_tensor(cute.make_layout((MT * R,)), Float32)
            xc.fill(0.0)
            wc.fill(0.0)
            nc.fill(0.0)
            for p in cutlass.range((B + MT - 1) // MT):
                b0 = p * MT
                # 1. each token's rsqrt(mean(x^2) + eps): lane's chunks in order, then the butterfly
                ssr.fill(0.0)
                for i in cutlass.range(IT, unroll=UNROLL):
                    kv = lane + 32 * i
                    if cutlass.const_expr(even) or kv < CH:
                        for m in cutlass.range_constexpr(MT):   # clamp: rows past B computed, not stored
                            xc[None, m].store(gX[None, (cutlass.min(b0 + m, B - 1), kv)].load())
                    for m in cutlass.range_constexpr(MT):
                        xf = xc[None, m].load().to(Float32)
                        ss = ssr[m]
                        for e in cutlass.range_constexpr(VEC):
                            ss = ss + xf[e] * xf[e]
                        ssr[m] = ss
                    if cutlass.const_expr(not even):
                        xc.fill(0.0)                            # a lane past the last chunk adds zeros
                for m in cutlass.range_constexpr(MT):
                    ss = ssr[m]
                    for off in (16, 8, 4, 2, 1):
                        ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=off)
                    rsr[m] = cute.math.rsqrt(ss / Float32(L) + eps)
                # 2. the GEMV on the normed rows: fp32 FMAs in chunk order per (token, row)
                accr.fill(0.0)
                for i in cutlass.range(IT, unroll=UNROLL):
                    kv = lane + 32 * i
                    if cutlass.const_expr(even) or kv < CH:
                        nc.store(gN[None, (0, kv)].load())
                        for r in cutlass.range_constexpr(R):
                            wc[None, r].store(gW[None, (n0 + r, kv)].load())
                        for m in cutlass.range_constexpr(MT):
                            xc[None, m].store(gX[None, (cutlass.min(b0 + m, B - 1), kv)].load())
                    nf = nc.load().to(Float32)
                    wf = [wc[None, r].load().to(Float32) for r in range(R)]
                    for m in cutlass.range_constexpr(MT):
                        xf = xc[None, m].load().to(Float32)
                        rm = rsr[m]
                        acc = [accr[m * R + r] for r in range(R)]
                        for e in cutlass.range_constexpr(VEC):
                            xn = (nf[e] * (xf[e] * rm).to(wd).to(Float32)).to(wd).to(Float32)
                            for r in cutlass.range_constexpr(R):
                                acc[r] = acc[r] + xn * wf[r][e]
                        for r in cutlass.range_constexpr(R):
                            accr[m * R + r] = acc[r]
                    if cutlass.const_expr(not even):
                        # a lane past the last chunk adds zeros (norm_w 0, weights 0) next step
                        nc.fill(0.0)
                        wc.fill(0.0)
                        xc.fill(0.0)
                acc = [accr[j] for j in range(MT * R)]
                # lane l ends with pair l // span: the butterfly tree of warp_reduction, one shuffle per
                # step per kept value instead of five per pair
                s = KdaDecode.transpose_sum(None, acc, lane)
                if lane % span == 0:
                    v = lane // span
                    b = b0 + v // R
                    if b < B:
                        n = n0 + v % R
                        o = s.to(wd).to(Float32)
                        # 3. the reference's wd add: GEMM rounded, then the sum rounded once
                        mO[b, n] = (o + mS[b, n].to(Float32)).to(wd)

        return kernel


@runtime.compile_cache("latent_norm_up")
def _compile(dtype: str, D: int, L: int, cfg: NormUpConfig):
    """The one kernel: y_latent (?, L), norm_w (1, L), w_up (D, L), shared_out and out (?, D), eps."""
    from cutlass import Float32
    b = runtime.sym_int()
    return runtime.compile_tvm_ffi(
        NormUp(D, L, cfg).jit_host(),
        runtime.fake_tensor(dtype, (b, L)), runtime.fake_tensor(dtype, (1, L)),
        runtime.fake_tensor(dtype, (D, L)), runtime.fake_tensor(dtype, (b, D)),
        runtime.fake_tensor(dtype, (b, D)), Float32(1e-5))


def _check(y_latent, norm_w, w_up, shared_out, eps, out):
    check_tensor("y_latent", y_latent, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    B, L = y_latent.shape
    wd = (y_latent.dtype,)
    check_tensor("norm_w", norm_w, shape=(L,), dtypes=wd)
    check_tensor("w_up", w_up, shape=(None, L), dtypes=wd)
    D = w_up.shape[0]
    check_tensor("shared_out", shared_out, shape=(B, D), dtypes=wd)
    if out is not None:
        check_tensor("out", out, shape=(B, D), dtypes=wd)
    if L % VEC:
        raise ValueError(f"y_latent: latent={L} must be a multiple of {VEC} (16-byte loads)")
    if D % WARPS:
        raise ValueError(f"w_up: hidden={D} must be a multiple of {WARPS} (one row per warp of a CTA)")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: {eps!r} must be a positive float")
    runtime.require_cuda("y_latent", y_latent)


def launch(y_latent, norm_w, w_up, shared_out, eps: float, out, variant: NormUpConfig | None = None) -> None:
    """The one launch on the current stream; writes out [B, D]."""
    B, L = y_latent.shape
    D = w_up.shape[0]
    if B == 0:
        return
    cfg = variant if variant is not None else default_config(B, D, runtime.sm_count(y_latent.device))
    fn = _compile(runtime.dtype_name(y_latent.dtype), D, L, cfg)
    dst = runtime.aligned(out)
    fn(runtime.aligned(y_latent), runtime.aligned(norm_w.reshape(1, L)), runtime.aligned(w_up),
       runtime.aligned(shared_out), dst, float(eps))
    runtime.write_back(dst, out)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("latent_norm_up", mutates_args=("out",))
        def latent_norm_up_out(y_latent: torch.Tensor, norm_w: torch.Tensor, w_up: torch.Tensor,
                               shared_out: torch.Tensor, eps: float, out: torch.Tensor) -> None:
            launch(y_latent.contiguous(), norm_w.contiguous(), w_up.contiguous(), shared_out.contiguous(),
                   eps, out)

        _op = latent_norm_up_out
    return _op


def latent_norm_up(y_latent, norm_w, w_up, shared_out, eps: float, *, out=None,
                   variant: NormUpConfig | None = None):
    """Fused replacement of references.moe.latent_norm_up (same signature) -> out [B, D]."""
    _check(y_latent, norm_w, w_up, shared_out, eps, out)
    if out is None:
        out = torch.empty(y_latent.shape[0], w_up.shape[0], dtype=y_latent.dtype, device=y_latent.device)
    if variant is not None:
        launch(y_latent.contiguous(), norm_w.contiguous(), w_up.contiguous(), shared_out.contiguous(),
               eps, out, variant)
    else:
        _custom_op()(y_latent, norm_w, w_up, shared_out, float(eps), out)
    return out


def variants(tensors: dict, params: dict) -> list[NormUpConfig]:
    """What the harness certifies at this B: every tokens-per-pass with the rows per warp the
    dispatcher picks for this D (one kernel, any B: the dispatcher's pick at every B is one of them)."""
    D = tensors["w_up"].shape[0]
    rows = default_config(1, D).rows_per_warp
    return [c for c in all_configs(D) if c.rows_per_warp == rows]
