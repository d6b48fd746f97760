"""Fused KDA decode step in one launch: `references.kda.kda_decode`'s math, state updated in place.

Computes, per sequence and head: the three short causal convs of q, k, v over the conv state
(window W, the state shifted by one token) + SiLU; q, k L2-normalised (q scaled by Dh^-1/2); the
gate alpha = exp(lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))) per key channel;
beta = sigmoid(beta_raw); on the fp32 state S [V, K]: S' = S Diag(alpha), u = beta (v - S' k),
S = S' + u k^T, o = S q (rounded to the working dtype); y = RMSNorm(o) * o_norm_w * sigmoid(z).

Layout: q_raw, k_raw, v_raw, g_raw, z [B, H*Dh] and beta_raw [B, H] in the working dtype (bf16 or
fp16); conv_w [3, H*Dh, W] and conv_state [B, 3, H*Dh, W-1]; A_log [H], dt_bias [H*Dh], o_norm_w
[Dh] in fp32; state [B, H, Dh, Dh] fp32. The batch is a dynamic dim: one compile per (dtype, Dh, W,
variant).

Launch: one CTA per (head, sequence), grid (H, B). A group of Dh/4 lanes owns one state row (4 fp32
per lane), decays it, takes k.S and q.S_new with group shuffles and writes it back; o goes through
shared memory to the gated RMSNorm. Every state-row load and the conv, gate and norm operands are
issued at entry, before the first barrier, so the convs and gates run while the state is in flight.
Variants (`KdaConfig`; `all_configs()` lists every one the dispatcher may pick, each certified):
- `num_warps` 4 / 8 / 16 per CTA;
- `early_conv`: the conv and gate operands loaded into registers at entry rather than in the conv
  loop (a SiLU's IEEE division keeps ptxas from hoisting the next item's loads); ptxas may pair
  mul/add into FMAs differently per build, so its bits can differ from the plain variant's;
- `stages` > 0, the persistent launch: min(heads, ctas_per_sm x SMs) CTAs walk the heads
  n = c, c + G, ...; each head's state arrives in a shared-memory ring slot by one bulk async copy
  (mbarrier) and the slot is refilled with the head `stages` on before the update starts, so the
  next read overlaps this head's chain; per head it is the early_conv kernel's arithmetic;
- `row_chunk` > 1 (Dh = 128): a warp reduces k.S and q.S_new of `row_chunk` rows at once through one
  transposed shuffle reduction (121 shuffles per thread at 4 warps instead of 337), pairing lanes as
  the per-row butterflies do, so the bits are the per-row loop's;
- `operands_first` (one CTA per head, early_conv): the conv, gate and norm operands loaded before the
  state rows; bitwise the same as without it.
`KdaConfig.for_shape` picks by head count (B x H) and the device's SM count (see its docstring).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from fused import runtime
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, Int32, const_expr  # noqa: E402

WD_DTYPES = (torch.bfloat16, torch.float16)
DTYPES = ("bfloat16", "float16")   # working dtypes (the harness draws only these; the state is fp32)


@dataclass(frozen=True)
class KdaConfig:
    """Launch variant: warps per CTA (each CTA owns one head of one sequence); `early_conv`: the
    conv and gate operands are loaded at entry with the state (registers), not in the conv loop."""
    num_warps: int = 16
    early_conv: bool = False
    stages: int = 0            # > 0: persistent CTAs, head states through a `stages`-deep smem ring
    ctas_per_sm: int = 1       # persistent grid: min(heads, SMs x ctas_per_sm, max_ctas)
    max_ctas: int = 0          # 0: no cap (a cap only serves certification, see all_configs)
    row_chunk: int = 1         # > 1: state rows per transposed warp reduction (update_row_chunks)
    operands_first: bool = False   # early_conv, one CTA per head: conv / gate / norm loads before the state's

    @property
    def name(self) -> str:
        name = f"w{self.num_warps}" + ("e" if self.early_conv else "")
        if self.stages:
            name += f"p{self.stages}c{self.ctas_per_sm}" + (f"g{self.max_ctas}" if self.max_ctas else "")
        return name + (f"r{self.row_chunk}" if self.row_chunk > 1 else "") + ("f" if self.operands_first else "")

    @staticmethod
    def all_configs() -> list["KdaConfig"]:
        """Every launch the dispatcher can pick, and `w4ep1c3g16`: the persistent launch on a grid of
        16 CTAs, so that any shape of more than 16 heads certifies the ring's refills and phase
        flips (on the full grid only shapes of more than 3 x SMs heads reach them)."""
        return [KdaConfig(4), KdaConfig(8), KdaConfig(16), KdaConfig(4, True),
                KdaConfig(8, True, row_chunk=8, operands_first=True),
                KdaConfig(4, True, 1, 3), KdaConfig(4, True, 1, 3, 16)]

    @staticmethod
    def trial_configs() -> list["KdaConfig"]:
        """Launch variants the bench times beside all_configs (not dispatched, not certified)."""
        return [KdaConfig(8, True), KdaConfig(16, True), KdaConfig(8, True, 1, 2), KdaConfig(8, True, row_chunk=8),
                KdaConfig(4, True, row_chunk=8),
                KdaConfig(4, True, row_chunk=4), KdaConfig(4, True, 1, 3, row_chunk=16)]

    @staticmethod
    def for_shape(Dh: int, n_heads_total: int = 0, sms: int = 132) -> "KdaConfig":
        """The fastest variant measured on the H200 for `n_heads_total` (B x H) heads: Dh < 128, 4 warps;
        up to 264 heads, 8 warps with 8-row transposed reductions and the chain's operands loaded
        ahead of the state; up to one wave of the 4-warp kernel (3 CTAs per SM), 4 warps with the
        conv operands loaded at entry; from one to three such waves, the persistent 4-warp launch;
        beyond, one CTA per head again. `sms`: the device's SM count."""
        if Dh < 128:
            return KdaConfig(4)
        if n_heads_total <= 264:
            return KdaConfig(8, True, row_chunk=8, operands_first=True)
        if 3 * sms < n_heads_total <= 9 * sms:
            return KdaConfig(4, True, 1, 3)
        return KdaConfig(4, True)


