"""skinny_gemm, tensor-core variant: y[M,N] = x[M,K] @ w[N,K].T for 2 <= M <= 64 (bf16/fp16 in,
fp32 accumulate, one rounding), warp-level mma.sync m16n8k16 (sm80 MMA, runs on sm_90a).

Swap-AB: the weight is the MMA's M=16 operand (A, K-major), the few tokens, padded to m_pad in
{8,16,32,64}, are its N operand (B, K-major, n=8 per atom). Padded token rows read row M-1 (clamped)
and are never stored.

Operand loads straight from global memory, 16 bytes per thread, no shared memory: the sum over k is
the same whichever k sits in which MMA k-slot, provided A and B use the same assignment. In the
m16n8k16 fragments lane l (q = l % 4, r = l // 4) holds A[r | r+8][2q, 2q+1, 2q+8, 2q+9] and
B[2q, 2q+1, 2q+8, 2q+9][n = r]: the same four k-slots for both operands. So for a 32-wide k-step
lane l loads 8 consecutive k (k0 + 8q .. +7) of weight rows r and r+8 and of token row r, and feeds
elements 0..3 to the first MMA's slots (2q, 2q+1, 2q+8, 2q+9) and 4..7 to the second's. Each weight
row segment a warp reads per step is 64 contiguous bytes (two full sectors); `unroll` steps are
loaded before their MMAs so several 16-byte loads per thread are in flight.

Split-K: the CTA's `warps` warps share the k-steps, warp w taking steps w, w+warps, ...
(`interleave`, so the CTA's warps read adjacent bytes of each row at once; the first H200 run used
contiguous ranges, K/32/warps steps per warp, `_kc` in the name). Each warp accumulates its steps in
order; the warps' fp32 partials are summed through shared memory in warp order, ((w0 + w1) + w2) + ..., then rounded once.
`warps` is a function of K alone (`warps_for(K)`), so the summation order of an output depends only
on K: no m_pad, rows or unroll changes it, and each output element of an MMA depends only on its own
row and column. Results are therefore deterministic and batch invariant across every variant of this
file (M=1 through the m8 variant gives the same bits as that row at M=64). They are NOT bitwise equal
to the SIMT kernel of skinny_gemm.py (other summation order): a dispatcher that switches from SIMT at
M=1 to this kernel at M>=2 is batch invariant only within each M.

Two options for callers that need fp32 logits (fused/router_topk.py), off in skinny_gemm's own
variants (compile-time, so their code is unchanged): `ksplit` S > 1 splits the k-steps over S CTAs
(grid y), each writing its fp32 partial to y[ks, M, N] for the caller to fold in ks order; `fresh_acc`
runs every mma.sync on zeroed C fragments and adds its result to the fp32 accumulator with IEEE adds
(the tensor core aligns and truncates addends to the largest, so a long chain in C loses accuracy).

A CTA owns `rows` weight rows (8, 16 or 32). rows=8 uses half of each m16 atom (rows r+8 are zero)
so that small N still gives >= 132 CTAs; its MMAs do twice the needed math, which is free here.
"""

from dataclasses import dataclass

from fused import runtime

VEC = 8                # elements of a 16-byte load (2-byte dtypes)
KSTEP = 32             # k per step: two m16n8k16 MMAs, one 16-byte load per thread per row


def warps_for(K: int) -> int:
    """Split-K warps per CTA. Depends on K only: it fixes the reduction order (batch invariance)."""
    steps = K // KSTEP
    for w in (8, 4, 2, 1):
        if steps % w == 0:
            return w
    return 1


def supports(K: int) -> bool:
    return K % KSTEP == 0 and K >= KSTEP


@dataclass(frozen=True)
class SkinnyGemmMmaConfig:
    m_pad: int           # tokens per CTA, padded: 8, 16, 32 or 64 (n of the MMA: m_pad/8 atoms)
    rows: int            # weight rows (output columns) per CTA: 8, 16 or 32
    warps: int           # split-K warps (fixed by K: warps_for(K))
    unroll: int          # k-steps loaded before their MMAs
    interleave: bool = True   # warp w takes k-steps w, w+warps, ... (else one contiguous k range)
    ksplit: int = 1      # CTAs along K; >1 writes fp32 partials y[ks, M, N] that the caller folds in ks order
    fresh_acc: bool = False   # each MMA sums into zeroed fragments, added to the fp32 accumulator by IEEE FADD

    @property
    def name(self) -> str:
        kmap = "" if self.interleave else "_kc"
        split = f"_s{self.ksplit}" if self.ksplit > 1 else ""
        fresh = "_f" if self.fresh_acc else ""
        return f"mma_m{self.m_pad}_r{self.rows}_w{self.warps}_u{self.unroll}{kmap}{split}{fresh}"


