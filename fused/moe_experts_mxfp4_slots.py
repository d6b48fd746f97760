"""moe_experts_mxfp4 in two launches at B = 1: no route kernel, the combine in the down GEMM's last CTAs.

fused.moe_experts_mxfp4 runs four launches: route (the distinct experts and their (token, slot) lists),
gate_up, down, combine. At one token every slot is its own pair, so the route has nothing to group
(two slots naming one expert are computed twice, with the same arithmetic). Here:

1. gate_up: grid (I / 16, P = B * k), one CTA per (16 intermediate rows, pair); the expert is
   ids[pair], read in the kernel (an id outside 0..E-1, -1 padding included, skips the CTA as the
   route does). The GEMV is TokenGemv (below), then SiTU-and-mul and the a[pair, I] store as
   moe_experts_mxfp4's gate_up.
2. down + combine: grid (L / (16 x down_frag), P). Each CTA computes o[pair, its rows] with TokenGemv,
   makes it visible at GPU scope (fence.acq_rel.gpu, a barrier) and takes a ticket from its column
   tile's int32 counter (atomic add, acq_rel, gpu scope). The CTA that draws the tile's last ticket
   has seen every pair's rows: it runs the combine for those rows, y[b, l] = sum over the real slots
   j in order of weights[b, j] * o[b * k + j, l] in fp32 rounded to wd (moe_experts_mxfp4's combine,
   the same expression), and puts the counter back to 0 for the next launch and every CUDA-graph
   replay.

TokenGemv is fused.moe_experts_mxfp4_gemv's split-K mma.sync GEMV specialised to one token row. At
one token the GEMV issues about as many instructions as it moves bytes (an ncu profile at K3 T = 8:
the schedulers busy half the cycles, DRAM at 28 %), so it cuts instructions: bf16 codes become bf16
by two shifts and two masks per pair of codes and one multiply by the scale (token_words; the byte
permutes of fused.mxfp4_dequant take about twice that), with x's elements permuted to the codes'
order; and each GEMV has its own warps and unroll (`Tiling`, `pick`: timed per K3 per-rank shape).
Each output's fp32 sum depends on K and the tiling only, never on the routing or other tokens;
the order differs from the four launches', so y is judged against the reference, not against them.
Above one token the route's sharing of weight reads between the tokens of an expert is what makes the
four launches fast; this form calls fused.moe_experts_mxfp4 there (and where k or E is 0).

The counters (one per column tile) are kept per (device, stream, tiles): launches on one stream run in
order; two streams never share them. A CUDA graph keeps the counters of its capture stream, so two
replays of graphs captured on one stream must not overlap.

The candidate: `--candidate fused.moe_experts_mxfp4_slots:moe_experts_mxfp4`; its variants are
moe_experts_mxfp4's (their warps, unroll and down rows as a Tiling at one token).
"""
from dataclasses import dataclass

import torch

from fused import moe_experts_mxfp4 as mx
from fused import runtime
from fused.moe_experts_mxfp4_gemv import QUADS, VEC, WORDS, ExpertGemv, dequant_word

DTYPES = mx.DTYPES
SLOTS_MAX = 1            # tokens up to which the two launches run
variants = mx.variants


_SIGNS = 0x80008000 - (1 << 32)          # the sign bits of a bf16x2 word
_MAGS = 0x01C001C0                      # E2M1's three magnitude bits at bf16 bits 6..8 of each half
_NEG_ZERO_X2 = 0x80008000 - (1 << 32)
_NAN_BF16 = 0x7FC0
# bf16x2 word i of a code word w holds codes (i, i + 4): (w shifted left by MAG_SHIFT[i]) & _MAGS |
# (w shifted left by SIGN_SHIFT[i]) & _SIGNS (a negative shift is a right shift)
MAG_SHIFT = (6, 2, -2, -6)
SIGN_SHIFT = (12, 8, 4, 0)


def _shifted(w, n):
    return w << n if n > 0 else (w >> -n if n < 0 else w)


