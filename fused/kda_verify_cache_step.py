"""The kernel of fused/kda_verify_cache.py (the input-cache rollback design of references/kda_spec_cache.py):
one launch per verify, one per accept, one per committed(); no state written except at a write-back.

KdaCacheStep, per (head, sequence) CTA, in three compile-time modes:
  verify     the base state rows into registers (read once), the n_rep = fill[b] cached tokens replayed
             from the cache (no outputs, no writes), then the n = n_tokens[b] draft tokens: y[b, t] for
             t < n, zeros past n, and the draft's raw inputs stored to cache slots n_rep + t. No state,
             conv window or fill is written.
  writeback  (accept) f = fill[b] + accepted[b]; where f >= window the f cached tokens are replayed from
             the base and the base state and conv window rewritten in place; other sequences exit at
             once. fill_out[b] = 0 or f (every CTA of a sequence reads fill[b], so none may write it).
  commit     the replay of the fill[b] cached tokens, written to (conv_out, state_out).
Per token the arithmetic is kda_decode's as KdaVerify runs it (slot_convs' conv and gate, token_rows'
state update and read-out; conv outputs, o and y rounded to the working dtype, the state in fp32);
replayed tokens skip the read-out. Token s always runs as slot s % CHUNK of chunk s // CHUNK through
the same code whatever the counts, so a launch's bits for a token do not depend on how many follow.

Layout (B sequences, n_q draft slots, C = H*Dh, S = window - 1 + n_q cache slots): draft q_raw, k_raw,
v_raw, g_raw, z [B, n_q, C] and beta_raw [B, n_q, H] wd (unit stride on the last dim, any others);
counts [B] int32 or int64, clamped on the device (n_tokens, accepted to 0..n_q); cache [B, S, 5C + H]
wd contiguous, columns q, k, v, g, z (C each) then beta (H); fill, fill_out [B] int32; conv_w
[3, C, W], A_log [H], dt_bias [C], o_norm_w [Dh] fp32; base conv [B, 3, C, W-1] wd and base state
[B, H, Dh, Dh] fp32. One compile per (mode, dtype, Dh, W, count dtype, n_chunks, variant): batch,
heads, n_q and window are dynamic, S up to n_chunks x CHUNK.

Launch: grid (H, B), KdaVerify's thread layout and variants (KdaVerifyConfig). The tokens run in
n_chunks static chunks of CHUNK slots (chunks past the last token skipped): per chunk every thread
loads its conv / gate / beta / z operands of the chunk's slots (the cache's below n_rep, the draft's
above, stored to the cache), computes the chunk's convs and gates into shared memory (the conv window
carried in registers), one barrier, the chunk's tokens on the register state, one barrier, the
chunk's gated RMSNorms. Streaming the operands chunk by chunk holds KdaVerify's n_q = CHUNK registers
whatever window + n_q is; the chunks are unrolled, not a device loop, because a loop lets the
compiler hoist the chunk's operand addresses over the token loop (w16r8 verify: 167 registers
wanted in a loop, 119 unrolled).
"""
from __future__ import annotations

import operator

import torch

from fused import runtime
from fused.kda_decode import _sigmoid
from fused.kda_verify import KdaVerify, KdaVerifyConfig
from references.kda_spec import COUNT_DTYPES
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, Int32, const_expr  # noqa: E402

MODES = ("verify", "writeback", "commit")
CHUNK = 8                      # token slots per chunk (KdaVerify's MAX_SLOTS: the same registers)
MAX_CHUNKS = 4                 # cache slots window - 1 + n_q <= 32
TOKEN_INPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
WD_DTYPES = (torch.bfloat16, torch.float16)


