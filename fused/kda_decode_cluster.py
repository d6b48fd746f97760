"""Experimental KDA decode step: one (sequence, head) split over a cluster of C CTAs (C = 2, 4, 8).

The delta rule is separable over the value rows v of the state, so CTA rank r of the cluster owns
rows [r*Dh/C, (r+1)*Dh/C) of S[b, h]: it reads and writes only those (64 KiB / C), and only the
v channels of those rows. Every CTA recomputes the shared per-head inputs (q and k convs, their L2
norms, the gate, beta) with the code and summation order of fused.kda_decode, so they are bitwise
identical across the cluster. Per row the work is fused.kda_decode's (same lanes, same 4-wide
partial dots, same butterflies), so state and o should be bitwise the one-CTA kernel's (same
expressions; not yet run on a GPU: the gpu tests and bench/bench_kda_cluster.py check it).
Grid [C, H, B] with cluster [C, 1, 1]: B and H <= 65535.

Cross-CTA steps, both through distributed shared memory and cluster barriers:
- RMSNorm: every warp reads all Dh rounded o values from their owners' smem and sums o^2 in
  fused.kda_decode's order (lane-strided, then the warp butterfly); the rstd is therefore bitwise
  the one-CTA kernel's in every CTA, whatever the timing.
- conv_state: every CTA reads the q and k conv windows of all channels, so the owner of channel c
  (c // (Dh/C)) writes its new q and k windows only after the first cluster barrier; the v window
  of channel c is read only by its owner and written at once. Each element is written once.
Not in `variants()` or the default dispatch: reached through fused.kda_decode.experimental_variants.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from fused import runtime
from fused import kda_decode as base

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, const_expr  # noqa: E402


@dataclass(frozen=True)
class KdaClusterConfig:
    """Launch variant: CTAs per (sequence, head) (a cluster splitting the state rows), warps per CTA."""
    cluster_n: int = 8
    num_warps: int = 16

    @property
    def name(self) -> str:
        return f"c{self.cluster_n}w{self.num_warps}"

    @staticmethod
    def all_configs() -> list["KdaClusterConfig"]:
        return [KdaClusterConfig(c, w) for c, w in ((2, 8), (2, 16), (4, 8), (4, 16), (8, 8), (8, 16))]


class KdaDecodeCluster(base.KdaDecode):
    """Compile-time config: working dtype, Dh, conv width W, CTAs per head, warps per CTA."""

    def __init__(self, dtype, Dh: int, W: int = 4, config: KdaClusterConfig = KdaClusterConfig()):
        super().__init__(dtype, Dh, W, base.KdaConfig(config.num_warps))
        C = config.cluster_n
        if C not in (2, 4, 8) or Dh % C != 0:
            raise ValueError(f"cluster_n: {C} not supported at head_dim {Dh}; use 2, 4 or 8")
        self.cluster_n, self.rows = C, Dh // C           # state rows owned by one CTA
        rows_per_pass = self.rows_per_warp * self.num_warps
        self.n_pass = -(-self.rows // rows_per_pass)
        self.even = self.rows % rows_per_pass == 0
        self.n_conv = -(-(3 * Dh + self.rows) // self.num_threads)   # q, k, own v, gate items

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                 mBeta: cute.Tensor, mZ: cute.Tensor, mConvW: cute.Tensor, mConvS: cute.Tensor,
                 mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
                 mState: cute.Tensor, mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32,
                 norm_eps: Float32, stream):
        self.kernel(mQ, mK, mV, mG, mBeta, mZ, mConvW, mConvS, mALog, mDtBias, mNormW, mState,
                    mY, lower_bound, l2_eps, norm_eps).launch(
            grid=[self.cluster_n, mState.shape[1], mState.shape[0]],
            block=[self.num_threads, 1, 1], cluster=[self.cluster_n, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
               mBeta: cute.Tensor, mZ: cute.Tensor, mConvW: cute.Tensor, mConvS: cute.Tensor,
               mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
               mState: cute.Tensor, mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32,
               norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        rank, h, b = cute.arch.block_idx()               # rank = block index in the cluster
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        Dh, L, R = self.Dh, self.lanes_per_row, self.rows
        v0 = rank * R                                    # first state row of this CTA
        cg = lane % L
        gS = cute.zipped_divide(mState[b, h, None, None], (1, 4))
        # 1. this CTA's state rows first
        st = cute.make_rmem_tensor((4, self.n_pass), Float32)
        st.fill(0.0)
        for s in cutlass.range_constexpr(self.n_pass):
            vl = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or vl < R:
                st[None, s].store(gS[None, (v0 + vl, cg)].load())
        # 2. convs (q, k all channels; v own rows), gate; new q/k windows of owned channels kept
        smem = cutlass.memory.SmemAllocator()
        sQKV = smem.allocate_tensor(Float32, cute.make_layout((Dh, 3)), 16)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)   # read by the cluster
        keep = cute.make_rmem_tensor((self.W - 1, self.n_conv), self.dtype)
        self.conv_and_gate_rows(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, sQKV, sAlpha,
                                keep, lower_bound, b, h, rank, tidx)
        beta = base._sigmoid(mBeta[b, h].to(Float32))
        cute.arch.sync_threads()
        # 3-4. l2 norms (bitwise the same in every CTA) and this CTA's rows: fused.kda_decode's code
        self.update_rows(st, gS, sQKV, sAlpha, sO, beta, l2_eps, warp, lane, v0)
        # every CTA's o rows are in its smem, every conv window of the cluster has been read
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        self.write_qk_windows(mConvS, keep, b, h, rank, tidx)
        rstd = cute.math.rsqrt(self.cluster_sum_sq(sO, lane) / Dh + norm_eps)
        cute.arch.cluster_arrive()                       # done reading the peers' sO
        # 5. gated RMSNorm of the owned rows
        for c0 in cutlass.range_constexpr(0, R, self.num_threads):
            c = v0 + c0 + tidx
            if c0 + tidx < R:
                z = mZ[b, h * Dh + c].to(Float32)
                y = sO[c] * rstd * mNormW[c].to(Float32) * base._sigmoid(z)
                mY[b, h * Dh + c] = y.to(mY.element_type)
        cute.arch.cluster_wait()                         # peers are done reading this sO

    @cute.jit
    def conv_and_gate_rows(self, mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, sQKV, sAlpha,
                           keep, lower_bound, b, h, rank, tidx):
        """Items t: [0, 2Dh) q, k conv of channel t % Dh; [2Dh, 2Dh+R) v conv of own row;
        [2Dh+R, 3Dh+R) gate. Arithmetic is fused.kda_decode.conv_and_gate's."""
        Dh, W, R = self.Dh, self.W, self.rows
        a_h = cute.math.exp(mALog[h].to(Float32))
        for it in cutlass.range_constexpr(self.n_conv):
            t = it * self.num_threads + tidx
            if t < 2 * Dh + R:
                i = t // Dh                              # 0, 1: q, k; 2: v (R <= Dh/2)
                c = t % Dh
                if i == 2:
                    c = rank * R + t - 2 * Dh
                ch = h * Dh + c
                x = mQ[b, ch]
                if i == 1:
                    x = mK[b, ch]
                if i == 2:
                    x = mV[b, ch]
                w = mConvW[i, ch, None].load()
                acc = x.to(Float32) * w[W - 1]
                for j in cutlass.range_constexpr(W - 1):
                    old = mConvS[b, i, ch, j]
                    acc = acc + old.to(Float32) * w[j]
                    if const_expr(j > 0):
                        keep[j - 1, it] = old
                        if i == 2:                       # v: read by this CTA only
                            mConvS[b, i, ch, j - 1] = old
                keep[W - 2, it] = x
                if i == 2:
                    mConvS[b, i, ch, W - 2] = x
                y = acc * base._sigmoid(acc)
                sQKV[c, i] = y.to(self.dtype).to(Float32)
            elif t < 3 * Dh + R:
                c = t - 2 * Dh - R
                g = mG[b, h * Dh + c].to(Float32) + mDtBias[h * Dh + c].to(Float32)
                sAlpha[c] = cute.math.exp(lower_bound * base._sigmoid(a_h * g))

    @cute.jit
    def write_qk_windows(self, mConvS, keep, b, h, rank, tidx):
        """New q and k conv windows of the channels this CTA owns (after the cluster barrier)."""
        Dh, R = self.Dh, self.rows
        for it in cutlass.range_constexpr(self.n_conv):
            if const_expr(it * self.num_threads < 2 * Dh):
                t = it * self.num_threads + tidx
                c = t % Dh
                if t < 2 * Dh:
                    if c // R == rank:
                        for j in cutlass.range_constexpr(self.W - 1):
                            mConvS[b, t // Dh, h * Dh + c, j] = keep[j, it]

    @cute.jit
    def cluster_sum_sq(self, sO, lane):
        """sum over c < Dh of o[c]^2, o[c] read from its owner's smem; fused.kda_decode's
        warp_sum_sq order, so every warp of every CTA gets the one-CTA kernel's bits."""
        n = -(-self.Dh // 32)
        xs = cute.make_rmem_tensor(n, Float32)
        xs.fill(0.0)
        for i in cutlass.range_constexpr(n):          # all remote loads in flight, then the sum
            c = 32 * i + lane
            if c < self.Dh:
                peer = cute.arch.map_dsmem_ptr(sO.iterator + c, c // self.rows)
                xs[i] = cute.arch.inline_ptx("ld.shared::cluster.f32 {$w0}, [{$r0}];",
                                             write_only_types=[Float32],
                                             read_only_args=[peer.toint()])
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(n):
            if 32 * i + lane < self.Dh:
                acc = acc + xs[i] * xs[i]
        return cute.arch.warp_reduction(acc, operator.add)


@runtime.compile_cache("kda_decode_cluster")
def _compile(dtype: str, Dh: int, W: int, cfg: KdaClusterConfig):
    return base.compile_op(KdaDecodeCluster(runtime.cutlass_dtype(dtype), Dh, W, cfg), dtype, Dh, W)


def launch(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state, y, lower_bound: float, l2_eps: float, norm_eps: float,
           variant: KdaClusterConfig = KdaClusterConfig()):
    """Destination-passing launch on the current stream: writes y, updates conv_state, state."""
    if not isinstance(variant, KdaClusterConfig):
        raise TypeError(f"variant: expected a KdaClusterConfig, got {variant!r}")
    if state.shape[0] == 0:
        return
    Dh, W = state.shape[-1], conv_w.shape[-1]
    fn = _compile(runtime.dtype_name(q_raw.dtype), Dh, W, variant)
    fn(*(base._rows(t) for t in (q_raw, k_raw, v_raw, g_raw, beta_raw, z)), conv_w.contiguous(),
       conv_state, A_log.contiguous(), dt_bias.contiguous(), o_norm_w.contiguous(), state, y,
       lower_bound, l2_eps, norm_eps)