def _unroll(K: int, warps: int, m_pad: int) -> int:
    per_warp = K // KSTEP // warps
    target = 4 if m_pad <= 16 else 2
    for u in range(target, 0, -1):
        if per_warp % u == 0:
            return u
    return 1


def configs_for(N: int, K: int, m_pad: int, interleave: bool = True) -> list[SkinnyGemmMmaConfig]:
    if not supports(K):
        return []
    w = warps_for(K)
    rows = [r for r in (8, 16, 32) if N % r == 0 and (r == 8 or N // r >= 132)]
    return [SkinnyGemmMmaConfig(m_pad, r, w, _unroll(K, w, m_pad), interleave) for r in rows]


def m_pad_for(M: int) -> int:
    for p in (8, 16, 32, 64):
        if M <= p:
            return p
    raise ValueError(f"x: M={M} is over 64, the tensor-core skinny_gemm's largest tile")


def gemm_kernel(body):
    """The @cute.kernel of a skinny GEMM whose device code is `body(gX, gW, mY)` (SkinnyGemm,
    SkinnyGemmMma)."""
    _, cute = runtime.cutlass_modules()

    @cute.kernel
    def kernel(gX: cute.Tensor, gW: cute.Tensor, mY: cute.Tensor):
        body(gX, gW, mY)

    return kernel


class SkinnyGemmMma:
    def __init__(self, N: int, K: int, cfg: SkinnyGemmMmaConfig):
        if not supports(K):
            raise ValueError(f"w: K={K} must be a positive multiple of {KSTEP} for the MMA variant")
        if N % cfg.rows:
            raise ValueError(f"w: N={N} must be a multiple of rows={cfg.rows}")
        if cfg.m_pad not in (8, 16, 32, 64) or cfg.rows not in (8, 16, 32):
            raise ValueError(f"variant: bad config {cfg}")
        steps = K // KSTEP
        if cfg.ksplit < 1 or steps % cfg.ksplit:
            raise ValueError(f"variant: K/{KSTEP}={steps} not a multiple of ksplit in {cfg}")
        steps //= cfg.ksplit                           # k-steps of one CTA
        if steps % (cfg.warps * cfg.unroll):
            raise ValueError(f"variant: K/{KSTEP}/ksplit={steps} not a multiple of warps*unroll in {cfg}")
        self.N, self.K, self.cfg = N, K, cfg
        self.warps = cfg.warps
        self.threads = 32 * cfg.warps
        self.steps_per_warp = steps // cfg.warps
        self.iters = self.steps_per_warp // cfg.unroll
        self.nb = cfg.m_pad // 8                       # n=8 MMA atoms along the tokens
        self.half = cfg.rows == 8                      # one m16 atom, rows r+8 unused
        self.nfrag = max(1, cfg.rows // 16)            # m16 atoms along the weight rows
        self.wrows = 1 if self.half else 2             # 8-row halves loaded per m16 atom

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        threads, rows, N, ksplit = self.threads, self.cfg.rows, self.N, self.cfg.ksplit

        @cute.jit
        def host(mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream):
            gX = cute.zipped_divide(mX, (1, VEC))
            gW = cute.zipped_divide(mW, (1, VEC))
            kernel(gX, gW, mY).launch(grid=[N // rows, ksplit, 1], block=[threads, 1, 1], stream=stream)

        return host

    def device_body(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        cfg = self.cfg
        nb, nfrag, wrows, half = self.nb, self.nfrag, self.wrows, self.half
        U, iters, spw, warps = cfg.unroll, self.iters, self.steps_per_warp, self.warps
        rows = cfg.rows
        inter = cfg.interleave
        nacc = 4 * nb * nfrag
        S, fresh = cfg.ksplit, cfg.fresh_acc
        cta_steps = spw * warps

        @cute.jit
        def body(gX: cute.Tensor, gW: cute.Tensor, mY: cute.Tensor):
            """The CTA's share of y (block_idx picks it)."""
            ab = gW.element_type
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(ab, Float32, (16, 8, 16)))
            bn, ks, _ = cute.arch.block_idx()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            q = lane % 4
            r = lane // 4
            M = mY.shape[1] if cutlass.const_expr(S > 1) else mY.shape[0]
            n0 = bn * rows

            acc = cute.make_rmem_tensor(cute.make_layout((4, nfrag, nb)), Float32)
            acc.fill(0.0)
            xrow = cute.make_rmem_tensor(cute.make_layout(nb), Int32)
            for j in cutlass.range_constexpr(nb):
                xrow[j] = cutlass.min(Int32(j * 8) + r, M - 1)      # clamp padded token rows
            step0 = warp * spw
            kmul = warps if inter else 1
            kadd = (warp if inter else step0) + ks * cta_steps

            for it in cutlass.range(iters):
                wv = cute.make_rmem_tensor(cute.make_layout((VEC, nfrag * wrows, U)), ab)
                xv = cute.make_rmem_tensor(cute.make_layout((VEC, nb, U)), ab)
                for u in cutlass.range_constexpr(U):
                    kv = ((it * U + u) * kmul + kadd) * 4 + q
                    for f in cutlass.range_constexpr(nfrag):
                        for h in cutlass.range_constexpr(wrows):
                            wv[None, f * wrows + h, u].store(gW[None, (n0 + f * 16 + h * 8 + r, kv)].load())
                    for j in cutlass.range_constexpr(nb):
                        xv[None, j, u].store(gX[None, (xrow[j], kv)].load())
                for u in cutlass.range_constexpr(U):
                    for kk in cutlass.range_constexpr(2):
                        afr = cute.make_rmem_tensor(cute.make_layout((8, nfrag, 1)), ab)
                        if cutlass.const_expr(half):
                            afr.fill(0.0)
                        for f in cutlass.range_constexpr(nfrag):
                            for h in cutlass.range_constexpr(wrows):
                                # A values: (r,2q) (r,2q+1) (r+8,2q) (r+8,2q+1) (r,2q+8) (r,2q+9) ...
                                afr[2 * h + 0, f, 0] = wv[4 * kk + 0, f * wrows + h, u]
                                afr[2 * h + 1, f, 0] = wv[4 * kk + 1, f * wrows + h, u]
                                afr[2 * h + 4, f, 0] = wv[4 * kk + 2, f * wrows + h, u]
                                afr[2 * h + 5, f, 0] = wv[4 * kk + 3, f * wrows + h, u]
                        bfr = cute.make_rmem_tensor(cute.make_layout((4, nb, 1)), ab)
                        for j in cutlass.range_constexpr(nb):
                            for e in cutlass.range_constexpr(4):
                                bfr[e, j, 0] = xv[4 * kk + e, j, u]
                        if cutlass.const_expr(fresh):
                            part = cute.make_rmem_tensor(cute.make_layout((4, nfrag, nb)), Float32)
                            part.fill(0.0)
                            cute.gemm(atom, part, afr, bfr, part)
                            for i in cutlass.range_constexpr(nacc):
                                acc[i] = acc[i] + part[i]
                        else:
                            cute.gemm(atom, acc, afr, bfr, acc)     # (V,nfrag,1) x (V,nb,1) -> (V,nfrag,nb)

            # split-K reduction in warp order, then one rounding; C values: (r,2q) (r,2q+1) (r+8,2q) (r+8,2q+1)
            if cutlass.const_expr(warps > 1):
                red = cutlass.memory.SmemAllocator().allocate_tensor(
                    Float32, cute.make_layout((nacc, 32), stride=(32, 1)), byte_alignment=16)   # lane-contiguous
                if warp == 0:
                    for i in cutlass.range_constexpr(nacc):
                        red[i, lane] = acc[i]
                for w in cutlass.range_constexpr(1, warps):
                    cute.arch.sync_threads()
                    if warp == w:
                        for i in cutlass.range_constexpr(nacc):
                            v = red[i, lane] + acc[i]
                            if cutlass.const_expr(w < warps - 1):
                                red[i, lane] = v
                            else:
                                acc[i] = v
            if warp == warps - 1:
                for f in cutlass.range_constexpr(nfrag):
                    for j in cutlass.range_constexpr(nb):
                        for c in cutlass.range_constexpr(4 if not half else 2):
                            tok = Int32(j * 8) + 2 * q + (c % 2)
                            col = n0 + f * 16 + (c // 2) * 8 + r
                            if tok < M:
                                if cutlass.const_expr(S > 1):
                                    mY[ks, tok, col] = acc[c, f, j]
                                else:
                                    mY[tok, col] = acc[c, f, j].to(mY.element_type)

        return body

    def device_kernel(self):
        return gemm_kernel(self.device_body())


def compile_host(host, dtype: str, out_dtype: str, N: int, K: int, ksplit: int = 1):
    """Compile a skinny-GEMM host function (x[M,K], w[N,K] -> y[M,N], M dynamic), SIMT or MMA;
    with ksplit > 1 the output is the fp32 partials y[ksplit, M, N]."""
    m = runtime.sym_int()
    out = (m, N) if ksplit == 1 else (ksplit, m, N)
    return runtime.compile_tvm_ffi(
        host,
        runtime.fake_tensor(dtype, (m, K)),
        runtime.fake_tensor(dtype, (N, K)),
        runtime.fake_tensor(out_dtype, out, align=4))


def build(dtype: str, out_dtype: str, N: int, K: int, cfg: SkinnyGemmMmaConfig):
    """Compile one variant (skinny_gemm._compile caches it under the op "skinny_gemm")."""
    if cfg.ksplit > 1 and out_dtype != "float32":
        raise ValueError(f"variant: ksplit={cfg.ksplit} writes fp32 partials, not {out_dtype}")
    return compile_host(SkinnyGemmMma(N, K, cfg).jit_host(), dtype, out_dtype, N, K, cfg.ksplit)

