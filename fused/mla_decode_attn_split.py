"""Kernels of fused/mla_decode_attn.py: the split-KV partial attention and its LSE combine.

Rows. A sequence's R = n_q * H query rows are q_abs[b].view(R, C), row m = j * H + h (token j, head h);
query token j sees slots t < L - n_q + j + 1. All rows share the sequence's one latent KV stream.

`SplitPartial`, grid (S, row tiles, B), 32 * m_atoms * WD threads. CTA (s, tile, b) takes 16 * m_atoms
rows and split s of the sequence's pages: ceil(pages / S) pages each, so split boundaries are page
aligned (references.mla.mla_decode_attn_split_kv's chunks). It walks its slots in tiles of N, each
tile of N slots x C brought into shared memory once by cp.async (two stages; the tile's page ids read
from the block table once, before its copies) and used by every row of the CTA. Warp (wm, wd) owns
m16 row atom wm and output columns [wd * DW, (wd + 1) * DW), DW = min(D, 128), WD = D / DW. Per tile:
the atom's scores S = Q K^T over C (mma.sync m16n8k16, fp32 accumulate), an online softmax in log2 units (scale * log2 e
folded in, ex2.approx), and O += P V for the warp's columns with P rounded to the working dtype
(FlashMLA's choice; the spec's k = 4). Only P and the operands are in the working dtype: scores, m,
l, O and the split partials are fp32; fp16 P is exp2((x - m) + P_SHIFT) <= 2^15 (p_exponent) at any
score size (fp16 wide-range scores pass 2^24). Paths (PATHS): "whole", every warp of the atom computes all of S
(the same bits in each, no exchange); "split", warp wd takes the k-steps wd, wd + WD, .. of C and the
atom's WD partial scores are summed through shared memory in warp order, so every warp again holds the
same S; "split_ldsm", split, with P V's B fragments loaded by ldmatrix.x4.trans instead of 2-byte loads.
Slots at or past a row's causal limit get p = 0; slot rows past the split's end are zero in shared
memory, so no stale or unwritten bits reach the P V product.
Direct mode (S = 1): o / l rounded to wd into o_latent. Else fp32 partials o / l and
lse = ln(sum exp) per (split, row) into a workspace; an empty split writes o = 0, lse = -inf.

Shared memory rows are C padded to Cp (a multiple of 64, zeros past C) and swizzled by 16-byte chunk:
chunk c of row n sits at (c & ~7) | ((c ^ f(n)) & 7), f(n) = 4 (n & 1) + ((n >> 1) & 3), so the
score loads (rows n, n + 1 of one quarter warp, 64 bytes each) and the column loads of P V (8 rows,
one chunk) fall in distinct banks.

MMA fragments (m16n8k16; lane l, q = l % 4, r = l // 4): A holds (r, 2q) (r, 2q+1) (r+8, 2q)
(r+8, 2q+1) (r, 2q+8) (r, 2q+9) (r+8, 2q+8) (r+8, 2q+9); B holds (k = 2q, 2q+1, 2q+8, 2q+9; n = r);
C holds (r, 2q) (r, 2q+1) (r+8, 2q) (r+8, 2q+1). For Q K^T the lane loads 8 consecutive c of Q rows
r, r + 8 and of K row r and gives elements 0..3 to one MMA's k-slots, 4..7 to the next one's (the sum
over c does not care which c sits in which k-slot when A and B agree). For P V the score C-fragments
of slot blocks 2k and 2k + 1 are the A fragment of k-block k, and B is read column-wise from the tile.

`Combine`, one CTA of 32 * WARPS threads per (sequence, row): lse = max + ln sum exp(lse_s - max) over
the splits (every warp computes it with the same lane-strided sums and warp reductions, so all hold the
same bits), then thread t owns columns t, t + 32 * WARPS, .. and sums o = sum_s exp(lse_s - lse) o_s
over the splits in order in fp32, one rounding; the split loop is unrolled, so several splits' loads
are in flight at once (a warp per row that walked the columns 32 at a time made 16 x S dependent L2
round trips: 133 us at S = 132 against 14 us this way, the same bits, H200). Every split at -inf ->
o = NaN, lse = -inf (references.mla.mla_decode_attn_split_kv's answer, and softmax's for a row whose
scores are all -inf).

Infinite scores, as torch: a running max of +-inf is shifted by 0 (logsumexp's rule), so a +inf score
gives lse = +inf and o = NaN (softmax's inf / inf), where shifting by the max would give lse = NaN;
under a +inf max l is not rescaled (alpha = 1: a lane's l = 0 times exp2(m_old) = inf would be NaN); a
NaN lse of one split stays NaN in the combine (fmax skips it, its exp does not).
"""
from __future__ import annotations