def scale_bits(e, select):
    """bf16 bits of the two multipliers of scale byte e: 2^(min(e, 128) - 1) (NaN for e = 255) and
    2^(max(e, 128) - 128); `select(cond, a, b)` is the caller's (Python's or the kernel's)."""
    return (select(e == 255, _NAN_BF16, select(e > 128, 254, e + 126) << 7),
            select(e > 128, e - 1, 127) << 7)


def token_words(cute, w, m, out):
    """The 8 codes of word `w` times m's power of two as four bf16x2 words into `out`, in the code
    order (0, 4), (1, 5), (2, 6), (3, 7). Shifted and masked, code i's magnitude bits land at bf16 bits
    6..8 and its sign at bit 15 of its half: the bf16 E2M1 * 2^-126 exactly (magnitude 1, 0.5, is the
    subnormal 2^-127). The bf16x2 multiply by m (scale_bits' first, both halves) is the exact product,
    or its overflow to inf as the reference rounds it; scales above 128 take a second multiply by the
    second (TokenGemv). -0.0 is added so -0.0 stays."""
    from cutlass import Int32
    for i in range(4):
        part = (_shifted(w, MAG_SHIFT[i]) & Int32(_MAGS)) | (_shifted(w, SIGN_SHIFT[i]) & Int32(_SIGNS))
        out[i] = Int32(cute.arch.fma_packed_bf16x2(Int32(part), m, Int32(_NEG_ZERO_X2)))


def token_x(cute, xw, out):
    """x's 8 elements of one word (xw: four bf16x2 words, elements 0..7 in order) into `out` in the
    order token_words gives the codes: (0, 4), (1, 5), (2, 6), (3, 7)."""
    prmt = cute.arch.prmt
    out[0] = prmt(xw[0], xw[2], 0x5410)
    out[1] = prmt(xw[0], xw[2], 0x7632)
    out[2] = prmt(xw[1], xw[3], 0x5410)
    out[3] = prmt(xw[1], xw[3], 0x7632)