def _sigmoid(x):
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


class KdaDecode:
    """Compile-time config: working dtype, head_dim Dh, conv width W, warps per CTA."""

    def __init__(self, dtype, Dh: int, W: int = 4, config: KdaConfig = KdaConfig()):
        if Dh % 4 != 0 or not 4 <= Dh <= 128 or 32 % (Dh // 4) != 0:
            raise ValueError(f"head_dim: {Dh} not supported; use 16, 32, 64 or 128")
        if W < 2:
            raise ValueError(f"conv width: {W} must be >= 2")
        self.dtype, self.Dh, self.W = dtype, Dh, W
        self.num_warps = config.num_warps
        self.early_conv = config.early_conv
        self.stages, self.ctas_per_sm = config.stages, config.ctas_per_sm
        if config.stages and not config.early_conv:
            raise ValueError(f"KdaConfig {config.name}: a persistent launch loads the conv operands at entry (early_conv)")
        if config.operands_first and (config.stages or not config.early_conv):
            raise ValueError(f"KdaConfig {config.name}: operands_first orders early_conv's loads in the one-CTA kernel")
        self.operands_first = config.operands_first
        self.n_it = -(-4 * Dh // (32 * config.num_warps))    # conv/gate items per thread
        self.num_threads = 32 * config.num_warps
        self.lanes_per_row = Dh // 4                      # 4 fp32 (16 bytes) per lane
        self.rows_per_warp = 32 // self.lanes_per_row
        rows_per_pass = self.rows_per_warp * self.num_warps
        self.n_pass = -(-Dh // rows_per_pass)
        self.even = Dh % rows_per_pass == 0
        self.scale = Dh ** -0.5
        self.n_y = -(-Dh // self.num_threads)             # y channels per thread
        # transposed row reductions: only where a row spans the warp (Dh = 128) and the passes split
        # into whole chunks; else one butterfly per row
        C = config.row_chunk
        if C & (C - 1) or not 1 <= C <= 32:
            raise ValueError(f"KdaConfig {config.name}: row_chunk must be a power of two <= 32")
        C = min(C, self.n_pass)
        self.row_chunk = C if (self.lanes_per_row == 32 and self.even and self.n_pass % C == 0) else 1

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                 mBeta: cute.Tensor, mZ: cute.Tensor, mConvW: cute.Tensor, mConvS: cute.Tensor,
                 mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
                 mState: cute.Tensor, mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32,
                 norm_eps: Float32, n_ctas: Int32, stream):
        args = (mQ, mK, mV, mG, mBeta, mZ, mConvW, mConvS, mALog, mDtBias, mNormW, mState, mY,
                lower_bound, l2_eps, norm_eps)
        if const_expr(self.stages > 0):
            # ptxas fits the registers to ctas_per_sm resident CTAs; all the shared memory to the ring
            self.pipe_kernel(*args).launch(grid=[n_ctas, 1, 1], block=[self.num_threads, 1, 1],
                                           stream=stream, min_blocks_per_mp=self.ctas_per_sm,
                                           preferred_smem_carveout=100)
        else:
            self.kernel(*args).launch(grid=[mState.shape[1], mState.shape[0], 1],
                                      block=[self.num_threads, 1, 1], stream=stream)

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
        cg = lane % L                                    # this lane's 4 key columns: 4cg..4cg+3
        gS = cute.zipped_divide(mState[b, h, None, None], (1, 4))  # ((1,4), (V, Dh/4))
        beta_raw = mBeta[b, h]
        if const_expr(self.operands_first):    # the chain's operands ahead of the state in the DRAM queue
            zr, nw = self.norm_operands(mZ, mNormW, b, h, tidx)
            xr, wr, orr, a_h = self.conv_operands(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, b, h, tidx)
        # 1. state rows first: they are the bytes, everything below overlaps their latency
        st = cute.make_rmem_tensor((4, self.n_pass), Float32)
        st.fill(0.0)
        for s in cutlass.range_constexpr(self.n_pass):
            v = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or v < Dh:
                st[None, s].store(gS[None, (v, cg)].load())
        # ... and the gated RMSNorm's operands
        if const_expr(not self.operands_first):
            zr, nw = self.norm_operands(mZ, mNormW, b, h, tidx)
        # 2. convs + SiLU -> sQKV (fp32 of the wd-rounded value), gate decay -> sAlpha
        smem = cutlass.memory.SmemAllocator()
        sQKV = smem.allocate_tensor(Float32, cute.make_layout((Dh, 3)), 16)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        if const_expr(self.early_conv):
            if const_expr(not self.operands_first):
                xr, wr, orr, a_h = self.conv_operands(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, b, h, tidx)
            self.conv_from_registers(xr, wr, orr, a_h, mConvS, sQKV, sAlpha, lower_bound, b, h, tidx)
        else:
            self.conv_and_gate(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, sQKV, sAlpha,
                               lower_bound, b, h, tidx)
        beta, sig = self.gates(beta_raw, zr)
        cute.arch.sync_threads()
        self.update_rows(st, gS, sQKV, sAlpha, sO, beta, l2_eps, warp, lane)
        cute.arch.sync_threads()
        self.gated_norm_out(sO, nw, sig, mY, b, h, tidx, lane, norm_eps)

    @cute.kernel
    def pipe_kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                    mBeta: cute.Tensor, mZ: cute.Tensor, mConvW: cute.Tensor, mConvS: cute.Tensor,
                    mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor,
                    mState: cute.Tensor, mY: cute.Tensor, lower_bound: Float32, l2_eps: Float32,
                    norm_eps: Float32):
        """Persistent: CTA c takes heads n = c, c + G, ... (n = b * H + h, G CTAs). Each head's state
        comes into a ring of `stages` shared-memory buffers by one bulk async copy, issued `stages`
        heads ahead, so the next heads' state reads overlap this head's chain and its state writes.
        Per head the arithmetic is kernel()'s with early_conv, in the same order."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        G, _, _ = cute.arch.grid_dim()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        Dh, S = self.Dh, self.stages
        H = mState.shape[1]
        n_heads = mState.shape[0] * H
        n_local = (n_heads - cta + G - 1) // G
        smem = cutlass.memory.SmemAllocator()
        sRing = smem.allocate_tensor(Float32, cute.make_layout((Dh, Dh, S), stride=(Dh, 1, Dh * Dh)), 128)
        bars = smem.allocate_array(cutlass.Int64, S, byte_alignment=8)
        sQKV = smem.allocate_tensor(Float32, cute.make_layout((Dh, 3)), 16)
        sAlpha = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout(Dh), 16)
        nbytes = Dh * Dh * 4
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(bars + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                if s < n_local:
                    self.fetch_state(mState, sRing, bars, s, cta + s * G, H, nbytes)
        for j in cutlass.range(n_local, unroll=1):
            n = cta + j * G
            b, h = n // H, n % H
            s = j % S
            # this head's operand loads first: their latency overlaps the state wait below
            beta_raw = mBeta[b, h]
            zr, nw = self.norm_operands(mZ, mNormW, b, h, tidx)
            xr, wr, orr, a_h = self.conv_operands(mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, b, h, tidx)
            # its state from the ring slot into registers: the slot is refilled (the head `stages`
            # on) right after the barrier below, so that read overlaps this head's chain
            cute.arch.mbarrier_wait(bars + s, (j // S) % 2)
            sS = cute.zipped_divide(sRing[None, None, s], (1, 4))
            st = cute.make_rmem_tensor((4, self.n_pass), Float32)
            st.fill(0.0)
            for p in cutlass.range_constexpr(self.n_pass):
                v = (p * self.num_warps + warp) * self.rows_per_warp + lane // self.lanes_per_row
                if const_expr(self.even) or v < Dh:
                    st[None, p].store(sS[None, (v, lane % self.lanes_per_row)].load())
            self.conv_from_registers(xr, wr, orr, a_h, mConvS, sQKV, sAlpha, lower_bound, b, h, tidx)
            beta, sig = self.gates(beta_raw, zr)
            cute.arch.sync_threads()          # sQKV / sAlpha written, the ring slot read
            if tidx == 0:
                if j + S < n_local:
                    self.fetch_state(mState, sRing, bars, s, n + S * G, H, nbytes)
            gS = cute.zipped_divide(mState[b, h, None, None], (1, 4))
            self.update_rows(st, gS, sQKV, sAlpha, sO, beta, l2_eps, warp, lane)
            cute.arch.sync_threads()          # sO is whole
            self.gated_norm_out(sO, nw, sig, mY, b, h, tidx, lane, norm_eps)

    @cute.jit
    def gates(self, beta_raw, zr):
        """beta = sigmoid(beta_raw) and this thread's output gates sigmoid(z)."""
        beta = _sigmoid(beta_raw.to(Float32))
        sig = cute.make_rmem_tensor(self.n_y, Float32)
        for i in cutlass.range_constexpr(self.n_y):
            sig[i] = _sigmoid(zr[i].to(Float32))
        return beta, sig

    @cute.jit
    def gated_norm_out(self, sO, nw, sig, mY, b, h, tidx, lane, norm_eps):
        """5. gated RMSNorm of the whole read-out sO: y = o * rsqrt(mean o^2 + eps) * w * sigmoid(z),
        this thread's channels of head (b, h)."""
        rstd = cute.math.rsqrt(self.warp_sum_sq(sO, None, lane) / self.Dh + norm_eps)
        for i in cutlass.range_constexpr(self.n_y):
            c = i * self.num_threads + tidx
            if c < self.Dh:
                y = sO[c] * rstd * nw[i] * sig[i]
                mY[b, h * self.Dh + c] = y.to(mY.element_type)

    @cute.jit
    def norm_operands(self, mZ, mNormW, b, h, tidx):
        """This thread's z and o_norm_w channels (c = tidx + i * threads) of head (b, h)."""
        zr = cute.make_rmem_tensor(self.n_y, mZ.element_type)
        nw = cute.make_rmem_tensor(self.n_y, Float32)
        zr.fill(0.0)
        nw.fill(0.0)
        for i in cutlass.range_constexpr(self.n_y):
            c = i * self.num_threads + tidx
            if c < self.Dh:
                zr[i] = mZ[b, h * self.Dh + c]
                nw[i] = mNormW[c].to(Float32)
        return zr, nw

    @cute.jit
    def fetch_state(self, mState, sRing, bars, s, n, H, nbytes: cutlass.Constexpr):
        """One bulk async copy of head n's state into ring slot s, completing on bars[s]."""
        from cutlass._mlir.dialects import nvvm
        cute.arch.mbarrier_arrive_and_expect_tx(bars + s, nbytes)
        src = mState[n // H, n % H, None, None].iterator
        nvvm.cp_async_bulk_shared_cluster_global(
            sRing[None, None, s].iterator.to_llvm_ptr(), src.to_llvm_ptr(),
            (bars + s).to_llvm_ptr(), Int32(nbytes).ir_value())

    @cute.jit
    def update_rows(self, st, gS, sQKV, sAlpha, sO, beta, l2_eps, warp, lane):
        """3. l2 norms of q, k (every warp redundantly: no second barrier);
        4. per state row v: decay, delta rule, rank-1 write, read-out o (rounded to the working
        dtype) into sO."""
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
            self.update_row_chunks(st, gS, sQKV, sO, beta, q, k, a, warp, lane)
            return
        for s in cutlass.range_constexpr(self.n_pass):
            v = (s * self.num_warps + warp) * self.rows_per_warp + lane // L
            if const_expr(self.even) or v < self.Dh:
                sd = st[None, s].load() * a
                ks = (sd * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                ks = cute.arch.warp_reduction(ks, operator.add, threads_in_group=L)
                u = (sQKV[v, 2] - ks) * beta
                sn = sd + k * u
                gS[None, (v, cg)].store(sn)
                o = (sn * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                o = cute.arch.warp_reduction(o, operator.add, threads_in_group=L)
                if cg == 0:
                    sO[v] = o.to(self.dtype).to(Float32)

    @cute.jit
    def update_row_chunks(self, st, gS, sQKV, sO, beta, q, k, a, warp, lane):
        """update_rows' loop at Dh = 128 (a state row spans the warp, 4 fp32 per lane), C = row_chunk
        rows of this warp at a time: each dot product over the row (k.S, q.S_new) of the C rows goes
        through one transposed reduction (transpose_sum: 2C - 1 + log2(32/C) shuffles for C rows,
        against 5C with one butterfly per row), and u reaches the row's lanes by C indexed shuffles.
        The additions pair lanes as the butterfly does (a + b and b + a are the same bits), so every
        sum, u and o are bitwise those of the per-row loop."""
        C = self.row_chunk
        span = 32 // C                              # lanes holding each row's sum after transpose_sum
        r = lane // span                            # the chunk row this lane holds
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
                gS[None, ((c0 + i) * self.num_warps + warp, lane)].store(sn)
                part.append((sn * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))
            o = self.transpose_sum(part, lane)
            if lane % span == 0:
                sO[v_r] = o.to(self.dtype).to(Float32)

    def transpose_sum(self, vals: list, lane):   # plain Python at trace time: its loops unroll
        """vals[i]: this lane's part of row i's sum (len C, a power of two <= 32). Returns, in lane l,
        the warp-wide sum for row l // (32 / C). At each of log2(C) steps (offsets 16, 8, ..) a lane
        keeps half of its rows and trades the other half with its partner, which keeps the other half;
        then a butterfly over the 32 / C lanes left. Own value + partner's, as warp_reduction adds."""
        off = 16
        while len(vals) > 1:
            half = len(vals) // 2
            upper = (lane & off) != 0
            nxt = []
            for i in range(half):
                send = Float32(cutlass.select_(upper, vals[i], vals[i + half]))
                keep = Float32(cutlass.select_(upper, vals[i + half], vals[i]))
                nxt.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
            vals, off = nxt, off // 2
        x = vals[0]
        while off >= 1:
            x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
            off //= 2
        return x

    @cute.jit
    def conv_input(self, mQ, mK, mV, b, i, ch):
        """Channel ch of token b's conv input i (0, 1, 2: q, k, v)."""
        x = mQ[b, ch]
        if i == 1:
            x = mK[b, ch]
        if i == 2:
            x = mV[b, ch]
        return x

    @cute.jit
    def conv_and_gate(self, mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, sQKV, sAlpha,
                      lower_bound, b, h, tidx):
        Dh, W = self.Dh, self.W
        a_h = cute.math.exp(mALog[h].to(Float32))
        for t0 in cutlass.range_constexpr(0, 4 * Dh, self.num_threads):
            t = t0 + tidx
            i, c = t // Dh, t % Dh                      # i = 0,1,2: q,k,v conv; 3: gate
            ch = h * Dh + c
            if t < 3 * Dh:
                x = self.conv_input(mQ, mK, mV, b, i, ch)
                w = mConvW[i, ch, None].load()
                acc = x.to(Float32) * w[W - 1]
                for j in cutlass.range_constexpr(W - 1):
                    old = mConvS[b, i, ch, j]
                    acc = acc + old.to(Float32) * w[j]
                    if const_expr(j > 0):
                        mConvS[b, i, ch, j - 1] = old
                mConvS[b, i, ch, W - 2] = x
                y = acc * _sigmoid(acc)
                sQKV[c, i] = y.to(self.dtype).to(Float32)
            elif t < 4 * Dh:
                g = mG[b, ch].to(Float32) + mDtBias[ch].to(Float32)
                sAlpha[c] = cute.math.exp(lower_bound * _sigmoid(a_h * g))

    @cute.jit
    def conv_operands(self, mQ, mK, mV, mG, mConvW, mConvS, mALog, mDtBias, b, h, tidx):
        """early_conv: this thread's conv and gate operands in registers (x or g, the W conv weights
        or dt_bias, the W-1 conv-state values), item `it` being t = it * threads + tidx as in
        conv_and_gate."""
        Dh, W = self.Dh, self.W
        xr = cute.make_rmem_tensor(self.n_it, self.dtype)
        wr = cute.make_rmem_tensor((W, self.n_it), Float32)
        orr = cute.make_rmem_tensor((W - 1, self.n_it), self.dtype)
        xr.fill(0.0)
        wr.fill(0.0)
        orr.fill(0.0)
        a_h = mALog[h].to(Float32)
        for it in cutlass.range_constexpr(self.n_it):
            t = it * self.num_threads + tidx
            i, c = t // Dh, t % Dh
            ch = h * Dh + c
            if t < 3 * Dh:
                xr[it] = self.conv_input(mQ, mK, mV, b, i, ch)
                w = mConvW[i, ch, None].load()
                for j in cutlass.range_constexpr(W):
                    wr[j, it] = w[j]
                for j in cutlass.range_constexpr(W - 1):
                    orr[j, it] = mConvS[b, i, ch, j]
            elif t < 4 * Dh:
                xr[it] = mG[b, ch]
                wr[0, it] = mDtBias[ch].to(Float32)
        return xr, wr, orr, a_h

    @cute.jit
    def conv_from_registers(self, xr, wr, orr, a_log, mConvS, sQKV, sAlpha, lower_bound, b, h, tidx):
        """conv_and_gate's arithmetic, in its order, on conv_operands' registers."""
        Dh, W = self.Dh, self.W
        a_h = cute.math.exp(a_log)
        for it in cutlass.range_constexpr(self.n_it):
            t = it * self.num_threads + tidx
            i, c = t // Dh, t % Dh
            ch = h * Dh + c
            if t < 3 * Dh:
                x = xr[it]
                acc = x.to(Float32) * wr[W - 1, it]
                for j in cutlass.range_constexpr(W - 1):
                    old = orr[j, it]
                    acc = acc + old.to(Float32) * wr[j, it]
                    if const_expr(j > 0):
                        mConvS[b, i, ch, j - 1] = old
                mConvS[b, i, ch, W - 2] = x
                y = acc * _sigmoid(acc)
                sQKV[c, i] = y.to(self.dtype).to(Float32)
            elif t < 4 * Dh:
                g = xr[it].to(Float32) + wr[0, it]
                sAlpha[c] = cute.math.exp(lower_bound * _sigmoid(a_h * g))

    @cute.jit
    def warp_sum_sq(self, sX, col: cutlass.Constexpr, lane):
        """sum over c < Dh of sX[c(, col)]^2, reduced over the warp (every lane gets it)."""
        acc = Float32(0.0)
        for c0 in cutlass.range_constexpr(0, self.Dh, 32):
            c = c0 + lane
            if c < self.Dh:
                if const_expr(col is None):
                    acc = acc + sX[c] * sX[c]
                else:
                    acc = acc + sX[c, col] * sX[c, col]
        return cute.arch.warp_reduction(acc, operator.add)


@runtime.compile_cache("kda_decode")
def _compile(dtype: str, Dh: int, W: int, cfg: KdaConfig):
    """Compile against fake tensors: batch and head count dynamic."""
    op = KdaDecode(runtime.cutlass_dtype(dtype), Dh, W, cfg)
    _, cute_ = runtime.cutlass_modules()
    b, h, c = runtime.sym_int(), runtime.sym_int(), runtime.sym_int(Dh)
    dt = runtime.cutlass_dtype(dtype)
    # activations may be column slices of the merged in-projection: dynamic row stride
    act = lambda n: cute_.runtime.make_fake_tensor(dt, (b, n), (cute_.sym_int64(), 1), assumed_align=2)
    f32 = lambda shape, align=4: runtime.fake_tensor("float32", shape, align=align)
    return runtime.compile_tvm_ffi(
        op, act(c), act(c), act(c), act(c), act(h), act(c), f32((3, c, W), 16 if W % 4 == 0 else 4),
        runtime.fake_tensor(dtype, (b, 3, c, W - 1), align=2), f32((h,)), f32((c,)), f32((Dh,)),
        f32((b, h, Dh, Dh), 16), runtime.fake_tensor(dtype, (b, c), align=2),
        Float32(-5.0), Float32(1e-6), Float32(1e-5), Int32(1))


def _check(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state):
    check_tensor("state", state, ndim=4, dtypes=(torch.float32,))
    B, H, Dh, _ = state.shape
    check_tensor("state", state, shape=(B, H, Dh, Dh))
    check_tensor("q_raw", q_raw, shape=(B, H * Dh), dtypes=WD_DTYPES)
    for name, t in (("k_raw", k_raw), ("v_raw", v_raw), ("g_raw", g_raw), ("z", z)):
        check_tensor(name, t, shape=(B, H * Dh), dtypes=(q_raw.dtype,))
    check_tensor("beta_raw", beta_raw, shape=(B, H), dtypes=(q_raw.dtype,))
    check_tensor("conv_w", conv_w, ndim=3, dtypes=(torch.float32,))
    W = conv_w.shape[-1]
    check_tensor("conv_w", conv_w, shape=(3, H * Dh, W))
    check_tensor("conv_state", conv_state, shape=(B, 3, H * Dh, W - 1), dtypes=(q_raw.dtype,))
    check_tensor("A_log", A_log, shape=(H,), dtypes=(torch.float32,))
    check_tensor("dt_bias", dt_bias, shape=(H * Dh,), dtypes=(torch.float32,))
    check_tensor("o_norm_w", o_norm_w, shape=(Dh,), dtypes=(torch.float32,))
    if Dh not in (16, 32, 64, 128) or W < 2:
        raise ValueError(f"state: head_dim {Dh} / conv_w: width {W}; the kernel takes Dh in "
                         "16, 32, 64, 128 and W >= 2")
    for name, t in (("state", state), ("conv_state", conv_state)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: updated in place, so it must be contiguous; got strides {t.stride()}")


def _rows(t):
    """A [B, n] activation the kernel can read: unit column stride, any row stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(cfg: KdaConfig, state) -> int:
    """CTAs of a persistent launch (cfg.stages > 0): min(heads, SMs x ctas_per_sm, max_ctas if set);
    1 (unused) for the one-CTA-per-head kernel, whose grid is (H, B)."""
    if not cfg.stages:
        return 1
    n = min(state.shape[0] * state.shape[1], runtime.sm_count(state.device) * cfg.ctas_per_sm)
    return min(n, cfg.max_ctas) if cfg.max_ctas else n


def launch(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state, y, lower_bound: float, l2_eps: float, norm_eps: float,
           variant: KdaConfig | None = None):
    """Destination-passing launch on the current stream: writes y, updates conv_state, state."""
    if state.shape[0] == 0:
        return
    Dh, W = state.shape[-1], conv_w.shape[-1]
    cfg = variant or KdaConfig.for_shape(Dh, state.shape[0] * state.shape[1], runtime.sm_count(state.device))
    fn = _compile(runtime.dtype_name(q_raw.dtype), Dh, W, cfg)
    # the state (bulk copies, 16-byte row vectors) and conv_w (16-byte rows where W % 4 == 0) are
    # compiled 16-byte aligned: a misaligned base is copied first, the state update copied back
    st = runtime.aligned(state)
    fn(*(_rows(t) for t in (q_raw, k_raw, v_raw, g_raw, beta_raw, z)),
       runtime.aligned(conv_w.contiguous(), 16 if W % 4 == 0 else 4),
       conv_state, A_log.contiguous(), dt_bias.contiguous(), o_norm_w.contiguous(), st, y,
       lower_bound, l2_eps, norm_eps, _grid(cfg, state))
    runtime.write_back(st, state)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("kda_decode", mutates_args=("conv_state", "state", "y"))
        def kda_decode_out(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor,
                           g_raw: torch.Tensor, beta_raw: torch.Tensor, z: torch.Tensor,
                           conv_w: torch.Tensor, conv_state: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor, o_norm_w: torch.Tensor, state: torch.Tensor,
                           y: torch.Tensor, lower_bound: float, l2_eps: float,
                           norm_eps: float) -> None:
            launch(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
                   o_norm_w, state, y, lower_bound, l2_eps, norm_eps)

        _op = kda_decode_out
    return _op


def kda_decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
               o_norm_w, state, lower_bound: float, l2_eps: float, norm_eps: float, *,
               variant: KdaConfig | None = None):
    """Fused replacement of references.kda.kda_decode (same signature; state, conv_state in place)."""
    _check(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
           state)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound: expected a negative float (K3: -5.0), got {lower_bound!r}")
    runtime.require_cuda("state", state)
    y = torch.empty(q_raw.shape, dtype=q_raw.dtype, device=q_raw.device)
    args = (q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
            state, y, float(lower_bound), float(l2_eps), float(norm_eps))
    if variant is not None:
        launch(*args, variant=variant)
    else:
        _custom_op()(*args)
    return y


def variants(tensors: dict, params: dict) -> list[KdaConfig]:
    """Every launch variant the harness must certify for these inputs."""
    return KdaConfig.all_configs()