import math
import operator

from fused import runtime

cutlass, cute = runtime.cutlass_modules()
from cutlass import Float32, Int32, Int64, const_expr  # noqa: E402

LOG2E = math.log2(math.e)
# fp16 P is exp2(x - m + P_SHIFT) (max 2^15 < 65504): a probability down to 2^-14 / 2^15 stays a normal
# fp16 number, where [0, 1] would leave a 128k-slot flat softmax (p ~ 2^-17) subnormal at ~1 % precision.
# l sums the same shifted p, so o = acc / l is unchanged; the lse takes the shift back (p_exponent, lse_log2).
P_SHIFT = 15.0
LN2 = math.log(2.0)
VEC = 8            # elements per 16-byte chunk
STAGES = 2
PATHS = ("whole", "split", "split_ldsm")   # score and P V paths (SplitPartial)
COMBINE_UNROLL = 4   # splits whose loads Combine issues before their sums


def _swz(n, c, row_chunks: int):
    """Index of 16-byte chunk c of smem row n (rows of `row_chunks` chunks, a multiple of 8), swizzled."""
    f = ((n & 1) << 2) | ((n >> 1) & 3)
    return n * row_chunks + ((c & ~7) | ((c ^ f) & 7))


def p_exponent(x, m, shift: float):
    """log2 of P for a scaled score x (log2 units) and its row's running max m >= x: (x - m) + shift.
    The difference comes first, so the exponent is at most `shift` however large m is; x - (m - shift)
    would round m - shift by ulp(m) (2 from |m| = 2^24, fp16 wide-range scores reach 2^25) and give
    P = 2^16 = inf in fp16. Plain DSL or torch arithmetic: the kernel and its CPU emulation share it."""
    return x - m if shift == 0.0 else (x - m) + shift


def lse_log2(m, log2_l, shift: float):
    """The row's lse in log2 units from its max m and log2 of its l (a sum of shifted p): the shift
    leaves the small term, so m is rounded against once."""
    return m + log2_l if shift == 0.0 else m + (log2_l - shift)