class TokenGemv(ExpertGemv):
    """ExpertGemv's sums for one token row (every MMA column that token), with two differences:
    warp w takes the k-steps (it * warps + w) * unroll + u, so a lane's `unroll` loads of a row are
    consecutive 64-byte spans of it; and bf16 codes are dequantised by token_words (shifts, masks, one
    multiply; about half the instructions of fused.mxfp4_dequant's byte permutes), x's elements
    permuted to match. fp16 keeps dequant_word. The warps' partials are summed in warp order, so each
    output's sum depends on K, `warps` and `unroll` only."""

    def __init__(self, K: int, nfrag: int, fstride: int, warps: int, unroll: int):
        super().__init__(K, nfrag, fstride, 1, warps, unroll)

    def mainloop(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import BFloat16, Float32, Int32

        nfrag, warps, U = self.nfrag, self.warps, self.unroll
        kc, iters, fstride, nacc = self.kc, self.iters, self.fstride, self.nacc
        nrow = 2 * nfrag

        @cute.jit
        def run(gW: cute.Tensor, mS: cute.Tensor, gX: cute.Tensor, row0: Int32, xrow: cute.Tensor,
                acc: cute.Tensor, red: cute.Tensor):
            """As ExpertGemv's, with xrow[0] the token row."""
            ab = gX.element_type
            fast = cutlass.const_expr(ab is BFloat16)
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(ab, Float32, (16, 8, 16)))
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            q = lane % 4
            r = lane // 4
            x_row = xrow[0]
            acc.fill(0.0)
            for it in cutlass.range(iters):
                wv = cute.make_rmem_tensor(cute.make_layout((WORDS, nrow, U)), Int32)
                sv = cute.make_rmem_tensor(cute.make_layout((nrow, U)), Int32)
                xv = cute.make_rmem_tensor(cute.make_layout((VEC, WORDS, U)), ab)
                wv.fill(0)
                sv.fill(127)
                xv.fill(0.0)
                for u in cutlass.range_constexpr(U):
                    c = ((it * warps + warp) * U + u) * QUADS + q
                    if c < kc:
                        for f in cutlass.range_constexpr(nfrag):
                            for h in cutlass.range_constexpr(2):
                                row = row0 + f * fstride + 8 * h + r
                                wv[None, 2 * f + h, u].store(gW[None, (row, c)].load())
                                sv[2 * f + h, u] = Int32(mS[row, c])
                        for v in cutlass.range_constexpr(WORDS):
                            xv[None, v, u].store(gX[None, (x_row, c * WORDS + v)].load())
                m1 = cute.make_rmem_tensor(cute.make_layout((nrow, U)), Int32)
                m2 = cute.make_rmem_tensor(cute.make_layout((nrow, U)), Int32)
                top = Int32(0)
                if fast:
                    for u in cutlass.range_constexpr(U):
                        for fh in cutlass.range_constexpr(nrow):
                            e = sv[fh, u]
                            top = cutlass.select_(e > top, e, top)
                            b1, b2 = scale_bits(e, lambda c, a, b: cutlass.select_(c, Int32(a), Int32(b)))
                            m1[fh, u] = b1 | (b1 << 16)
                            m2[fh, u] = b2 | (b2 << 16)
                big = cute.arch.vote_any_sync(top > 128)
                xw = cute.recast_tensor(xv, Int32)
                for u in cutlass.range_constexpr(U):
                    for wi in cutlass.range_constexpr(WORDS):
                        dq = cute.make_rmem_tensor(cute.make_layout((8, nrow)), ab)
                        xo = cute.make_rmem_tensor(cute.make_layout(8), ab)
                        if fast:
                            xp = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                            token_x(cute, xw[None, wi, u], xp)
                            xo.store(cute.recast_tensor(xp, ab).load())
                            for fh in cutlass.range_constexpr(nrow):
                                ow = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                                token_words(cute, wv[wi, fh, u], m1[fh, u], ow)
                                if big:                  # a scale above 128 in the warp: 2^(e - 128) more
                                    for i in cutlass.range_constexpr(4):
                                        ow[i] = Int32(cute.arch.fma_packed_bf16x2(ow[i], m2[fh, u],
                                                                                  Int32(_NEG_ZERO_X2)))
                                dq[None, fh].store(cute.recast_tensor(ow, ab).load())
                        else:
                            xo.store(xv[None, wi, u].load())
                            for fh in cutlass.range_constexpr(nrow):
                                dq[None, fh].store(dequant_word(cutlass, cute, ab, wv[wi, fh, u], sv[fh, u]).load())
                        for sub in cutlass.range_constexpr(2):
                            afr = cute.make_rmem_tensor(cute.make_layout((8, nfrag, 1)), ab)
                            for f in cutlass.range_constexpr(nfrag):
                                for h in cutlass.range_constexpr(2):
                                    afr[2 * h + 0, f, 0] = dq[4 * sub + 0, 2 * f + h]
                                    afr[2 * h + 1, f, 0] = dq[4 * sub + 1, 2 * f + h]
                                    afr[2 * h + 4, f, 0] = dq[4 * sub + 2, 2 * f + h]
                                    afr[2 * h + 5, f, 0] = dq[4 * sub + 3, 2 * f + h]
                            bfr = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), ab)
                            for e in cutlass.range_constexpr(4):
                                bfr[e, 0, 0] = xo[4 * sub + e]
                            cute.gemm(atom, acc, afr, bfr, acc)
            if cutlass.const_expr(warps > 1):          # the warps' partials in warp order, into the last warp
                cute.arch.sync_threads()
                if warp == 0:
                    for i in cutlass.range_constexpr(nacc):
                        red[i, lane] = acc[i]
                for w in cutlass.range_constexpr(1, warps):
                    cute.arch.sync_threads()
                    if warp == w:
                        for i in cutlass.range_constexpr(nacc):
                            s = red[i, lane] + acc[i]
                            if cutlass.const_expr(w < warps - 1):
                                red[i, lane] = s
                            else:
                                acc[i] = s

        return run


def pair_gemv(cute, g, mainloop, nfrag: int, gW, mS, gX, row0, x_row, red):
    """Inside a kernel, at trace time: one pair's ExpertGemv sums, acc[(4, nfrag, nb)] with the token
    row `x_row` in every MMA column, and this lane's (warp, q, r). The stored sums are column 0's
    (c = 0, 2) in the last warp's lanes with q == 0."""
    from cutlass import Float32, Int32
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    acc = cute.make_rmem_tensor(cute.make_layout((4, nfrag, g.nb)), Float32)
    xrow = cute.make_rmem_tensor(cute.make_layout(g.nb), Int32)
    for j in range(g.nb):
        xrow[j] = x_row
    mainloop(gW, mS, gX, row0, xrow, acc, red)
    return acc, warp, lane % 4, lane // 4


