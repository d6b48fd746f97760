"""Device code of moe_experts_mxfp4's two expert GEMMs: MXFP4 weights x a few token rows, mma.sync.

One CTA = one active expert (the route kernel's compact list, grid y) x one tile of weight rows
(grid x); its `warps` warps split the reduction dim K in 128-wide steps (warp w takes steps w, w +
warps, ...), each warp accumulating in mma.sync m16n8k16 fragments (bf16/fp16 in, fp32 accumulate),
and the warps' partials are summed through shared memory in warp order: the order of every output's
sum depends on K and `warps` only, never on the tokens, so results are deterministic and batch
invariant. The expert's tokens (members of the route kernel's list) are the MMA's n = 8 columns,
8 x `nb` per pass, a loop of passes when more tokens share the expert (the weights then come from L2).

Operands straight from global memory, no shared memory: the sum over k does not depend on which k sits
in which MMA slot, provided A and B use the same assignment (as fused/skinny_gemm_mma.py). Lane l
(q = l % 4, r = l // 4) loads, per step, the 16-byte chunk c = 4 * step + q of its weight rows r and
r + 8 of each 16-row atom: 32 E2M1 codes, exactly one MXFP4 group, so one scale byte per row and chunk.
It also loads the 32 matching elements of token row r (4 x 16 bytes). Word w of the chunk (codes 8w ..
8w+7) is dequantised to 8 wd values, which feed two MMAs: elements 0..3 the slots (2q, 2q+1, 2q+8,
2q+9) of the first, 4..7 those of the second; the token's elements 8w .. 8w+7 go to the same slots.

Dequantisation is exact, as the reference's: bf16 by byte permutes and one bf16x2 multiply by the
scale (fused/mxfp4_dequant.py's `_bf16_words`: subnormal 2^-127 for byte 0, NaN for 0xFF); fp16 by
the exact fp32 product E2M1 * 2^(e-127) rounded once to fp16 (cvt.rn), as the float64 reference
rounds it (overflow to inf, subnormals). Chunks past K (K / 32 not a multiple of 4) load nothing and
contribute zeros.
"""

from fused import runtime
from fused.mxfp4_dequant import _bf16_words

WORDS = 4            # 32-bit words of codes in a 16-byte chunk (one MXFP4 group)
QUADS = 4            # lanes sharing a row (q = lane % 4): chunks per 128-wide k-step
VEC = 8              # wd elements per 16-byte load of the token rows


def dequant_word(cutlass, cute, ab, w, e):
    """The 8 codes of word `w` times 2^(e-127) as an rmem tensor of 8 `ab` values, each the exact
    product rounded once to `ab` (NaN for e = 255)."""
    from cutlass import BFloat16, Float32, Int32

    if ab is BFloat16:
        ow = cute.make_rmem_tensor(cute.make_layout(4), Int32)
        _bf16_words(cutlass, cute, Int32, w, e, ow)
        return cute.recast_tensor(ow, ab)
    sbits = cute.make_rmem_tensor(cute.make_layout(1), Int32)
    sbits[0] = cutlass.select_(e == 255, Int32(0x7FC00000),
                               cutlass.select_(e == 0, Int32(0x00400000), e << 23))
    scale = cute.recast_tensor(sbits, Float32)[0]
    bits = cute.make_rmem_tensor(cute.make_layout(8), Int32)
    for i in range(8):
        sign = (w << (28 - 4 * i)) & Int32(-0x80000000)
        mag = (w << (22 - 4 * i)) if i <= 5 else (w >> (4 * i - 22))
        bits[i] = sign | (mag & Int32(0x01C00000))          # E2M1 * 2^-126 as fp32 bits
    vals = cute.recast_tensor(bits, Float32).load() * Float32(2.0 ** 126) * scale
    out = cute.make_rmem_tensor(cute.make_layout(8), ab)
    out.store(vals.to(ab))
    return out


class ExpertGemv:
    """acc[(4, nfrag, nb)] = W[rows of the CTA] . X[token rows].T over K, for one token pass.

    Rows of atom f, half h, lane row r: `row0 + f * fstride + 8 * h + r` of the [E * O, K] weight."""

    def __init__(self, K: int, nfrag: int, fstride: int, nb: int, warps: int, unroll: int):
        self.K, self.nfrag, self.fstride, self.nb, self.warps = K, nfrag, fstride, nb, warps
        self.kc = K // 32                                   # chunks (groups) per row
        self.steps = -(-self.kc // QUADS)
        self.spw = -(-self.steps // warps)                  # steps per warp (the last ones predicated)
        self.unroll = max(1, min(unroll, self.spw))
        self.iters = -(-self.spw // self.unroll)
        self.nacc = 4 * nfrag * nb

    def smem_bytes(self) -> int:
        return 4 * self.nacc * 32

    def mainloop(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        nfrag, nb, warps, U = self.nfrag, self.nb, self.warps, self.unroll
        kc, iters, fstride, nacc = self.kc, self.iters, self.fstride, self.nacc
        nrow = 2 * nfrag

        @cute.jit
        def run(gW: cute.Tensor, mS: cute.Tensor, gX: cute.Tensor, row0: Int32, xrow: cute.Tensor,
                acc: cute.Tensor, red: cute.Tensor):
            """gW: ((4 words), (rows, chunks)) int32; mS: [rows, chunks] u8; gX: ((8), (tokens, K/8)) wd;
            xrow[nb]: the token row of this lane's MMA column r of each n-atom. On return the last warp's
            acc holds the CTA's sums (warp order)."""
            ab = gX.element_type
            atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(ab, Float32, (16, 8, 16)))
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            q = lane % 4
            r = lane // 4
            acc.fill(0.0)
            for it in cutlass.range(iters):
                wv = cute.make_rmem_tensor(cute.make_layout((WORDS, nrow, U)), Int32)
                sv = cute.make_rmem_tensor(cute.make_layout((nrow, U)), Int32)
                xv = cute.make_rmem_tensor(cute.make_layout((VEC, WORDS, nb, U)), ab)
                wv.fill(0)
                sv.fill(127)
                xv.fill(0.0)
                for u in cutlass.range_constexpr(U):
                    c = ((it * U + u) * warps + warp) * QUADS + q
                    if c < kc:
                        for f in cutlass.range_constexpr(nfrag):
                            for h in cutlass.range_constexpr(2):
                                row = row0 + f * fstride + 8 * h + r
                                wv[None, 2 * f + h, u].store(gW[None, (row, c)].load())
                                sv[2 * f + h, u] = Int32(mS[row, c])
                        for j in cutlass.range_constexpr(nb):
                            for v in cutlass.range_constexpr(WORDS):
                                xv[None, v, j, u].store(gX[None, (xrow[j], c * WORDS + v)].load())
                for u in cutlass.range_constexpr(U):
                    for wi in cutlass.range_constexpr(WORDS):
                        dq = cute.make_rmem_tensor(cute.make_layout((8, nrow)), ab)
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
                            bfr = cute.make_rmem_tensor(cute.make_layout((4, nb, 1)), ab)
                            for j in cutlass.range_constexpr(nb):
                                for e in cutlass.range_constexpr(4):
                                    bfr[e, j, 0] = xv[4 * sub + e, wi, j, u]
                            cute.gemm(atom, acc, afr, bfr, acc)
            # the warps' partials summed in warp order ((w0 + w1) + w2) + ..., into the last warp's acc
            if cutlass.const_expr(warps > 1):
                cute.arch.sync_threads()               # red may still be read by the previous pass
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
