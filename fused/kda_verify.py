"""Fused KDA verify step for speculative decoding, in one launch: `references.kda_spec.kda_verify`'s
math with per-token checkpoints (the rollback design of references/kda_spec.py).

Each sequence b runs its n_tokens[b] draft tokens one after another from the committed state; token
t is one `fused.kda_decode` step (convs + SiLU, q/k L2 norms, lower-bound gate, beta, gated delta
rule on the fp32 state, read-out o rounded to the working dtype, gated RMSNorm x sigmoid(z)). Token
t's output goes to y[b, t], the state after it to state_ckpt[b, t] and the conv window after it to
conv_ckpt[b, t]. Slots t >= n_tokens[b] get y = 0 and their checkpoints are not written. The committed
conv_state and state are only read; `kda_accept` commits.

Layout (B sequences, n_q draft slots, C = H*Dh): q_raw, k_raw, v_raw, g_raw, z [B, n_q, C] and
beta_raw [B, n_q, H] in the working dtype (unit stride on the last dim, any other strides);
n_tokens [B] int32 or int64; conv_w [3, C, W], A_log [H], dt_bias [C], o_norm_w [Dh] fp32;
conv_state [B, 3, C, W-1] wd and state [B, H, Dh, Dh] fp32 (read); conv_ckpt [B, n_q, 3, C, W-1] wd,
state_ckpt [B, n_q, H, Dh, Dh] fp32 and y [B, n_q, C] wd (written; the checkpoints contiguous).
One compile per (dtype, Dh, W, n_q, count dtype, variant); batch and head count are dynamic.

Launch: one CTA per (head, sequence), grid (H, B), as kda_decode's one-CTA kernel; the counts are
read on the device (n = clamp(n_tokens[b], 0, n_q): the reference's result for validate=False, and
no write outside the tensors whatever the counts hold). Three phases, two barriers in all:
  1. at entry every load is issued: the head's state rows into registers (a group of Dh/4 lanes owns
     one row, 4 fp32 per lane, as in kda_decode), then the conv, gate, beta and norm operands of all
     n_q slots. The convs and gates of all slots are computed (they do not depend on the state): each
     conv channel keeps its W-1 window in registers and shifts it token by token, writing
     conv_ckpt[b, t] for t < n; the wd-rounded conv outputs, decays and betas go to shared memory.
  2. the recurrence, a device loop over t < n with the state in registers (read from HBM once):
     per token the q/k L2 norms (every warp redundantly), then per state row decay, delta rule,
     rank-1 write, state row stored to state_ckpt[b, t], read-out o (rounded to wd) into shared
     memory. A state row's update needs only its own row, so the tokens need no barrier between them.
  3. the gated RMSNorm of every slot's read-out: y[b, t] for t < n, zeros for the others.
Per token the arithmetic is kda_decode's, operation for operation (same rounding points: the conv
outputs, o and y in the working dtype, the rest in fp32), but not always its bits: the token loop
and the register-resident state let the compiler contract and order the row sums differently, so a
checkpoint after several tokens, or another variant's, may differ from kda_decode's in the last fp32
ulps (measured on the H200). The op is certified against the reference by its spec
(tolerance_specs/kda_verify.toml): y and the state checkpoints by the derived class, the conv
checkpoints bitwise. Determinism holds per variant: the same inputs give the same bits.
The wrapper's validate=True (the default, as in the reference) checks the counts on the host (one
sync) outside CUDA graph capture; validate=False, or a capture, reads no tensor value on the host, so
a CUDA graph can hold the step.
Variants (`KdaVerifyConfig`): warps per CTA 4 / 8 / 16 and row_chunk (Dh = 128, kda_decode's
transposed row reductions, another summation order); every variant is certified. The dispatcher's
picks (`for_shape`): more warps where there are few heads to fill the SMs; the GPU timing test
prints every variant at the K3 shapes.

`kda_accept` (fused/kda_verify_accept.py, re-exported here) commits the checkpoint of token a-1 by
one copy launch with the counts read on the device: the reference's torch gather + select + copy
moves about 3.5x the bytes of that copy.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from fused import runtime
from fused.kda_decode import KdaConfig, KdaDecode, _sigmoid
from fused.kda_verify_accept import capturing, kda_accept  # noqa: F401  (the commit half, re-exported)
from references.kda_spec import COUNT_DTYPES, check_verify_counts
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, Int32, const_expr  # noqa: E402

WD_DTYPES = (torch.bfloat16, torch.float16)
DTYPES = ("bfloat16", "float16")   # working dtypes (the harness draws only these; the state is fp32)
MAX_SLOTS = 8                      # draft slots per sequence (n_q) the kernel compiles for


@dataclass(frozen=True)
class KdaVerifyConfig:
    """Launch variant: warps per CTA (one CTA per head of one sequence) and the rows per transposed
    warp reduction (kda_decode's row_chunk; only at Dh = 128, else per-row butterflies)."""
    num_warps: int = 8
    row_chunk: int = 1

    @property
    def name(self) -> str:
        return f"w{self.num_warps}" + (f"r{self.row_chunk}" if self.row_chunk > 1 else "")

    @staticmethod
    def all_configs() -> list["KdaVerifyConfig"]:
        """Every launch the dispatcher can pick, and the other layouts (each certified)."""
        return [KdaVerifyConfig(4), KdaVerifyConfig(8), KdaVerifyConfig(16), KdaVerifyConfig(8, 8),
                KdaVerifyConfig(16, 8)]

    @staticmethod
    def for_shape(Dh: int, n_heads_total: int = 0, sms: int = 132) -> "KdaVerifyConfig":
        """Untimed (the GPU timing test prints every variant). Dh = 128, n_q = 8, by ptxas for sm_90a:
        w16r8 123 registers (one CTA per SM), w8 128 (two), w4 217 (two), w8r8 170 (one). Up to one
        CTA per SM: 16 warps with 8-row transposed reductions (the most rows in flight per head and
        the fewest shuffles on the token chain); beyond, 8 warps, two CTAs per SM. Dh < 128: 4 warps."""
        if Dh < 128:
            return KdaVerifyConfig(4)
        if n_heads_total <= sms:
            return KdaVerifyConfig(16, 8)
        return KdaVerifyConfig(8)


class KdaVerify(KdaDecode):
    """Compile-time config: working dtype, Dh, W, draft slots n_q, count dtype, variant. Inherits
    kda_decode's thread layout and its reductions (warp_sum_sq, transpose_sum)."""

    def __init__(self, dtype, Dh: int, W: int, n_q: int, count_dtype, config: KdaVerifyConfig = KdaVerifyConfig()):
        if not 1 <= n_q <= MAX_SLOTS:
            raise ValueError(f"n_q: {n_q} draft slots; the kernel takes 1..{MAX_SLOTS}")
        super().__init__(dtype, Dh, W, KdaConfig(config.num_warps, True, row_chunk=config.row_chunk))
        self.n_q, self.count_dtype = n_q, count_dtype

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                 mBeta: cute.Tensor, mZ: cute.Tensor, mNTok: cute.Tensor, mConvW: cute.Tensor,
                 mConvS: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
                 mState: cute.Tensor, mConvCk: cute.Tensor, mStateCk: cute.Tensor, mY: cute.Tensor,
                 lower_bound: Float32, l2_eps: Float32, norm_eps: Float32, stream):
        self.verify_kernel(mQ, mK, mV, mG, mBeta, mZ, mNTok, mConvW, mConvS, mALog, mDtBias, mNormW,
                           mState, mConvCk, mStateCk, mY, lower_bound, l2_eps, norm_eps).launch(
            grid=[mState.shape[1], mState.shape[0], 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def verify_kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                      mBeta: cute.Tensor, mZ: cute.Tensor, mNTok: cute.Tensor, mConvW: cute.Tensor,
                      mConvS: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
                      mState: cute.Tensor, mConvCk: cute.Tensor, mStateCk: cute.Tensor, mY: cute.Tensor,
                      lower_bound: Float32, l2_eps: Float32, norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        Dh, L, NQ = self.Dh, self.lanes_per_row, self.n_q
        cnt = mNTok[b]                                   # clamped in its own dtype, then narrowed
        n = Int32(cutlass.min(cutlass.max(cnt, self.count_dtype(0)), self.count_dtype(NQ)))
        # 1. state rows first (the bytes), then every slot's operands
        gS = cute.zipped_divide(mState[b, h, None, None], (1, 4))
        st = cute.make_rmem_tensor((4, self.n_pass), Float32)
        st.fill(0.0)
        for s in cutlass.range_constexpr(self.n_pass):
            v = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or v < Dh:
                st[None, s].store(gS[None, (v, lane % L)].load())
        zr, nw = self.slot_norm_operands(mZ, mNormW, b, h, tidx)
        xr, wr, orr, a_log = self.slot_conv_operands(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, b, h, tidx)
        smem = cutlass.memory.SmemAllocator()
        sQKV = smem.allocate_tensor(Float32, cute.make_layout((Dh, 3, NQ), stride=(1, Dh, 3 * Dh)), 16)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout((Dh, NQ), stride=(1, Dh)), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout((Dh, NQ), stride=(1, Dh)), 16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout(NQ), 16)
        if tidx < NQ:
            sBeta[tidx] = _sigmoid(mBeta[b, tidx, h].to(Float32))
        self.slot_convs(xr, wr, orr, a_log, mConvCk, sQKV, sAlpha, lower_bound, n, b, h, tidx)
        sig = cute.make_rmem_tensor((self.n_y, NQ), Float32)
        for t in cutlass.range_constexpr(NQ):
            for i in cutlass.range_constexpr(self.n_y):
                sig[i, t] = _sigmoid(zr[i, t].to(Float32))
        cute.arch.sync_threads()
        # 2. the recurrence over the live tokens, the state in registers
        for t in cutlass.range(n, unroll=1):
            gC = cute.zipped_divide(mStateCk[b, t, h, None, None], (1, 4))
            self.token_rows(st, gC, sQKV[None, None, t], sAlpha[None, t], sO[None, t], sBeta[t], l2_eps, warp, lane)
        cute.arch.sync_threads()
        # 3. every slot's gated RMSNorm (zeros past n)
        for t in cutlass.range_constexpr(NQ):
            live = t < n
            rstd = Float32(0.0)
            if live:
                rstd = cute.math.rsqrt(self.warp_sum_sq(sO[None, t], None, lane) / Dh + norm_eps)
            for i in cutlass.range_constexpr(self.n_y):
                c = i * self.num_threads + tidx
                if c < Dh:
                    y = Float32(0.0)
                    if live:
                        y = sO[c, t] * rstd * nw[i] * sig[i, t]
                    mY[b, t, h * Dh + c] = y.to(mY.element_type)

    @cute.jit
    def token_rows(self, st, gC, sQKV, sAlpha, sO, beta, l2_eps, warp, lane):
        """One token on the register state: kda_decode's update_rows (and update_row_chunks) with the
        new row kept in `st` and stored to the token's checkpoint gC."""
        L = self.lanes_per_row
        cg = lane % L
        rq = cute.math.rsqrt(self.warp_sum_sq(sQKV, 0, lane) + l2_eps) * self.scale
        rk = cute.math.rsqrt(self.warp_sum_sq(sQKV, 1, lane) + l2_eps)
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
                    gC[None, ((c0 + i) * self.num_warps + warp, lane)].store(sn)
                    part.append((sn * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
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
                    gC[None, (v, cg)].store(sn)
                    o = (sn * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    o = cute.arch.warp_reduction(o, operator.add, threads_in_group=L)
                    if cg == 0:
                        sO[v] = o.to(self.dtype).to(Float32)

    @cute.jit
    def slot_norm_operands(self, mZ, mNormW, b, h, tidx):
        """This thread's z of every slot and o_norm_w channels (c = tidx + i * threads)."""
        zr = cute.make_rmem_tensor((self.n_y, self.n_q), mZ.element_type)
        nw = cute.make_rmem_tensor(self.n_y, Float32)
        zr.fill(0.0)
        nw.fill(0.0)
        for i in cutlass.range_constexpr(self.n_y):
            c = i * self.num_threads + tidx
            if c < self.Dh:
                nw[i] = mNormW[c].to(Float32)
                for t in cutlass.range_constexpr(self.n_q):
                    zr[i, t] = mZ[b, t, h * self.Dh + c]
        return zr, nw

    @cute.jit
    def slot_conv_operands(self, mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, b, h, tidx):
        """kda_decode's conv_operands for every slot: item it = (i, c) as there, its input of each slot
        xr[it, t], its W weights (or dt_bias), its W-1 committed conv-state values."""
        Dh, W, NQ = self.Dh, self.W, self.n_q
        xr = cute.make_rmem_tensor((self.n_it, NQ), self.dtype)
        wr = cute.make_rmem_tensor((W, self.n_it), Float32)
        orr = cute.make_rmem_tensor((W - 1, self.n_it), self.dtype)
        xr.fill(0.0)
        wr.fill(0.0)
        orr.fill(0.0)
        a_log = mALog[h].to(Float32)
        for it in cutlass.range_constexpr(self.n_it):
            tt = it * self.num_threads + tidx
            i, c = tt // Dh, tt % Dh
            ch = h * Dh + c
            if tt < 3 * Dh:
                for t in cutlass.range_constexpr(NQ):
                    x = mQ[b, t, ch]
                    if i == 1:
                        x = mK[b, t, ch]
                    if i == 2:
                        x = mV[b, t, ch]
                    xr[it, t] = x
                w = mConvW[i, ch, None].load()
                for j in cutlass.range_constexpr(W):
                    wr[j, it] = w[j]
                for j in cutlass.range_constexpr(W - 1):
                    orr[j, it] = mConvS[b, i, ch, j]
            elif tt < 4 * Dh:
                for t in cutlass.range_constexpr(NQ):
                    xr[it, t] = mG[b, t, ch]
                wr[0, it] = mDtBias[ch].to(Float32)
        return xr, wr, orr, a_log

    @cute.jit
    def slot_convs(self, xr, wr, orr, a_log, mConvCk, sQKV, sAlpha, lower_bound, n, b, h, tidx):
        """kda_decode's conv_from_registers, token after token over the slots: the window shifts in
        registers and is stored to conv_ckpt[b, t] for the live tokens t < n."""
        Dh, W = self.Dh, self.W
        a_h = cute.math.exp(a_log)
        for it in cutlass.range_constexpr(self.n_it):
            tt = it * self.num_threads + tidx
            i, c = tt // Dh, tt % Dh
            ch = h * Dh + c
            if tt < 3 * Dh:
                for t in cutlass.range_constexpr(self.n_q):
                    x = xr[it, t]
                    acc = x.to(Float32) * wr[W - 1, it]
                    for j in cutlass.range_constexpr(W - 1):
                        acc = acc + orr[j, it].to(Float32) * wr[j, it]
                    for j in cutlass.range_constexpr(W - 2):
                        orr[j, it] = orr[j + 1, it]
                    orr[W - 2, it] = x
                    if t < n:
                        for j in cutlass.range_constexpr(W - 1):
                            mConvCk[b, t, i, ch, j] = orr[j, it]
                    y = acc * _sigmoid(acc)
                    sQKV[c, i, t] = y.to(self.dtype).to(Float32)
            elif tt < 4 * Dh:
                for t in cutlass.range_constexpr(self.n_q):
                    g = xr[it, t].to(Float32) + wr[0, it]
                    sAlpha[c, t] = cute.math.exp(lower_bound * _sigmoid(a_h * g))


@runtime.compile_cache("kda_verify")
def _compile(dtype: str, Dh: int, W: int, n_q: int, count_dtype: str, cfg: KdaVerifyConfig):
    """Compile against fake tensors: batch and head count dynamic, n_q static."""
    op = KdaVerify(runtime.cutlass_dtype(dtype), Dh, W, n_q, runtime.cutlass_dtype(count_dtype), cfg)
    _, cute_ = runtime.cutlass_modules()
    b, h, c = runtime.sym_int(), runtime.sym_int(), runtime.sym_int(Dh)
    dt = runtime.cutlass_dtype(dtype)
    # activations may be column slices of a merged in-projection: dynamic batch and slot strides
    act = lambda n: cute_.runtime.make_fake_tensor(dt, (b, n_q, n), (cute_.sym_int64(), cute_.sym_int64(), 1),
                                                   assumed_align=2)
    f32 = lambda shape, align=4: runtime.fake_tensor("float32", shape, align=align)
    return runtime.compile_tvm_ffi(
        op, act(c), act(c), act(c), act(c), act(h), act(c), runtime.fake_tensor(count_dtype, (b,), align=4),
        f32((3, c, W), 16 if W % 4 == 0 else 4), runtime.fake_tensor(dtype, (b, 3, c, W - 1), align=2),
        f32((h,)), f32((c,)), f32((Dh,)), f32((b, h, Dh, Dh), 16),
        runtime.fake_tensor(dtype, (b, n_q, 3, c, W - 1), align=2), f32((b, n_q, h, Dh, Dh), 16),
        runtime.fake_tensor(dtype, (b, n_q, c), align=2), Float32(-5.0), Float32(1e-6), Float32(1e-5))


def _check(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state, conv_ckpt, state_ckpt, lower_bound) -> None:
    check_tensor("state", state, ndim=4, dtypes=(torch.float32,))
    B, H, Dh, _ = state.shape
    check_tensor("state", state, shape=(B, H, Dh, Dh))
    check_tensor("q_raw", q_raw, ndim=3, dtypes=WD_DTYPES)
    n_q = q_raw.shape[1]
    if not 1 <= n_q <= MAX_SLOTS:
        raise ValueError(f"q_raw: {n_q} draft slots (dim 1 of {tuple(q_raw.shape)}); the kernel takes 1..{MAX_SLOTS}")
    C = H * Dh
    for name, t in (("q_raw", q_raw), ("k_raw", k_raw), ("v_raw", v_raw), ("g_raw", g_raw), ("z", z)):
        check_tensor(name, t, shape=(B, n_q, C), dtypes=(q_raw.dtype,))
    check_tensor("beta_raw", beta_raw, shape=(B, n_q, H), dtypes=(q_raw.dtype,))
    check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("conv_w", conv_w, ndim=3, dtypes=(torch.float32,))
    W = conv_w.shape[-1]
    check_tensor("conv_w", conv_w, shape=(3, C, W))
    check_tensor("conv_state", conv_state, shape=(B, 3, C, W - 1), dtypes=(q_raw.dtype,))
    check_tensor("A_log", A_log, shape=(H,), dtypes=(torch.float32,))
    check_tensor("dt_bias", dt_bias, shape=(C,), dtypes=(torch.float32,))
    check_tensor("o_norm_w", o_norm_w, shape=(Dh,), dtypes=(torch.float32,))
    check_tensor("conv_ckpt", conv_ckpt, shape=(B, n_q, 3, C, W - 1), dtypes=(q_raw.dtype,))
    check_tensor("state_ckpt", state_ckpt, shape=(B, n_q, H, Dh, Dh), dtypes=(torch.float32,))
    if Dh not in (16, 32, 64, 128) or W < 2:
        raise ValueError(f"state: head_dim {Dh} / conv_w: width {W}; the kernel takes Dh in "
                         "16, 32, 64, 128 and W >= 2")
    for name, t in (("conv_ckpt", conv_ckpt), ("state_ckpt", state_ckpt)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: written in place, so it must be contiguous; got strides {t.stride()}")
    if not lower_bound < 0:
        raise ValueError(f"lower_bound: expected a negative float (K3: -5.0), got {lower_bound!r}")


def _check_device(state, **tensors) -> None:
    runtime.require_cuda("state", state)
    for name, t in tensors.items():
        if t.device != state.device:
            raise ValueError(f"{name}: on {t.device}, state on {state.device}; every tensor on one device")


def _last_unit(t):
    """An activation the kernel can read: unit stride on the last dim, any other strides."""
    return t if t.stride(-1) == 1 else t.contiguous()


def launch(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state, conv_ckpt, state_ckpt, y, lower_bound: float, l2_eps: float, norm_eps: float,
           variant: KdaVerifyConfig | None = None):
    """Destination-passing launch on the current stream: writes y, conv_ckpt and state_ckpt."""
    if state.shape[0] == 0 or state.shape[1] == 0:
        return
    B, H, Dh = state.shape[:3]
    W, n_q = conv_w.shape[-1], q_raw.shape[1]
    cfg = variant or KdaVerifyConfig.for_shape(Dh, B * H, runtime.sm_count(state.device))
    fn = _compile(runtime.dtype_name(q_raw.dtype), Dh, W, n_q, runtime.dtype_name(n_tokens.dtype), cfg)
    # state and the state checkpoints are 16-byte row vectors: a misaligned base goes through a copy
    sck = runtime.aligned(state_ckpt)
    fn(*(_last_unit(t) for t in (q_raw, k_raw, v_raw, g_raw, beta_raw, z)), n_tokens.contiguous(),
       runtime.aligned(conv_w.contiguous(), 16 if W % 4 == 0 else 4), conv_state.contiguous(),
       A_log.contiguous(), dt_bias.contiguous(), o_norm_w.contiguous(), runtime.aligned(state.contiguous()),
       conv_ckpt, sck, y, lower_bound, l2_eps, norm_eps)
    runtime.write_back(sck, state_ckpt)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("kda_verify", mutates_args=("conv_ckpt", "state_ckpt", "y"))
        def kda_verify_out(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
                           beta_raw: torch.Tensor, z: torch.Tensor, n_tokens: torch.Tensor, conv_w: torch.Tensor,
                           conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                           o_norm_w: torch.Tensor, state: torch.Tensor, conv_ckpt: torch.Tensor,
                           state_ckpt: torch.Tensor, y: torch.Tensor, lower_bound: float, l2_eps: float,
                           norm_eps: float) -> None:
            launch(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias,
                   o_norm_w, state, conv_ckpt, state_ckpt, y, lower_bound, l2_eps, norm_eps)

        _op = kda_verify_out
    return _op


def kda_verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
               state, conv_ckpt, state_ckpt, lower_bound: float, l2_eps: float, norm_eps: float,
               validate: bool = True, *, variant: KdaVerifyConfig | None = None):
    """Fused replacement of references.kda_spec.kda_verify (same signature) -> y [B, n_q, C]; writes
    conv_ckpt[b, t] and state_ckpt[b, t] for t < n_tokens[b]. validate=True checks the counts on the
    host as the reference does (one sync), except while the stream is being captured into a CUDA
    graph, where no host read is possible; validate=False reads no tensor value on the host. Either
    way the kernel clamps each count to 0..n_q."""
    _check(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state, conv_ckpt, state_ckpt, lower_bound)
    if validate and not capturing():
        check_verify_counts(n_tokens, q_raw.shape[1])
    _check_device(state, q_raw=q_raw, k_raw=k_raw, v_raw=v_raw, g_raw=g_raw, beta_raw=beta_raw, z=z,
                  n_tokens=n_tokens, conv_w=conv_w, conv_state=conv_state, A_log=A_log, dt_bias=dt_bias,
                  o_norm_w=o_norm_w, conv_ckpt=conv_ckpt, state_ckpt=state_ckpt)
    y = torch.empty(q_raw.shape, dtype=q_raw.dtype, device=q_raw.device)
    args = (q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
            state, conv_ckpt, state_ckpt, y, float(lower_bound), float(l2_eps), float(norm_eps))
    if variant is not None:
        launch(*args, variant=variant)
    else:
        _custom_op()(*args)
    return y


def variants(tensors: dict, params: dict) -> list[KdaVerifyConfig]:
    """Every launch variant the harness must certify for these inputs."""
    return KdaVerifyConfig.all_configs()