@dataclass(frozen=True)
class Tiling:
    """Each GEMV's split-K warps and unrolled k-steps, and the down GEMV's 16-row atoms per CTA."""
    gate_warps: int = 4
    gate_unroll: int = 2
    down_warps: int = 4
    down_frag: int = 2
    down_unroll: int = 2

    @classmethod
    def of(cls, cfg: mx.MoeExpertsConfig) -> "Tiling":
        """A four-launch variant's tiling (nb has no meaning at one token)."""
        return cls(cfg.warps, cfg.unroll, cfg.warps, cfg.down_frag, cfg.unroll)

    @property
    def name(self) -> str:
        return f"g{self.gate_warps}u{self.gate_unroll}_d{self.down_warps}x{16 * self.down_frag}u{self.down_unroll}"


def pick(L: int, inter: int) -> Tiling:
    """The tiling timed fastest at the K3 per-rank shapes (results/performance.md), where L allows it."""
    t = TUNED.get(inter, Tiling())
    return t if L % (16 * t.down_frag) == 0 else Tiling()


TUNED = {384: Tiling(4, 4, 3, 2, 1), 256: Tiling(8, 2, 2, 2, 2)}      # K3 T = 8 and T = 16


class MoeExpertsSlots(mx.MoeExperts):
    """The gate_up and down GEMVs of moe_experts_mxfp4 as TokenGemv (one token row per pair), indexed
    by pair."""

    def __init__(self, wd: str, ids_dtype: str, E: int, L: int, inter: int, k: int, tiling: Tiling):
        cfg = mx.MoeExpertsConfig(warps=tiling.gate_warps, down_frag=tiling.down_frag, unroll=tiling.gate_unroll)
        super().__init__(wd, ids_dtype, E, L, inter, k, cfg)
        self.tiling = tiling
        self.gate_up = TokenGemv(L, 2, inter, tiling.gate_warps, tiling.gate_unroll)
        self.down = TokenGemv(inter, tiling.down_frag, 16, tiling.down_warps, tiling.down_unroll)

    def slot_gate_up_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        g = self.gate_up
        E, inter, k = self.E, self.I, self.k
        mainloop = g.mainloop()

        @cute.kernel
        def kernel(gZ: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mIds: cute.Tensor, mAct: cute.Tensor,
                   beta: Float32, lbeta: Float32):
            tile, a, _ = cute.arch.block_idx()
            red = cutlass.memory.SmemAllocator().allocate_tensor(
                Float32, cute.make_layout((g.nacc, 32), stride=(32, 1)), byte_alignment=16)
            e = Int32(mIds[a])
            if mx.valid_id(e, E):
                i0 = tile * 16
                acc, warp, q, r = pair_gemv(cute, g, mainloop, 2, gW, mS, gZ, e * (2 * inter) + i0, a // k, red)
                if warp == g.warps - 1:
                    if q == 0:                            # column 0 (c = 0, 2): the stored one
                        for h in cutlass.range_constexpr(2):
                            gate = acc[2 * h, 0, 0].to(mAct.element_type).to(Float32)
                            up = acc[2 * h, 1, 0].to(mAct.element_type).to(Float32)
                            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate))
                            act = beta * cute.math.tanh(gate / beta) * sig
                            up = lbeta * cute.math.tanh(up / lbeta)
                            mAct[a, i0 + h * 8 + r] = (act * up).to(mAct.element_type)

        return kernel

    def down_combine_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        g = self.down
        E, L, k, nf = self.E, self.L, self.k, self.tiling.down_frag
        threads = 32 * self.tiling.down_warps
        nvt = 16 * nf // 8                                # 8-wide vectors of y per column tile
        mainloop = g.mainloop()

        @cute.kernel
        def kernel(gAct: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                   mO: cute.Tensor, gO: cute.Tensor, gY: cute.Tensor, mCnt: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            tile, a, _ = cute.arch.block_idx()
            P = mO.shape[0]
            alloc = cutlass.memory.SmemAllocator()
            red = alloc.allocate_tensor(Float32, cute.make_layout((g.nacc, 32), stride=(32, 1)), byte_alignment=16)
            ticket = alloc.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
            l0 = tile * (16 * nf)
            e = Int32(mIds[a])
            if mx.valid_id(e, E):
                acc, warp, q, r = pair_gemv(cute, g, mainloop, nf, gW, mS, gAct, e * L + l0, a, red)
                if warp == g.warps - 1:
                    if q == 0:
                        for h in cutlass.range_constexpr(2):
                            for f in cutlass.range_constexpr(nf):
                                mO[a, l0 + f * 16 + h * 8 + r] = acc[2 * h, f, 0].to(mO.element_type)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                ticket[0] = cute.arch.atomic_add(mCnt.iterator + tile, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if ticket[0] == P - 1:                        # every pair's rows of this tile are visible
                cute.arch.fence_acq_rel_gpu()
                for t in cutlass.range(tidx, gY.shape[1][0] * nvt, threads, unroll=1):
                    b = t // nvt
                    v = l0 // 8 + t % nvt
                    sums = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                    ov = cute.make_rmem_tensor(cute.make_layout(8), gO.element_type)
                    sums.fill(0.0)
                    for j in cutlass.range_constexpr(k):
                        ej = Int32(mIds[b * k + j])
                        if mx.valid_id(ej, E):
                            w = mWts[b * k + j]
                            ov.store(gO[None, (b * k + j, v)].load())
                            sums.store(sums.load() + ov.load().to(Float32) * w)
                    ov.store(sums.load().to(gY.element_type))
                    gY[None, (b, v)].store(ov.load())
                if tidx == 0:
                    mCnt[tile] = Int32(0)

        return kernel

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32
        gate_up, down = self.slot_gate_up_kernel(), self.down_combine_kernel()
        L, inter, t = self.L, self.I, self.tiling

        @cute.jit
        def host(mZ: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW13: cute.Tensor, mS13: cute.Tensor,
                 mW2: cute.Tensor, mS2: cute.Tensor, beta: Float32, lbeta: Float32, mAct: cute.Tensor,
                 mO: cute.Tensor, mY: cute.Tensor, mCnt: cute.Tensor, stream):
            P = mIds.shape[0]
            gW13 = cute.zipped_divide(mW13, (1, 4))
            gW2 = cute.zipped_divide(mW2, (1, 4))
            gZ = cute.zipped_divide(mZ, (1, 8))
            gAct = cute.zipped_divide(mAct, (1, 8))
            gO = cute.zipped_divide(mO, (1, 8))
            gY = cute.zipped_divide(mY, (1, 8))
            gate_up(gZ, gW13, mS13, mIds, mAct, beta, lbeta).launch(
                grid=[inter // 16, P, 1], block=[32 * t.gate_warps, 1, 1], stream=stream)
            down(gAct, gW2, mS2, mIds, mWts, mO, gO, gY, mCnt).launch(
                grid=[L // (16 * t.down_frag), P, 1], block=[32 * t.down_warps, 1, 1], stream=stream)

        return host


def runs(B: int, k: int, E: int) -> bool:
    """Whether the two launches take B tokens of k slots over E experts (else the four launches)."""
    return 1 <= B <= SLOTS_MAX and k > 0 and E > 0


def tiles(L: int, t: Tiling) -> int:
    """Column tiles of the down GEMM (one ticket counter each)."""
    return L // (16 * t.down_frag)


@runtime.compile_cache("moe_experts_mxfp4_slots")
def _compile(wd: str, ids_dtype: str, E: int, L: int, inter: int, k: int, t: Tiling):
    """One function for the two launches; the batch is dynamic (the form runs it at B = 1)."""
    op = MoeExpertsSlots(wd, ids_dtype, E, L, inter, k, t)
    b, p, pa, po = (runtime.sym_int() for _ in range(4))
    from cutlass import Float32
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(wd, (b, L)),
        runtime.fake_tensor(ids_dtype, (p,), align=8 if ids_dtype == "int64" else 4),
        runtime.fake_tensor("float32", (p,), align=4),
        mx._rows64("int32", E * 2 * inter, L // 8, 4),
        mx._rows64("uint8", E * 2 * inter, L // 32, 1),
        mx._rows64("int32", E * L, inter // 8, 4),
        mx._rows64("uint8", E * L, inter // 32, 1),
        Float32(4.0), Float32(25.0),
        runtime.fake_tensor(wd, (pa, inter)),
        runtime.fake_tensor(wd, (po, L)),
        runtime.fake_tensor(wd, (b, L)),
        runtime.fake_tensor("int32", (tiles(L, t),), align=4))


_counters: dict = {}


def counters(device, n: int) -> torch.Tensor:
    """The n column tiles' ticket counters (int32, zeroed once) for `device` and the current stream, made
    on first use and reused: the kernel leaves them at zero."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream, n)
    hit = _counters.get(key)
    if hit is None:
        hit = _counters[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return hit


def launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta: float,
           situ_linear_beta: float, out, variant: mx.MoeExpertsConfig | None = None,
           scratch: dict | None = None) -> None:
    """y into `out` (B x L, wd) for B = z.shape[0] <= SLOTS_MAX tokens and k, E > 0, on the current
    stream; `variant` (a four-launch variant's tiling) or `pick`'s. `scratch` (tests): a dict that
    receives a[pair, I] and o[pair, L] the launches wrote."""
    B, L = z.shape
    E, inter, k = w13_packed.shape[0], w2_packed.shape[2] * 2, ids.shape[1]
    t = Tiling.of(variant) if variant is not None else pick(L, inter)
    if not runs(B, k, E):
        raise ValueError(f"z, ids: {B} tokens of {k} slots over {E} experts; the two-launch form takes "
                         f"1..{SLOTS_MAX} tokens and k, E > 0")
    P = B * k
    ids_flat = ids.contiguous().view(-1)
    fn = _compile(runtime.dtype_name(z.dtype), runtime.dtype_name(ids_flat.dtype), E, L, inter, k, t)
    act = torch.empty(P, inter, dtype=z.dtype, device=z.device)
    o = torch.empty(P, L, dtype=z.dtype, device=z.device)
    dst = runtime.aligned(out) if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    w13 = runtime.aligned(w13_packed.contiguous()).view(torch.int32).view(E * 2 * inter, L // 8)
    w2 = runtime.aligned(w2_packed.contiguous()).view(torch.int32).view(E * L, inter // 8)
    fn(runtime.aligned(z.contiguous()), ids_flat, weights.contiguous().view(-1).to(torch.float32),
       w13, w13_scale.contiguous().view(E * 2 * inter, L // 32),
       w2, w2_scale.contiguous().view(E * L, inter // 32),
       float(situ_beta), float(situ_linear_beta), act, o, dst, counters(z.device, tiles(L, t)))
    runtime.write_back(dst, out)
    if scratch is not None:
        scratch.update(act=act, o=o)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("moe_experts_mxfp4_slots", mutates_args=("out",))
        def moe_experts_mxfp4_slots_out(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                        w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                                        w2_scale: torch.Tensor, situ_beta: float, situ_linear_beta: float,
                                        out: torch.Tensor) -> None:
            launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta, out)

        _op = moe_experts_mxfp4_slots_out
    return _op


def moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
                      variant: mx.MoeExpertsConfig | None = None):
    """Fused replacement of references.moe.moe_experts_mxfp4 (same signature): two launches at
    B <= SLOTS_MAX, else fused.moe_experts_mxfp4's four."""
    args = (z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta)
    mx._check(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
    if not runs(z.shape[0], ids.shape[1], w13_packed.shape[0]):
        return mx.moe_experts_mxfp4(*args, out=out, variant=variant)
    if out is None:
        out = torch.empty_like(z, memory_format=torch.contiguous_format)
    if variant is not None:
        launch(*args, out, variant)
    else:
        _custom_op()(*args[:7], float(situ_beta), float(situ_linear_beta), out)
    return out
