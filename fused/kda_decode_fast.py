"""Experimental KDA decode step with a shorter per-head critical path (one CTA per (head, sequence)).

Where fused.kda_decode's small-batch time goes (read from its sm_90a PTX, Dh = 128, 16 warps):
- the 8 state-row loads per thread (64 KiB per CTA) are issued first and overlap the conv prologue;
- the update does 2 x 5 butterfly shuffles per state row (32 lanes own a row, 4 fp32 each): 1,280
  warp shuffles per head, and an SM retires one warp shuffle per clock, so ~0.7 us of the head's
  chain at T = 8, B = 1 is shuffle throughput (plus 240 for the redundant per-warp norms);
- the gated RMSNorm loads z and o_norm_w only after the second barrier: one more DRAM round trip
  (~0.5 us) at the end of the chain.

This kernel changes only where values live and when loads are issued, never an expression:
- `lanes_per_row` L in (8, 16, 32): a lane owns m = Dh / 4 / L chunks of 4 columns, chunks
  g + L*j (j < m) of its row. The default's 32-lane butterfly pairs chunk c with c + 16, then c + 8,
  ...; here the first log2(m) of those levels are register adds of the same operands (IEEE + is
  commutative) and the rest are the same butterfly over L lanes. Each chunk's 4-wide dot is the
  default's TensorSSA expression. So ks, o, the new state and y are the default kernel's bits, with
  2 log2(L) shuffles per row per L-lane group (192 per head at L = 8 instead of 1,280).
- z and o_norm_w are loaded at kernel entry with the state; sigmoid(z) is formed before the first
  barrier; y = ((o * rstd) * w) * sigmoid(z) in the default's order.
- `conv_first`: the conv / gate / beta operands are loaded before the state rows (which then queue
  behind them, not in front), the conv arithmetic runs after the state loads are issued.
Expected bitwise equal to fused.kda_decode in y, state and conv_state (the gpu test and
bench/bench_kda_fast.py check it). Not in `variants()` nor the default dispatch: reached through
fused.kda_decode.fast_variants / launch(variant=KdaFastConfig(...)).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from fused import runtime
from fused import kda_decode as base

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, const_expr  # noqa: E402


@dataclass(frozen=True)
class KdaFastConfig:
    """Launch variant: warps per CTA, lanes per state row (chunks per lane = Dh/4/lanes), whether
    the conv operands are loaded before the state rows."""
    num_warps: int = 16
    lanes_per_row: int = 8
    conv_first: bool = False

    @property
    def name(self) -> str:
        return f"f{self.lanes_per_row}w{self.num_warps}{'c' if self.conv_first else ''}"

    @staticmethod
    def all_configs() -> list["KdaFastConfig"]:
        return [KdaFastConfig(w, L, c) for w, L, c in
                ((16, 32, False), (32, 32, False), (16, 16, False), (8, 16, False),
                 (16, 8, False), (8, 8, False), (16, 8, True), (8, 16, True))]


class KdaDecodeFast(base.KdaDecode):
    """Compile-time config: working dtype, Dh, conv width W, warps, lanes per state row."""

    def __init__(self, dtype, Dh: int, W: int = 4, config: KdaFastConfig = KdaFastConfig()):
        super().__init__(dtype, Dh, W, base.KdaConfig(config.num_warps))
        if config.lanes_per_row not in (4, 8, 16, 32):
            raise ValueError(f"lanes_per_row: {config.lanes_per_row} not supported; use 8, 16 or 32")
        if config.num_warps not in (4, 8, 16, 32):
            raise ValueError(f"num_warps: {config.num_warps} not supported; use 8, 16 or 32")
        self.conv_first = config.conv_first
        self.lanes_per_row = min(config.lanes_per_row, Dh // 4)
        self.chunks = Dh // 4 // self.lanes_per_row      # 4-column chunks per lane
        self.rows_per_warp = 32 // self.lanes_per_row
        rows_per_pass = self.rows_per_warp * self.num_warps
        self.n_pass = -(-Dh // rows_per_pass)
        self.even = Dh % rows_per_pass == 0
        self.n_y = -(-Dh // self.num_threads)            # y channels per thread
        self.n_it = -(-4 * Dh // self.num_threads)       # conv / gate items per thread

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
               mBeta: cute.Tensor, mZ: cute.Tensor, mConvW: cute.Tensor, mConvS: cute.Tensor,
               mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
               mState: cute.Tensor, mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32,
               norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        Dh, L = self.Dh, self.lanes_per_row
        gS = cute.zipped_divide(mState[b, h, None, None], (1, 4))  # ((1,4), (V, Dh/4))
        smem = cutlass.memory.SmemAllocator()
        sQKV = smem.allocate_tensor(Float32, cute.make_layout((Dh, 3)), 16)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        xr = cute.make_rmem_tensor(self.n_it, self.dtype)          # conv_first operands
        wr = cute.make_rmem_tensor((self.W, self.n_it), Float32)
        oldr = cute.make_rmem_tensor((self.W - 1, self.n_it), self.dtype)
        if const_expr(self.conv_first):
            self.conv_loads(mQ, mK, mV, mG, mConvW, mConvS, mDtBias, xr, wr, oldr, b, h, tidx)
        a_log, beta_raw = mALog[h], mBeta[b, h]
        # 1. state rows (lane g of a row: chunks g + L*j), z and o_norm_w for the epilogue
        st = cute.make_rmem_tensor((4, self.chunks, self.n_pass), Float32)
        st.fill(0.0)
        for s in cutlass.range_constexpr(self.n_pass):
            v = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or v < Dh:
                for j in cutlass.range_constexpr(self.chunks):
                    st[None, j, s].store(gS[None, (v, lane % L + L * j)].load())
        zr = cute.make_rmem_tensor(self.n_y, mZ.element_type)
        nw = cute.make_rmem_tensor(self.n_y, Float32)
        zr.fill(0.0)
        nw.fill(0.0)
        for i in cutlass.range_constexpr(self.n_y):
            c = i * self.num_threads + tidx
            if c < Dh:
                zr[i] = mZ[b, h * Dh + c]
                nw[i] = mNormW[c].to(Float32)
        # 2. convs + SiLU -> sQKV, gate decay -> sAlpha (fused.kda_decode's arithmetic)
        if const_expr(self.conv_first):
            self.conv_math(mConvS, a_log, xr, wr, oldr, sQKV, sAlpha, lower_bound, b, h, tidx)
        else:
            self.conv_and_gate(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, sQKV, sAlpha,
                               lower_bound, b, h, tidx)
        beta = base._sigmoid(beta_raw.to(Float32))
        sig = cute.make_rmem_tensor(self.n_y, Float32)
        for i in cutlass.range_constexpr(self.n_y):
            sig[i] = base._sigmoid(zr[i].to(Float32))
        cute.arch.sync_threads()
        self.update_chunks(st, gS, sQKV, sAlpha, sO, beta, l2_eps, warp, lane)
        cute.arch.sync_threads()
        # 5. gated RMSNorm: y = o * rsqrt(mean o^2 + eps) * w * sigmoid(z)
        rstd = cute.math.rsqrt(self.warp_sum_sq(sO, None, lane) / Dh + norm_eps)
        for i in cutlass.range_constexpr(self.n_y):
            c = i * self.num_threads + tidx
            if c < Dh:
                y = sO[c] * rstd * nw[i] * sig[i]
                mY[b, h * Dh + c] = y.to(mY.element_type)

    @cute.jit
    def update_chunks(self, st, gS, sQKV, sAlpha, sO, beta, l2_eps, warp, lane):
        """3. l2 norms of q, k (every warp); 4. per state row: decay, delta rule, rank-1 write,
        read-out o into sO; dots as the default's 32-lane butterfly (see the module docstring)."""
        L, m = self.lanes_per_row, self.chunks
        g = lane % L
        rq = cute.math.rsqrt(self.warp_sum_sq(sQKV, 0, lane) + l2_eps) * self.scale
        rk = cute.math.rsqrt(self.warp_sum_sq(sQKV, 1, lane) + l2_eps)
        qv = cute.make_rmem_tensor((4, m), Float32)
        kv = cute.make_rmem_tensor((4, m), Float32)
        av = cute.make_rmem_tensor((4, m), Float32)
        for j in cutlass.range_constexpr(m):
            for e in cutlass.range_constexpr(4):
                c = 4 * (g + L * j) + e
                qv[e, j] = sQKV[c, 0] * rq
                kv[e, j] = sQKV[c, 1] * rk
                av[e, j] = sAlpha[c]
        for s in cutlass.range_constexpr(self.n_pass):
            r = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or r < self.Dh:
                sd, pk = [], []
                for j in cutlass.range_constexpr(m):
                    sd.append(st[None, j, s].load() * av[None, j].load())
                    pk.append((sd[j] * kv[None, j].load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                ks = cute.arch.warp_reduction(self.chunk_sum(pk), operator.add, threads_in_group=L)
                u = (sQKV[r, 2] - ks) * beta
                po = []
                for j in cutlass.range_constexpr(m):
                    sn = sd[j] + kv[None, j].load() * u
                    gS[None, (r, g + L * j)].store(sn)
                    po.append((sn * qv[None, j].load()).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
                o = cute.arch.warp_reduction(self.chunk_sum(po), operator.add, threads_in_group=L)
                if g == 0:
                    sO[r] = o.to(self.dtype).to(Float32)

    def chunk_sum(self, parts: list):
        """The default butterfly's first log2(m) levels in registers: pair j with j + m/2."""
        while len(parts) > 1:
            half = len(parts) // 2
            parts = [parts[j] + parts[j + half] for j in range(half)]
        return parts[0]

    @cute.jit
    def conv_loads(self, mQ, mK, mV, mG, mConvW, mConvS, mDtBias, xr, wr, oldr, b, h, tidx):
        """Every operand of conv_math, into registers (item t: as fused.kda_decode.conv_and_gate)."""
        Dh, W = self.Dh, self.W
        for it in cutlass.range_constexpr(self.n_it):
            t = it * self.num_threads + tidx
            i, c = t // Dh, t % Dh
            ch = h * Dh + c
            if t < 3 * Dh:
                x = mQ[b, ch]
                if i == 1:
                    x = mK[b, ch]
                if i == 2:
                    x = mV[b, ch]
                xr[it] = x
                wr[None, it].store(mConvW[i, ch, None].load())
                for j in cutlass.range_constexpr(W - 1):
                    oldr[j, it] = mConvS[b, i, ch, j]
            elif t < 4 * Dh:
                xr[it] = mG[b, ch]
                wr[0, it] = mDtBias[ch].to(Float32)

    @cute.jit
    def conv_math(self, mConvS, a_log, xr, wr, oldr, sQKV, sAlpha, lower_bound, b, h, tidx):
        """fused.kda_decode.conv_and_gate's arithmetic and conv-state shift on loaded operands."""
        Dh, W = self.Dh, self.W
        a_h = cute.math.exp(a_log.to(Float32))
        for it in cutlass.range_constexpr(self.n_it):
            t = it * self.num_threads + tidx
            i, c = t // Dh, t % Dh
            ch = h * Dh + c
            if t < 3 * Dh:
                acc = xr[it].to(Float32) * wr[W - 1, it]
                for j in cutlass.range_constexpr(W - 1):
                    acc = acc + oldr[j, it].to(Float32) * wr[j, it]
                    if const_expr(j > 0):
                        mConvS[b, i, ch, j - 1] = oldr[j, it]
                mConvS[b, i, ch, W - 2] = xr[it]
                y = acc * base._sigmoid(acc)
                sQKV[c, i] = y.to(self.dtype).to(Float32)
            elif t < 4 * Dh:
                g = xr[it].to(Float32) + wr[0, it]
                sAlpha[c] = cute.math.exp(lower_bound * base._sigmoid(a_h * g))


@runtime.compile_cache("kda_decode_fast")
def _compile(dtype: str, Dh: int, W: int, cfg: KdaFastConfig):
    return base.compile_op(KdaDecodeFast(runtime.cutlass_dtype(dtype), Dh, W, cfg), dtype, Dh, W)


def launch(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state, y, lower_bound: float, l2_eps: float, norm_eps: float,
           variant: KdaFastConfig = KdaFastConfig()):
    """Destination-passing launch on the current stream: writes y, updates conv_state, state."""
    if not isinstance(variant, KdaFastConfig):
        raise TypeError(f"variant: expected a KdaFastConfig, got {variant!r}")
    if state.shape[0] == 0:
        return
    Dh, W = state.shape[-1], conv_w.shape[-1]
    fn = _compile(runtime.dtype_name(q_raw.dtype), Dh, W, variant)
    fn(*(base._rows(t) for t in (q_raw, k_raw, v_raw, g_raw, beta_raw, z)), conv_w.contiguous(),
       conv_state, A_log.contiguous(), dt_bias.contiguous(), o_norm_w.contiguous(), state, y,
       lower_bound, l2_eps, norm_eps)