class SplitPartial:
    def __init__(self, dtype, C: int, D: int, page: int, m_atoms: int, n_tile: int, direct: bool,
                 path: str = "whole"):
        if path not in PATHS:
            raise ValueError(f"mla_decode_attn: path {path!r} is not one of {PATHS}")
        if C % VEC or D % 16 or n_tile % 16:
            raise ValueError(f"mla_decode_attn: C={C} must be a multiple of 8, kv_lora={D} of 16, tile {n_tile} of 16")
        if page % n_tile and n_tile % page:
            raise ValueError(f"mla_decode_attn: page {page} and tile {n_tile}: one must divide the other")
        self.dtype, self.C, self.D, self.page = dtype, C, D, page
        self.pages_per_tile = max(1, n_tile // page)
        self.WM, self.N, self.direct = m_atoms, n_tile, direct
        self.DW = 128 if D % 128 == 0 else D
        self.WD = D // self.DW
        self.rows = 16 * m_atoms
        self.Cp = -(-C // 64) * 64
        self.Cc, self.Cpc = C // VEC, self.Cp // VEC
        self.threads = 32 * self.WM * self.WD
        self.xc = path != "whole" and self.WD > 1   # the atom's WD warps split C and sum S through smem
        self.ldsm = path == "split_ldsm"              # V fragments by ldmatrix.trans, not 2-byte loads
        self.p_shift = P_SHIFT if dtype is cutlass.Float16 else 0.0
        self.nks = self.Cp // 32                     # 32-wide k-steps of the score contraction

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor, mLens: cute.Tensor,
                 mO: cute.Tensor, mLse: cute.Tensor, H: Int32, scale_log2: Float32, n_splits: Int32, stream):
        row_tiles = (mQ.shape[1] + self.rows - 1) // self.rows
        self.kernel(mQ, mCache, mBT, mLens, mO, mLse, H, scale_log2, n_splits).launch(
            grid=[n_splits, row_tiles, mQ.shape[0]], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mCache: cute.Tensor, mBT: cute.Tensor, mLens: cute.Tensor,
               mO: cute.Tensor, mLse: cute.Tensor, H: Int32, scale_log2: Float32, n_splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        s, rt, b = cute.arch.block_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        q, r = lane % 4, lane // 4
        wm, wd = warp // self.WD, warp % self.WD
        N, Cp, page = self.N, self.Cp, self.page
        R = mQ.shape[1]
        n_q = R // H
        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, cute.make_layout(self.rows * Cp), byte_alignment=128)
        sKV = smem.allocate_tensor(self.dtype, cute.make_layout(STAGES * N * Cp), byte_alignment=128)
        sX = None
        if const_expr(self.xc):     # partial scores of every warp: [atom][warp][fragment element][lane]
            sX = smem.allocate_tensor(Float32, cute.make_layout(self.WM * self.WD * (N // 2) * 32), byte_alignment=128)
        # this split's slots [start, stop) of a length clamped to the block table (never a read past it)
        L = cutlass.max(cutlass.min(mLens[b], mBT.shape[1] * page), 0)
        pps = ((L + page - 1) // page + n_splits - 1) // n_splits
        start = s * pps * page
        stop = cutlass.min(L, start + pps * page)
        n_tiles = (cutlass.max(stop - start, 0) + N - 1) // N
        row0 = rt * self.rows
        sQc, sKVc = cute.zipped_divide(sQ, (VEC,)), cute.zipped_divide(sKV, (VEC,))
        self.load_q(mQ, sQc, b, row0, R, tidx)
        self.zero_tail(sKVc, tidx)
        if n_tiles > 0:
            self.load_tile(mCache, mBT, sKVc, b, start, stop, 0, tidx)
        cute.arch.cp_async_commit_group()
        # rows of this lane (r, r + 8 of the warp's atom) and their causal limits
        ra = row0 + wm * 16 + r
        lim_a = cutlass.min(stop, L - n_q + ra // H + 1)
        lim_b = cutlass.min(stop, L - n_q + (ra + 8) // H + 1)
        nb = self.DW // 8
        acc = cute.make_rmem_tensor(cute.make_layout((4, 1, nb)), Float32)
        acc.fill(0.0)
        ml = cute.make_rmem_tensor(cute.make_layout(4), Float32)   # m_a, m_b, l_a, l_b (lane partial l)
        ml[0] = -math.inf
        ml[1] = -math.inf
        ml[2] = 0.0
        ml[3] = 0.0
        for it in cutlass.range(n_tiles):
            if it + 1 < n_tiles:
                self.load_tile(mCache, mBT, sKVc, b, start + (it + 1) * N, stop, (it + 1) % STAGES, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()
            base = (it % STAGES) * N * self.Cpc                       # in chunks
            sc = self.scores(sQc, sKVc, base, wm * 16 + r, q, r, wd)
            if const_expr(self.xc):
                self.sum_scores(sc, sX, wm, wd, lane)
            t0 = start + it * N + 2 * q
            pf = self.softmax_step(sc, ml, acc, t0, lim_a, lim_b, scale_log2)
            if const_expr(self.ldsm):
                self.pv_ldsm(pf, sKVc, base, acc, wd * self.DW, lane)
            else:
                self.pv(pf, sKV, base, acc, wd * self.DW, q, r)
            cute.arch.sync_threads()
        cute.arch.cp_async_wait_group(0)          # q's copies when the split is empty
        self.epilogue(acc, ml, mO, mLse, b, s, ra, R, wd * self.DW + 2 * q, q, wd)

    @cute.jit
    def load_q(self, mQ, sQc, b, row0, R, tidx):
        """Rows row0.. of q into sQ by cp.async; rows past R and columns past C are zeros."""
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)
        gQ = cute.zipped_divide(mQ, (1, 1, VEC))
        for i in cutlass.range(tidx, self.rows * self.Cpc, self.threads):
            n, c = i // self.Cpc, i % self.Cpc
            dst = sQc[None, _swz(n, c, self.Cpc)]
            if row0 + n < R and c < self.Cc:
                cute.copy(atom, cute.make_tensor(gQ[None, (b, row0 + n, c)].iterator, cute.make_layout(VEC)), dst)
            else:
                dst.fill(0.0)

    @cute.jit
    def zero_tail(self, sKVc, tidx):
        """Columns C..Cp of every stage row: zeros, never overwritten by a tile load."""
        tail = self.Cpc - self.Cc
        if const_expr(tail > 0):
            for i in cutlass.range(tidx, STAGES * self.N * tail, self.threads):
                n, c = i // tail, self.Cc + i % tail
                sKVc[None, _swz(n % self.N, c, self.Cpc) + (n // self.N) * self.N * self.Cpc].fill(0.0)

    @cute.jit
    def load_tile(self, mCache, mBT, sKVc, b, t0, stop, stage, tidx):
        """Slots t0 .. t0 + N of the sequence into stage `stage` (cp.async); slots >= stop as zeros."""
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=128)
        gC = cute.zipped_divide(mCache, (1, 1, VEC))
        n_pages = mCache.shape[0]
        # The tile's page ids, read once before its copies (PT independent loads): an id read per chunk
        # put a dependent global load in front of every cp.async. t0 is a multiple of N from a page-aligned
        # split start, so the tile starts a page (page <= N) or lies inside one (N divides page).
        PT = self.pages_per_tile
        pids = cute.make_rmem_tensor(cute.make_layout(PT), Int32)
        for k in cutlass.range_constexpr(PT):
            tk = cutlass.min(t0 + k * self.page, stop - 1)
            pids[k] = cutlass.max(cutlass.min(mBT[b, tk // self.page], n_pages - 1), 0)
        for i in cutlass.range(tidx, self.N * self.Cc, self.threads):
            n, c = i // self.Cc, i % self.Cc
            dst = sKVc[None, stage * self.N * self.Cpc + _swz(n, c, self.Cpc)]
            t = t0 + n
            if t < stop:
                pid = pids[0]
                for k in cutlass.range_constexpr(1, PT):
                    if n >= k * self.page:
                        pid = pids[k]
                src = gC[None, (pid, t % self.page, c)]
                cute.copy(atom, cute.make_tensor(src.iterator, cute.make_layout(VEC)), dst)
            else:
                dst.fill(0.0)

    @cute.jit
    def scores(self, sQc, sKVc, base, qrow, q, r, wd):
        """S[16 rows, N slots] of this warp's atom: fragments (4, 1, N / 8), slot block j = 8j .. 8j + 7.
        Split scores: only the k-steps ks = i * WD + wd (a partial S, summed by sum_scores)."""
        nj = self.N // 8
        sc = cute.make_rmem_tensor(cute.make_layout((4, 1, nj)), Float32)
        sc.fill(0.0)
        steps = -(-self.nks // self.WD) if const_expr(self.xc) else self.nks
        for i in cutlass.range_constexpr(steps):
            ks = i * self.WD + wd if const_expr(self.xc) else i
            if const_expr(self.xc and (i + 1) * self.WD > self.nks):
                if ks < self.nks:
                    self.score_step(sc, sQc, sKVc, base, qrow, ks, q, r)
            else:
                self.score_step(sc, sQc, sKVc, base, qrow, ks, q, r)
        return sc

    @cute.jit
    def score_step(self, sc, sQc, sKVc, base, qrow, ks, q, r):
        """sc += the 32 columns 32 ks .. 32 ks + 31 of Q K^T (two MMA k-steps per slot block)."""
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)))
        nj = self.N // 8
        c = 4 * ks + q
        qa = sQc[None, _swz(qrow, c, self.Cpc)].load()
        qb = sQc[None, _swz(qrow + 8, c, self.Cpc)].load()
        kv = cute.make_rmem_tensor(cute.make_layout((VEC, nj)), self.dtype)
        for j in cutlass.range_constexpr(nj):
            kv[None, j].store(sKVc[None, base + _swz(8 * j + r, c, self.Cpc)].load())
        for kk in cutlass.range_constexpr(2):
            afr = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), self.dtype)
            for e in cutlass.range_constexpr(2):
                afr[e, 0, 0] = qa[4 * kk + e]
                afr[2 + e, 0, 0] = qb[4 * kk + e]
                afr[4 + e, 0, 0] = qa[4 * kk + 2 + e]
                afr[6 + e, 0, 0] = qb[4 * kk + 2 + e]
            bfr = cute.make_rmem_tensor(cute.make_layout((4, nj, 1)), self.dtype)
            for j in cutlass.range_constexpr(nj):
                for e in cutlass.range_constexpr(4):
                    bfr[e, j, 0] = kv[4 * kk + e, j]
            cute.gemm(atom, sc, afr, bfr, sc)

    @cute.jit
    def sum_scores(self, sc, sX, wm, wd, lane):
        """Every warp of the atom: S = its WD partials summed in warp order (the same bits in each).
        A lane's 4 values of slot block j sit together (16-byte stores and loads, lanes adjacent)."""
        nj = self.N // 8
        sXv = cute.zipped_divide(sX, (4,))
        for j in cutlass.range_constexpr(nj):
            sXv[None, ((wm * self.WD + wd) * nj + j) * 32 + lane].store(sc[None, 0, j].load())
        cute.arch.barrier(barrier_id=1 + wm, number_of_threads=32 * self.WD)
        for j in cutlass.range_constexpr(nj):
            tot = sXv[None, (wm * self.WD * nj + j) * 32 + lane].load()
            for w in cutlass.range_constexpr(1, self.WD):
                tot = tot + sXv[None, ((wm * self.WD + w) * nj + j) * 32 + lane].load()
            sc[None, 0, j].store(tot)

    @cute.jit
    def softmax_step(self, sc, ml, acc, t0, lim_a, lim_b, scale_log2):
        """Online softmax over one tile in log2 units; rescales acc; returns P in wd as fragments (4, N / 8)."""
        nj = self.N // 8
        mx = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        mx[0] = ml[0]
        mx[1] = ml[1]
        for j in cutlass.range_constexpr(nj):
            for e in cutlass.range_constexpr(4):
                lim = lim_a if e < 2 else lim_b
                x = sc[e, 0, j] * scale_log2
                if t0 + 8 * j + e % 2 >= lim:
                    x = Float32(-math.inf)
                sc[e, 0, j] = x
                mx[e // 2] = cute.arch.fmax(mx[e // 2], x)
        pf = cute.make_rmem_tensor(cute.make_layout((4, nj)), self.dtype)
        for h in cutlass.range_constexpr(2):
            m = mx[h]
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
            m_use = m
            # an infinite max shifts by 0, as torch's logsumexp: -inf (nothing visible yet) gives
            # exp2(-inf - 0) = 0; +inf gives l = inf, so lse = +inf where inf - inf would give NaN
            if m == -math.inf or m == math.inf:
                m_use = Float32(0.0)
            alpha = cute.math.exp2(ml[h] - m_use, fastmath=True)
            if m == math.inf:
                # l and acc stay unscaled: exp2(m_old - 0) overflows for a large finite m_old, and a lane
                # whose slots gave p = 0 so far would hold l = 0 * inf = NaN (the row's lse NaN, not +inf)
                alpha = Float32(1.0)
            ml[h] = m
            lsum = Float32(0.0)
            for j in cutlass.range_constexpr(nj):
                for e in cutlass.range_constexpr(2):
                    p = cute.math.exp2(p_exponent(sc[2 * h + e, 0, j], m_use, self.p_shift), fastmath=True)
                    lsum = lsum + p
                    pf[2 * h + e, j] = p.to(self.dtype)
            ml[2 + h] = ml[2 + h] * alpha + lsum
            for d in cutlass.range_constexpr(self.DW // 8):
                for e in cutlass.range_constexpr(2):
                    acc[2 * h + e, 0, d] = acc[2 * h + e, 0, d] * alpha
        return pf

    @cute.jit
    def pv(self, pf, sKV, base, acc, d0, q, r):
        """acc[16 rows, DW cols] += P[16, N] V[N, d0 .. d0 + DW]; V read column-wise (scalar loads)."""
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)))
        nb = self.DW // 8
        for kb in cutlass.range_constexpr(self.N // 16):
            afr = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), self.dtype)
            for e in cutlass.range_constexpr(4):
                afr[e, 0, 0] = pf[e, 2 * kb]
                afr[4 + e, 0, 0] = pf[e, 2 * kb + 1]
            bfr = cute.make_rmem_tensor(cute.make_layout((4, nb, 1)), self.dtype)
            for e in cutlass.range_constexpr(4):
                n = 16 * kb + 2 * q + (e % 2) + 8 * (e // 2)
                for d in cutlass.range_constexpr(nb):
                    bfr[e, d, 0] = sKV[(base + _swz(n, d0 // VEC + d, self.Cpc)) * VEC + r]
            cute.gemm(atom, acc, afr, bfr, acc)

    @cute.jit
    def pv_ldsm(self, pf, sKVc, base, acc, d0, lane):
        """pv with B from ldmatrix.x4.trans: lane l addresses row (slot) 16 kb + 8 ((l // 8) % 2) + l % 8,
        chunk d0 / 8 + 2 dp + l // 16; registers 0..3 are B's (k 2q, 2q+1), (2q+8, 2q+9) of n8 blocks 2dp, 2dp+1."""
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)))
        nb = self.DW // 8
        mi, lr = lane // 8, lane % 8
        for kb in cutlass.range_constexpr(self.N // 16):
            afr = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), self.dtype)
            for e in cutlass.range_constexpr(4):
                afr[e, 0, 0] = pf[e, 2 * kb]
                afr[4 + e, 0, 0] = pf[e, 2 * kb + 1]
            bw = cute.make_rmem_tensor(cute.make_layout((2, nb, 1)), Int32)
            n = 16 * kb + (mi % 2) * 8 + lr
            for dp in cutlass.range_constexpr(nb // 2):
                addr = sKVc[None, base + _swz(n, d0 // VEC + 2 * dp + mi // 2, self.Cpc)].iterator.toint()
                w = cute.arch.inline_ptx(
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                    write_only_types=[Int32, Int32, Int32, Int32], read_only_args=[addr])
                bw[0, 2 * dp, 0] = w[0]
                bw[1, 2 * dp, 0] = w[1]
                bw[0, 2 * dp + 1, 0] = w[2]
                bw[1, 2 * dp + 1, 0] = w[3]
            cute.gemm(atom, acc, afr, cute.recast_tensor(bw, self.dtype), acc)

    @cute.jit
    def epilogue(self, acc, ml, mO, mLse, b, s, ra, R, col, q, wd):
        """o = acc / l per row (rows r, r + 8 of the atom) and its lse. Direct: a row whose visible scores
        are all -inf gives 0 / 0 = NaN, as softmax does; a partial with l = 0 (no visible slot, or
        all -inf) gives o = 0, lse = -inf, which the combine weighs 0 (NaN if every split has it)."""
        for h in cutlass.range_constexpr(2):
            row = ra + 8 * h
            lrow = ml[2 + h]
            lrow = lrow + cute.arch.shuffle_sync_bfly(lrow, offset=1)
            lrow = lrow + cute.arch.shuffle_sync_bfly(lrow, offset=2)
            inv = Float32(1.0) / lrow
            if ml[h] == math.inf:                   # a +inf score: o = NaN (softmax's inf / inf), lse = +inf
                inv = Float32(math.nan)
            lse = lse_log2(ml[h], cute.math.log2(lrow, fastmath=False), self.p_shift) * LN2
            if const_expr(not self.direct):
                if lrow == 0.0:
                    inv = Float32(0.0)
                    lse = Float32(-math.inf)
            if row < R:
                for d in cutlass.range_constexpr(self.DW // 8):
                    for e in cutlass.range_constexpr(2):
                        mO[b, s, row, col + 8 * d + e] = (acc[2 * h + e, 0, d] * inv).to(mO.element_type)
                if q == 0:
                    if wd == 0:
                        mLse[b, s, row] = lse


class Combine:
    """o[b, row] = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s; one CTA per (b, row)."""

    def __init__(self, D: int, warps: int = 8):
        self.D, self.WARPS = D, warps
        self.T = 32 * warps
        self.COLS = -(-D // self.T)           # columns per thread

    @cute.jit
    def __call__(self, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, stream):
        n = mPO.shape[0] * mPO.shape[2]
        self.kernel(mPO, mPL, mO, mLse).launch(grid=[n, 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        i, _, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        S, R = mPO.shape[1], mPO.shape[2]
        b, row = i // R, i % R
        # the row's lse, the same bits in every warp
        m = Float32(-math.inf)
        for s in cutlass.range(lane, S, 32):
            m = cute.arch.fmax(m, mPL[b, s, row])
        m = cute.arch.warp_reduction(m, cute.arch.fmax)
        m_use = m
        if m == -math.inf or m == math.inf:     # shifted by 0, as torch.logsumexp: +inf stays +inf
            m_use = Float32(0.0)
        tot = Float32(0.0)
        for s in cutlass.range(lane, S, 32):
            tot = tot + cute.math.exp(mPL[b, s, row] - m_use)
        tot = cute.arch.warp_reduction(tot, operator.add)
        # tot = 0 (every split -inf): log 0 = -inf; a NaN split's lse (fmax skips it) keeps tot NaN
        lse = m_use + cute.math.log(tot)
        # columns tid, tid + T, ..: each column's sum over the splits in order
        acc = cute.make_rmem_tensor(self.COLS, Float32)
        for k in cutlass.range_constexpr(self.COLS):
            acc[k] = Float32(0.0)
        for s in cutlass.range(S, unroll=COMBINE_UNROLL):
            w = cute.math.exp(mPL[b, s, row] - lse)
            for k in cutlass.range_constexpr(self.COLS):
                d = tid + k * self.T
                if d < self.D:
                    # every split -inf: exp(-inf + inf) = NaN, softmax's answer for a row with no mass
                    acc[k] = acc[k] + w * mPO[b, s, row, d]
        for k in cutlass.range_constexpr(self.COLS):
            d = tid + k * self.T
            if d < self.D:
                mO[b, row, d] = acc[k].to(mO.element_type)
        if tid == 0:
            mLse[b, row] = lse