class KdaCacheStep(KdaVerify):
    """Compile-time config: mode (MODES), working dtype, Dh, W, count dtype, variant. Inherits
    KdaVerify's thread layout and kda_decode's reductions (warp_sum_sq, transpose_sum)."""

    def __init__(self, dtype, Dh: int, W: int, mode: str, count_dtype, n_chunks: int,
                 config: KdaVerifyConfig = KdaVerifyConfig()):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r}; expected one of {MODES}")
        if not 1 <= n_chunks <= MAX_CHUNKS:
            raise ValueError(f"n_chunks: {n_chunks}; the kernel takes 1..{MAX_CHUNKS} chunks of {CHUNK} slots")
        super().__init__(dtype, Dh, W, CHUNK, count_dtype, config)
        self.mode, self.n_chunks = mode, n_chunks

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mZ: cute.Tensor, mCount: cute.Tensor, mCache: cute.Tensor, mFill: cute.Tensor, mFillOut: cute.Tensor,
                 mConvW: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
                 mConvS: cute.Tensor, mState: cute.Tensor, mConvOut: cute.Tensor, mStateOut: cute.Tensor,
                 mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32, norm_eps: Float32, window: Int32, stream):
        self.kernel(mQ, mK, mV, mG, mBeta, mZ, mCount, mCache, mFill, mFillOut, mConvW, mALog,
                    mDtBias, mNormW, mConvS, mState, mConvOut, mStateOut, mY, lower_bound, l2_eps, norm_eps,
                    window).launch(grid=[mState.shape[1], mState.shape[0], 1], block=[self.num_threads, 1, 1],
                                   stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mZ: cute.Tensor, mCount: cute.Tensor, mCache: cute.Tensor, mFill: cute.Tensor, mFillOut: cute.Tensor,
               mConvW: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
               mConvS: cute.Tensor, mState: cute.Tensor, mConvOut: cute.Tensor, mStateOut: cute.Tensor,
               mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32, norm_eps: Float32, window: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        Dh, CH, cd = self.Dh, CHUNK, self.count_dtype
        S = mCache.shape[1]                                # cache slots: window - 1 + n_q
        n_q = S - window + 1
        fill = mFill[b]
        n_rep, n, run = fill, Int32(0), True             # cached tokens replayed, draft tokens run
        if const_expr(self.mode == "verify"):
            n_rep = cutlass.min(cutlass.max(fill, Int32(0)), S - n_q)
            n = Int32(cutlass.min(cutlass.max(mCount[b], cd(0)), cd(n_q)))
        elif const_expr(self.mode == "writeback"):
            a = Int32(cutlass.min(cutlass.max(mCount[b], cd(0)), cd(n_q)))
            f = cutlass.max(fill, Int32(0)) + a
            run = f >= window
            n_rep = cutlass.min(f, S)
            if h == 0 and tidx == 0:
                mFillOut[b] = cutlass.select_(run, Int32(0), f)
        else:
            n_rep = cutlass.min(cutlass.max(fill, Int32(0)), S)
        smem = cutlass.memory.SmemAllocator()
        sQKV = smem.allocate_tensor(Float32, cute.make_layout((Dh, 3, CH), stride=(1, Dh, 3 * Dh)), 16)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout((Dh, CH), stride=(1, Dh)), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout((Dh, CH), stride=(1, Dh)), 16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout(CH), 16)
        sSig = smem.allocate_tensor(Float32, cute.make_layout((Dh, CH), stride=(1, Dh)), 16)
        if run:
            # 1. the base state rows (the bytes, read once), then the conv weights and base window
            st = cute.make_rmem_tensor((4, self.n_pass), Float32)
            self.state_rows(st, mState, b, h, True)
            wr, orr, a_log = self.window_operands(mConvW, mConvS, mALog, mDtBias, b, h, tidx)
            nw = cute.make_rmem_tensor(self.n_y, Float32)
            nw.fill(0.0)
            for i in cutlass.range_constexpr(self.n_y):
                if i * self.num_threads + tidx < Dh:
                    nw[i] = mNormW[i * self.num_threads + tidx].to(Float32)
            total = n_rep + n
            for ci in cutlass.range_constexpr(self.n_chunks):   # static: no address held over a token loop
                if ci * CH < total:
                    self.run_chunk(st, wr, orr, a_log, nw, mQ, mK, mV, mG, mBeta, mZ, mCache, mY, sQKV, sAlpha, sO,
                                   sBeta, sSig, Int32(ci * CH), n_rep, total, b, h, tidx, lower_bound, l2_eps,
                                   norm_eps)
            if const_expr(self.mode == "verify"):
                for t in cutlass.range(n_q - n, unroll=1):        # the slots past n_tokens: zeros
                    for i in cutlass.range_constexpr(self.n_y):
                        if i * self.num_threads + tidx < Dh:
                            mY[b, n + t, h * Dh + i * self.num_threads + tidx] = mY.element_type(0.0)
            else:
                self.state_rows(st, mStateOut, b, h, False)
                self.store_window(orr, mConvOut, b, h, tidx)

    @cute.jit
    def run_chunk(self, st, wr, orr, a_log, nw, mQ, mK, mV, mG, mBeta, mZ, mCache, mY, sQKV, sAlpha, sO, sBeta,
                  sSig, c0, n_rep, total, b, h, tidx, lower_bound, l2_eps, norm_eps):
        """Slots c0 .. c0 + CHUNK - 1 (those < total): operands and convs, the tokens, the draft's outputs."""
        # 2. the chunk's operands and convs (the window carried in registers) -> shared memory
        xr = self.chunk_operands(mQ, mK, mV, mG, mBeta, mZ, mCache, sBeta, sSig, c0, n_rep, total, b, h, tidx)
        self.chunk_convs(xr, wr, orr, a_log, sQKV, sAlpha, lower_bound, c0, total, h, tidx)
        cute.arch.sync_threads()
        # 3. the chunk's tokens on the register state (the draft's with their read-out)
        for j in cutlass.range(cutlass.min(total - c0, Int32(CHUNK)), unroll=1):
            if const_expr(self.mode == "verify"):
                if c0 + j >= n_rep:
                    self.cache_token_rows(st, sQKV[None, None, j], sAlpha[None, j], sO[None, j], sBeta[j], l2_eps,
                                          True)
                else:
                    self.cache_token_rows(st, sQKV[None, None, j], sAlpha[None, j], sO[None, j], sBeta[j], l2_eps,
                                          False)
            else:
                self.cache_token_rows(st, sQKV[None, None, j], sAlpha[None, j], sO[None, j], sBeta[j], l2_eps, False)
        cute.arch.sync_threads()
        # 4. the draft tokens' gated RMSNorms
        if const_expr(self.mode == "verify"):
            self.chunk_outputs(sO, sSig, nw, mY, c0, n_rep, total, b, h, tidx, norm_eps)

    @cute.jit
    def state_rows(self, st, mState, b, h, load: cutlass.Constexpr):
        """The head's state rows to (load) or from the registers st (kda_decode's row layout)."""
        gS = cute.zipped_divide(mState[b, h, None, None], (1, 4))
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        L = self.lanes_per_row
        if const_expr(load):
            st.fill(0.0)
        for s in cutlass.range_constexpr(self.n_pass):
            v = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or v < self.Dh:
                if const_expr(load):
                    st[None, s].store(gS[None, (v, lane % L)].load())
                else:
                    gS[None, (v, lane % L)].store(st[None, s].load())

    @cute.jit
    def window_operands(self, mConvW, mConvS, mALog, mDtBias, b, h, tidx):
        """This thread's conv items (kda_decode's item it = (i, c)): W weights (or dt_bias), W-1 window."""
        Dh, W = self.Dh, self.W
        wr = cute.make_rmem_tensor((W, self.n_it), Float32)
        orr = cute.make_rmem_tensor((W - 1, self.n_it), self.dtype)
        wr.fill(0.0)
        orr.fill(0.0)
        for it in cutlass.range_constexpr(self.n_it):
            tt = it * self.num_threads + tidx
            i, c = tt // Dh, tt % Dh
            ch = h * Dh + c
            if tt < 3 * Dh:
                w = mConvW[i, ch, None].load()
                for j in cutlass.range_constexpr(W):
                    wr[j, it] = w[j]
                for j in cutlass.range_constexpr(W - 1):
                    orr[j, it] = mConvS[b, i, ch, j]
            elif tt < 4 * Dh:
                wr[0, it] = mDtBias[ch].to(Float32)
        return wr, orr, mALog[h].to(Float32)

    @cute.jit
    def slot_value(self, mX, mCache, s, n_rep, b, col, at):
        """Slot s's input `col` (cache column `at`): the cache's below n_rep; above, the draft's
        (verify), stored to the cache."""
        if const_expr(self.mode != "verify"):
            return mCache[b, s, at]
        x = mCache.element_type(0.0)
        if s >= n_rep:
            x = mX[b, s - n_rep, col]
            mCache[b, s, at] = x
        else:
            x = mCache[b, s, at]
        return x

    @cute.jit
    def chunk_operands(self, mQ, mK, mV, mG, mBeta, mZ, mCache, sBeta, sSig, c0, n_rep, total, b, h, tidx):
        """Every live slot of the chunk: this thread's conv / gate inputs xr [n_it, CHUNK]; thread j < CHUNK
        puts sigmoid(beta) of slot c0 + j into sBeta[j]; (verify) sigmoid(z) of this thread's output
        channels of the draft slots into sSig (shared memory: no registers held over the token loop)."""
        Dh, CH = self.Dh, CHUNK
        C = mBeta.shape[2] * Dh                         # cache columns: q, k, v, g, z [C] each, beta [H]
        xr = cute.make_rmem_tensor((self.n_it, CH), self.dtype)
        xr.fill(0.0)
        for it in cutlass.range_constexpr(self.n_it):
            tt = it * self.num_threads + tidx
            i, ch = tt // Dh, h * Dh + tt % Dh
            if tt < 4 * Dh:
                for j in cutlass.range_constexpr(CH):
                    if c0 + j < total:
                        if i == 0:
                            xr[it, j] = self.slot_value(mQ, mCache, c0 + j, n_rep, b, ch, ch)
                        elif i == 1:
                            xr[it, j] = self.slot_value(mK, mCache, c0 + j, n_rep, b, ch, C + ch)
                        elif i == 2:
                            xr[it, j] = self.slot_value(mV, mCache, c0 + j, n_rep, b, ch, 2 * C + ch)
                        else:
                            xr[it, j] = self.slot_value(mG, mCache, c0 + j, n_rep, b, ch, 3 * C + ch)
        if const_expr(self.mode == "verify"):          # z: only the draft tokens have outputs
            for i in cutlass.range_constexpr(self.n_y):
                c = i * self.num_threads + tidx
                if c < Dh:
                    for j in cutlass.range_constexpr(CH):
                        if c0 + j < total and c0 + j >= n_rep:
                            z = self.slot_value(mZ, mCache, c0 + j, n_rep, b, h * Dh + c, 4 * C + h * Dh + c)
                            sSig[c, j] = _sigmoid(z.to(Float32))
        if tidx < CH:
            if c0 + tidx < total:
                sBeta[tidx] = _sigmoid(self.slot_value(mBeta, mCache, c0 + tidx, n_rep, b, h, 5 * C + h).to(Float32))
        return xr

    @cute.jit
    def chunk_convs(self, xr, wr, orr, a_log, sQKV, sAlpha, lower_bound, c0, total, h, tidx):
        """KdaVerify.slot_convs over the chunk's live slots: the window shifts in registers."""
        Dh, W = self.Dh, self.W
        a_h = cute.math.exp(a_log)
        for it in cutlass.range_constexpr(self.n_it):
            tt = it * self.num_threads + tidx
            i, c = tt // Dh, tt % Dh
            if tt < 3 * Dh:
                for j in cutlass.range_constexpr(CHUNK):
                    if c0 + j < total:
                        x = xr[it, j]
                        acc = x.to(Float32) * wr[W - 1, it]
                        for k in cutlass.range_constexpr(W - 1):
                            acc = acc + orr[k, it].to(Float32) * wr[k, it]
                        for k in cutlass.range_constexpr(W - 2):
                            orr[k, it] = orr[k + 1, it]
                        orr[W - 2, it] = x
                        y = acc * _sigmoid(acc)
                        sQKV[c, i, j] = y.to(self.dtype).to(Float32)
            elif tt < 4 * Dh:
                for j in cutlass.range_constexpr(CHUNK):
                    if c0 + j < total:
                        g = xr[it, j].to(Float32) + wr[0, it]
                        sAlpha[c, j] = cute.math.exp(lower_bound * _sigmoid(a_h * g))

    @cute.jit
    def cache_token_rows(self, st, sQKV, sAlpha, sO, beta, l2_eps, readout: cutlass.Constexpr):
        """KdaVerify.token_rows on the register state without the checkpoint store; the read-out o
        (rounded to wd, into sO) only where `readout` (a draft token)."""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        L = self.lanes_per_row
        cg = lane % L
        rk = cute.math.rsqrt(self.warp_sum_sq(sQKV, 1, lane) + l2_eps)
        rq = Float32(0.0)
        if const_expr(readout):
            rq = cute.math.rsqrt(self.warp_sum_sq(sQKV, 0, lane) + l2_eps) * self.scale
        qv = cute.make_rmem_tensor(4, Float32)
        kv = cute.make_rmem_tensor(4, Float32)
        av = cute.make_rmem_tensor(4, Float32)
        for e in cutlass.range_constexpr(4):
            qv[e] = sQKV[4 * cg + e, 0] * rq
            kv[e] = sQKV[4 * cg + e, 1] * rk
            av[e] = sAlpha[4 * cg + e]
        q, k, a = qv.load(), kv.load(), av.load()
        if const_expr(self.row_chunk > 1):
            C = self.row_chunk
            span = 32 // C
            r = lane // span
            for c0 in cutlass.range_constexpr(0, self.n_pass, C):
                sd = [st[None, c0 + i].load() * a for i in range(C)]
                ks = self.transpose_sum([(sd[i] * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                                         for i in range(C)], lane)
                v_r = (r + c0) * self.num_warps + warp
                u_r = (sQKV[v_r, 2] - ks) * beta
                part = []
                for i in cutlass.range_constexpr(C):
                    u = cute.arch.shuffle_sync(u_r, offset=i * span)
                    sn = sd[i] + k * u
                    st[None, c0 + i].store(sn)
                    if const_expr(readout):
                        part.append((sn * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                if const_expr(readout):
                    o = self.transpose_sum(part, lane)
                    if lane % span == 0:
                        sO[v_r] = o.to(self.dtype).to(Float32)
        else:
            for s in cutlass.range_constexpr(self.n_pass):
                v = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
                if const_expr(self.even) or v < self.Dh:
                    sd = st[None, s].load() * a
                    ks = (sd * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    ks = cute.arch.warp_reduction(ks, operator.add, threads_in_group=L)
                    u = (sQKV[v, 2] - ks) * beta
                    sn = sd + k * u
                    st[None, s].store(sn)
                    if const_expr(readout):
                        o = (sn * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        o = cute.arch.warp_reduction(o, operator.add, threads_in_group=L)
                        if cg == 0:
                            sO[v] = o.to(self.dtype).to(Float32)

    @cute.jit
    def chunk_outputs(self, sO, sSig, nw, mY, c0, n_rep, total, b, h, tidx, norm_eps):
        """KdaVerify's gated RMSNorm for the chunk's draft slots: y[b, s - n_rep]."""
        Dh, lane = self.Dh, cute.arch.lane_idx()
        for j in cutlass.range_constexpr(CHUNK):
            s = c0 + j
            if s < total and s >= n_rep:
                rstd = cute.math.rsqrt(self.warp_sum_sq(sO[None, j], None, lane) / Dh + norm_eps)
                for i in cutlass.range_constexpr(self.n_y):
                    c = i * self.num_threads + tidx
                    if c < Dh:
                        y = sO[c, j] * rstd * nw[i] * sSig[c, j]
                        mY[b, s - n_rep, h * Dh + c] = y.to(mY.element_type)

    @cute.jit
    def store_window(self, orr, mConvOut, b, h, tidx):
        """The conv window after the replay, this thread's items."""
        Dh = self.Dh
        for it in cutlass.range_constexpr(self.n_it):
            tt = it * self.num_threads + tidx
            if tt < 3 * Dh:
                for j in cutlass.range_constexpr(self.W - 1):
                    mConvOut[b, tt // Dh, h * Dh + tt % Dh, j] = orr[j, it]


@runtime.compile_cache("kda_verify_cache_step")
def _compile(mode: str, dtype: str, Dh: int, W: int, count_dtype: str, n_chunks: int, cfg: KdaVerifyConfig):
    """Compile against fake tensors: batch, heads, draft slots, window and cache slots dynamic (the cache
    slots up to n_chunks x CHUNK)."""
    op = KdaCacheStep(runtime.cutlass_dtype(dtype), Dh, W, mode, runtime.cutlass_dtype(count_dtype), n_chunks, cfg)
    _, cute_ = runtime.cutlass_modules()
    b, h, c, q, s = runtime.sym_int(), runtime.sym_int(), runtime.sym_int(Dh), runtime.sym_int(), runtime.sym_int()
    dt = runtime.cutlass_dtype(dtype)
    # the draft may be column slices of a merged in-projection: dynamic batch and slot strides
    act = lambda n: cute_.runtime.make_fake_tensor(dt, (b, q, n), (cute_.sym_int64(), cute_.sym_int64(), 1),
                                                   assumed_align=2)
    f32 = lambda shape, align=4: runtime.fake_tensor("float32", shape, align=align)
    i32 = lambda: runtime.fake_tensor("int32", (b,), align=4)
    conv = lambda: runtime.fake_tensor(dtype, (b, 3, c, W - 1), align=2)
    return runtime.compile_tvm_ffi(
        op, act(c), act(c), act(c), act(c), act(h), act(c), runtime.fake_tensor(count_dtype, (b,), align=4),
        runtime.fake_tensor(dtype, (b, s, runtime.sym_int()), align=2), i32(), i32(),
        f32((3, c, W), 16 if W % 4 == 0 else 4), f32((h,)), f32((c,)), f32((Dh,)), conv(), f32((b, h, Dh, Dh), 16),
        conv(), f32((b, h, Dh, Dh), 16), runtime.fake_tensor(dtype, (b, runtime.sym_int(), c), align=2),
        Float32(-5.0), Float32(1e-6), Float32(1e-5), Int32(6))
