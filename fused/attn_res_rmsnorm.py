"""Fused AttnRes + RMSNorm, one launch (docs/ARCHITECTURE.md `attn_res_rmsnorm`).

One CTA (or a cluster of 2..8 CTAs, each a column slice) per token row. Every thread owns the
same 16-byte column vectors of all sources, so the op is: issue every load (prefix, delta, the
n_blocks block rows, the three weights), form p = wd(prefix + delta), one reduction of
(sum x^2, sum x*w) per source over the CTA (and the cluster, through DSMEM), softmax in registers,
mix, round to wd, a second reduction for the RMSNorm, write out/blocks/prefix.
HBM bytes = (n_blocks + 4 (+1 block write)) * D * elem per row: a latency-bound chain of loads
and two reductions, not a bandwidth-bound one. The batch is a dynamic dim: one compile per (dtype, D,
n_blocks, variant); `AttnResConfig.all_configs()` lists every variant the dispatcher may pick.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from fused import runtime
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, Int32, const_expr  # noqa: E402

MAX_BLOCKS = 8                                      # n_blocks + 1 <= 9 sources


@dataclass(frozen=True)
class AttnResConfig:
    """Launch variant: threads per CTA, and CTAs per row (a cluster splitting D; partial sums
    are exchanged through distributed shared memory). One CTA per row streams only ~26 GB/s
    (measured), so a small batch spreads each row over a cluster of 2..8 CTAs."""
    num_threads: int = 256
    cluster_n: int = 1

    @staticmethod
    def for_shape(D: int, elem_bits: int = 16, B: int = 64, n_blocks: int = MAX_BLOCKS) -> "AttnResConfig":
        """The fastest variant measured on the H200 at D = 7168 over every n_blocks 0..8 and B = 1..64:
        one CTA of n_vec / 2 threads (two vectors each, no cluster barrier) for n_blocks = 0;
        otherwise 4 CTAs x 224 threads per row up to B = 32, 2 x 448 beyond (a one-CTA launch spills
        or starves at 6-8 sources). The one-CTA rule needs n_vec >= 512 and at most 512 threads (fp32
        rows at D = 7168 would need 896). Rows under 512 vectors (small D) keep one CTA beyond B = 32."""
        n_vec = D // (128 // elem_bits)
        half = -(-n_vec // 64) * 32                     # n_vec / 2 threads, a multiple of 32
        if n_vec >= 512 and half <= 512 and n_blocks == 0:
            return AttnResConfig(half, 1)
        n = 4 if B <= 32 else 2 if n_vec >= 512 else 1
        while n > 1 and n_vec % n:
            n //= 2
        per_cta = n_vec // n
        if n == 1 and per_cta >= 256:
            return AttnResConfig(256, 1)
        return AttnResConfig(min(512, -(-per_cta // 32) * 32), n)

    @staticmethod
    def all_configs(D: int, elem_bits: int = 16) -> list["AttnResConfig"]:
        """Every variant a launch may use at this D: the dispatcher's picks and the fixed sizes."""
        picks = {AttnResConfig.for_shape(D, elem_bits, b, nb) for b in (1, 32, 64) for nb in (0, 5, 8)}
        picks |= {AttnResConfig(t) for t in (128, 256, 448, 512)} | {AttnResConfig(128, 8)}
        return sorted(picks, key=lambda c: (c.cluster_n, c.num_threads))


class AttnResRMSNorm:
    """Compile-time config: dtype, D, n_blocks (static: sources held in registers), threads."""

    def __init__(self, dtype, D: int, n_blocks: int, config: AttnResConfig = AttnResConfig()):
        self.dtype, self.D, self.n_blocks = dtype, D, n_blocks
        self.num_threads, self.cluster_n = config.num_threads, config.cluster_n
        self.num_warps = config.num_threads // 32
        self.vec = 128 // dtype.width
        if D % (self.vec * self.cluster_n) != 0:
            raise ValueError(f"D: {D} must be a multiple of {self.vec * self.cluster_n} "
                             f"(16-byte vectors x {self.cluster_n} CTAs per row)")
        if not 0 <= n_blocks <= MAX_BLOCKS:
            raise ValueError(f"n_blocks: {n_blocks} must be in 0..8 (n_blocks + 1 <= 9 sources)")
        self.n_vec = D // self.vec // self.cluster_n     # vectors of this CTA's column slice
        self.vpt = -(-self.n_vec // self.num_threads)  # vectors per thread
        self.even = self.n_vec % self.num_threads == 0
        self.n_src = n_blocks + 1

    @cute.jit
    def __call__(self, mPrefix: cute.Tensor, mDelta: cute.Tensor, mBlocks: cute.Tensor,
                 mResNormW: cute.Tensor, mResProjW: cute.Tensor, mNormW: cute.Tensor,
                 mOut: cute.Tensor, block_write: Int32, eps: Float32, norm_eps: Float32,
                 stream):
        self.kernel(mPrefix, mDelta, mBlocks, mResNormW, mResProjW, mNormW, mOut,
                    block_write, eps, norm_eps).launch(
            grid=[self.cluster_n, mPrefix.shape[0], 1], block=[self.num_threads, 1, 1],
            cluster=[self.cluster_n, 1, 1] if const_expr(self.cluster_n > 1) else None,
            stream=stream)

    @cute.kernel
    def kernel(self, mPrefix: cute.Tensor, mDelta: cute.Tensor, mBlocks: cute.Tensor,
               mResNormW: cute.Tensor, mResProjW: cute.Tensor, mNormW: cute.Tensor,
               mOut: cute.Tensor, block_write: Int32, eps: Float32, norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()             # rank = CTA's column slice of the row
        S = self.n_src
        smem = cutlass.memory.SmemAllocator()
        # red[k, t] at k * threads + t: a warp's 32 stores red[k, t] and reads red[k, lane + 32 j] hit 32
        # consecutive words. (The column-major (2S, threads) layout strode 2S words from lane to lane:
        # gcd(2S, 32) lanes per bank, 16 at n_blocks = 7; H200: 1.1-2 us slower than n_blocks = 8.)
        red = smem.allocate_tensor(Float32, cute.make_layout((2 * S, self.num_threads),
                                                             stride=(self.num_threads, 1)), 16)
        # one CTA: tot[k] = the CTA's sum k. A cluster: tot[r, k] (r fastest) = CTA r's sum k, written
        # by CTA r into every CTA's tot (block_sum's push), read locally, cluster_n sums per vector load
        n_peer = self.cluster_n
        tot = smem.allocate_tensor(Float32, cute.make_layout((n_peer, 2 * S + 1), stride=(1, n_peer)), 16)
        # a cluster's two reductions each end on an mbarrier of their own (phase 0 only): it completes
        # when all cluster_n CTAs' pushed bytes have landed (st.async ... complete_tx)
        mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(2), 8)
        if const_expr(self.cluster_n > 1):
            if tidx == 0:
                cute.arch.mbarrier_init(mbar.iterator, 1)
                cute.arch.mbarrier_init(mbar.iterator + 1, 1)
                cute.arch.mbarrier_init_fence()
            # a peer's shared memory (and mbarriers) may be written only once the peer runs and has
            # initialised them: this phase, waited on just before the first push (block_sum)
            cute.arch.cluster_arrive_relaxed()
        vec, V, S, dt = self.vec, self.vpt, self.n_src, self.dtype
        rows = lambda t: cute.zipped_divide(t, (vec,))  # ((vec), n_vec)
        gP, gO = rows(mPrefix[row, None]), rows(mOut[row, None])
        gWn, gWp, gWo = rows(mResNormW), rows(mResProjW), rows(mNormW)

        # registers: x[:, i, j] = source j (blocks..., p last) at vector i; three weights
        x = cute.make_rmem_tensor((vec, V, S), dt)
        dl = cute.make_rmem_tensor((vec, V), dt)
        w = cute.make_rmem_tensor((vec, V, 3), dt)
        x.fill(0.0)
        dl.fill(0.0)
        w.fill(0.0)
        for i in cutlass.range_constexpr(V):  # every load issued before the first use
            c = rank * self.n_vec + tidx + i * self.num_threads
            if const_expr(self.even) or tidx + i * self.num_threads < self.n_vec:
                for j in cutlass.range_constexpr(S - 1):
                    x[None, i, j].store(rows(mBlocks[row, j, None])[None, c].load())
                x[None, i, S - 1].store(gP[None, c].load())
                self.load_delta(dl, i, mDelta, row, c)
                w[None, i, 0].store(gWn[None, c].load())
                w[None, i, 1].store(gWp[None, c].load())
                w[None, i, 2].store(gWo[None, c].load())
        # partials: part[2j] = sum x_j^2, part[2j+1] = sum x_j * (res_norm_w * res_proj_w)
        part = cute.make_rmem_tensor(2 * S, Float32)
        part.fill(0.0)
        for i in cutlass.range_constexpr(V):
            p = x[None, i, S - 1].load().to(Float32) + dl[None, i].load().to(Float32)
            x[None, i, S - 1].store(p.to(dt))  # the new prefix, rounded to wd once
            q = w[None, i, 0].load().to(Float32) * w[None, i, 1].load().to(Float32)
            for j in cutlass.range_constexpr(S):
                v = x[None, i, j].load().to(Float32)
                part[2 * j] += (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                part[2 * j + 1] += (v * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # the state update needs only p: written now, so the writes overlap the reductions (each thread
        # rewrites only the columns it has already read, so no source changes under another thread)
        zero = cute.make_rmem_tensor(vec, dt)
        zero.fill(0.0)
        for i in cutlass.range_constexpr(V):
            c = rank * self.n_vec + tidx + i * self.num_threads
            if const_expr(self.even) or tidx + i * self.num_threads < self.n_vec:
                if block_write >= 0:
                    rows(mBlocks[row, block_write, None])[None, c].store(x[None, i, S - 1].load())
                    gP[None, c].store(zero.load())
                else:
                    gP[None, c].store(x[None, i, S - 1].load())
        self.block_sum(part, red, tot, mbar, 0, 2 * S)
        # softmax over sources of score_j = dot_j * rsqrt(mean x_j^2 + eps)
        score = cute.make_rmem_tensor(S, Float32)
        m = -Float32.inf
        for j in cutlass.range_constexpr(S):
            score[j] = part[2 * j + 1] * cute.math.rsqrt(part[2 * j] / self.D + eps)
            m = cute.arch.fmax(m, score[j])
        den = Float32(0.0)
        for j in cutlass.range_constexpr(S):
            score[j] = cute.math.exp(score[j] - m)
            den += score[j]
        inv = Float32(1.0) / den
        # mix of raw values in fp32, rounded to wd; then RMSNorm over the row
        mix = cute.make_rmem_tensor((vec, V), dt)
        ss = cute.make_rmem_tensor(1, Float32)
        ss.fill(0.0)
        for i in cutlass.range_constexpr(V):
            acc = x[None, i, 0].load().to(Float32) * (score[0] * inv)
            for j in cutlass.range_constexpr(1, S):
                acc = acc + x[None, i, j].load().to(Float32) * (score[j] * inv)
            mix[None, i].store(acc.to(dt))
            mx = mix[None, i].load().to(Float32)
            ss[0] += (mx * mx).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        self.block_sum1(ss, red, tot, mbar, 2 * S)
        rstd = cute.math.rsqrt(ss[0] / self.D + norm_eps)
        for i in cutlass.range_constexpr(V):
            c = rank * self.n_vec + tidx + i * self.num_threads
            if const_expr(self.even) or tidx + i * self.num_threads < self.n_vec:
                y = (mix[None, i].load().to(Float32) * rstd).to(dt).to(Float32)
                gO[None, c].store((y * w[None, i, 2].load().to(Float32)).to(dt))

    @cute.jit
    def load_delta(self, dl: cute.Tensor, i: cutlass.Constexpr[int], mDelta: cute.Tensor, row, c):
        """dl[:, i] <- vector c of the row's delta (fused/allreduce_attn_res_rmsnorm.py folds T
        partials here instead)."""
        dl[None, i].store(cute.zipped_divide(mDelta[row, None], (self.vec,))[None, c].load())

    @cute.jit
    def block_sum(self, vals: cute.Tensor, red: cute.Tensor, tot: cute.Tensor, mbar: cute.Tensor,
                  col0: cutlass.Constexpr[int], n: cutlass.Constexpr[int]):
        """vals[k] <- sum over the CTA (and its cluster) of vals[k], k < n, in a fixed order, so
        every thread of every CTA of the row gets the same bits. Through shared memory, one warp
        per value: thread t stores red[k, t]; warp k % warps adds red[k, lane + 32 j] over j, then
        a butterfly over its lanes. One CTA: lane 0 stores it in tot[0, col0 + k]. A cluster: lane 0
        pushes it into tot[rank, col0 + k] of every CTA of the cluster (st.async, each completing bytes
        on the receiver's mbarrier 0), every thread waits on its own CTA's mbarrier 0 (no cluster
        barrier), and lane k adds tot[r, col0 + k] in rank order from its own shared memory.
        (Butterflies of all n values in every warp would cost ~270 shuffles per thread at n = 18;
        pulling the peers' sums after a barrier would cost a DSMEM round trip and a closing barrier.)"""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        tidx = cute.arch.thread_idx()[0]
        for k in cutlass.range_constexpr(n):
            red[k, tidx] = vals[k]
        cute.arch.sync_threads()
        if const_expr(self.cluster_n > 1):
            cute.arch.cluster_wait()     # every peer has started and initialised its mbarriers
            if tidx == 0:
                # the one arrival of each mbarrier's phase 0, and the bytes it waits for; after the
                # entry barrier, as CUTLASS's pipelines first arrive (a peer's complete_tx may come
                # first: the phase cannot complete while this arrival is pending)
                cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator, n * self.cluster_n * 4)
                cute.arch.mbarrier_arrive_and_expect_tx(mbar.iterator + 1, self.cluster_n * 4)
        for k in cutlass.range_constexpr(n):
            if warp == k % self.num_warps:
                t = red[k, lane]
                for j in cutlass.range_constexpr(1, self.num_warps):
                    t = t + red[k, lane + 32 * j]
                t = cute.arch.warp_reduction(t, operator.add)
                if lane == 0:
                    if const_expr(self.cluster_n > 1):
                        self.push(tot, mbar, 0, col0 + k, t)
                    else:
                        tot[0, col0 + k] = t
        if const_expr(self.cluster_n > 1):
            self.wait_pushes(mbar, 0)   # every CTA's n sums are in this CTA's tot
            # lane k adds sum k over the ranks, then every lane takes the n sums by shuffles: a rank
            # sum per value in every thread held 4n loaded words at once (134 registers at n = 18 with
            # 4 CTAs: one CTA per SM where 2 were wanted)
            t = self.rank_sum(tot, col0 + cutlass.min(lane, n - 1))
            for k in cutlass.range_constexpr(n):
                vals[k] = cute.arch.shuffle_sync(t, offset=k)
        else:
            cute.arch.sync_threads()
            for k in cutlass.range_constexpr(n):
                vals[k] = self.rank_sum(tot, col0 + k)

    @cute.jit
    def push(self, tot: cute.Tensor, mbar: cute.Tensor, b: cutlass.Constexpr[int], k, t: Float32):
        """t into tot[rank, k] of every CTA of the cluster, this one included, each store completing its
        4 bytes on that CTA's mbarrier b (st.async: no fence, no cluster barrier; CuTe DSL 4.8 tensors
        cannot store through a peer's address, hence the inline PTX)."""
        rank = cute.arch.block_idx()[0]
        for r in cutlass.range_constexpr(self.cluster_n):
            peer = cute.arch.map_dsmem_ptr(tot.iterator + (k * self.cluster_n + rank), r)
            peer_bar = cute.arch.map_dsmem_ptr(mbar.iterator + b, r)
            runtime.st_async_cluster(peer, [t], peer_bar)

    @cute.jit
    def wait_pushes(self, mbar: cute.Tensor, b: cutlass.Constexpr[int]):
        """Until phase 0 of this CTA's mbarrier b completes, with acquire at cluster scope: the pushes'
        complete_tx releases at cluster scope (the DSL's mbarrier_wait acquires at CTA scope)."""
        runtime.wait_cluster_phase0(mbar.iterator + b)

    @cute.jit
    def rank_sum(self, tot: cute.Tensor, k) -> Float32:
        """tot[r, k] added over the cluster's ranks in rank order (tot[0, k] for one CTA)."""
        v = cute.make_rmem_tensor(self.cluster_n, Float32)
        v.store(tot[None, k].load())
        t = v[0]
        for r in cutlass.range_constexpr(1, self.cluster_n):
            t = t + v[r]
        return t

    @cute.jit
    def block_sum1(self, vals: cute.Tensor, red: cute.Tensor, tot: cute.Tensor, mbar: cute.Tensor,
                   col: cutlass.Constexpr[int]):
        """vals[0] <- its sum over the CTA (and cluster) with one CTA barrier: a butterfly in each warp,
        lane 0 stores the warp's sum in red[0, warp], every thread adds the warps' sums in warp order;
        in a cluster, thread 0 pushes the CTA's sum into tot[rank, col] of every CTA (mbarrier 1) and
        every thread adds the CTAs' in rank order once its own CTA's mbarrier 1 completes. No closing
        barrier: a CTA exits only after every peer's store into it has landed, and its own stores go
        to peers that wait for them. The same bits in every thread of every CTA of the row. (red is
        free: every warp's reads of it in block_sum precede its pushes, which mbarrier 0 waited for.)"""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        t = cute.arch.warp_reduction(vals[0], operator.add)
        if lane == 0:
            red[0, warp] = t
        cute.arch.sync_threads()
        t = red[0, 0]
        for j in cutlass.range_constexpr(1, self.num_warps):
            t = t + red[0, j]
        if const_expr(self.cluster_n > 1):
            if cute.arch.thread_idx()[0] == 0:
                self.push(tot, mbar, 1, col, t)
            self.wait_pushes(mbar, 1)
            t = self.rank_sum(tot, col)
        vals[0] = t


@runtime.compile_cache("attn_res_rmsnorm")
def _compile(dtype: str, D: int, n_blocks: int, cfg: AttnResConfig):
    b, nb = runtime.sym_int(), runtime.sym_int()
    row = lambda: runtime.fake_tensor(dtype, (b, D))
    vec = lambda: runtime.fake_tensor(dtype, (D,))
    op = AttnResRMSNorm(runtime.cutlass_dtype(dtype), D, n_blocks, cfg)
    return runtime.compile_tvm_ffi(op, row(), row(), runtime.fake_tensor(dtype, (b, nb, D)),
                                   vec(), vec(), vec(), row(), Int32(0), Float32(1e-5), Float32(1e-5))


def _check(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write):
    check_tensor("prefix", prefix, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    B, D = prefix.shape
    check_tensor("delta", delta, shape=(B, D), dtypes=(prefix.dtype,))
    check_tensor("blocks", blocks, shape=(B, None, D), dtypes=(prefix.dtype,))
    for name, w in (("res_norm_w", res_norm_w), ("res_proj_w", res_proj_w.reshape(-1)),
                    ("norm_w", norm_w)):
        check_tensor(name, w, shape=(D,), dtypes=(prefix.dtype,))
    for name, t in (("prefix", prefix), ("blocks", blocks)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: updated in place, so it must be contiguous; got strides {t.stride()}")
    if not isinstance(n_blocks, int) or not 0 <= n_blocks <= min(MAX_BLOCKS, blocks.shape[1]):
        raise ValueError(f"n_blocks: {n_blocks!r}; use 0..{min(MAX_BLOCKS, blocks.shape[1])} "
                         f"(at most 8 and at most the {blocks.shape[1]} slots of blocks)")
    if not isinstance(block_write, int) or not -1 <= block_write < blocks.shape[1]:
        raise ValueError(f"block_write: {block_write!r}; use -1 (no write) or 0..{blocks.shape[1] - 1}")
    if D % (16 // prefix.element_size()):
        raise ValueError(f"prefix: D={D} must be a multiple of {16 // prefix.element_size()} (16-byte vectors)")
    runtime.require_cuda("prefix", prefix)


def default_config(prefix, n_blocks: int) -> AttnResConfig:
    """The dispatcher's variant for this batch, row width and source count."""
    return AttnResConfig.for_shape(prefix.shape[1], 8 * prefix.element_size(), prefix.shape[0], n_blocks)


def run_compiled(fn, prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, block_write: int, eps: float,
                 norm_eps: float) -> None:
    """A compiled kernel of this module (or of fused/allreduce_attn_res_rmsnorm.py, whose `delta` is the
    partials) on the caller's operands. Every operand is read (and prefix, blocks written) in 16-byte
    vectors: a misaligned base is copied to fresh storage first, and the state updates go back to the
    caller's tensors."""
    p, b = runtime.aligned(prefix), runtime.aligned(blocks)
    fn(p, runtime.aligned(delta.contiguous()), b, runtime.aligned(res_norm_w.contiguous()),
       runtime.aligned(res_proj_w.reshape(-1).contiguous()), runtime.aligned(norm_w.contiguous()), out,
       block_write, eps, norm_eps)
    runtime.write_back(p, prefix)
    runtime.write_back(b, blocks)


def launch(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, n_blocks: int,
           block_write: int, eps: float, norm_eps: float, variant: AttnResConfig | None = None):
    """Destination-passing launch on the current stream: writes out, updates prefix/blocks."""
    if prefix.shape[0] == 0:
        return
    cfg = variant or default_config(prefix, n_blocks)
    fn = _compile(runtime.dtype_name(prefix.dtype), prefix.shape[1], n_blocks, cfg)
    run_compiled(fn, prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, block_write, eps, norm_eps)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("attn_res_rmsnorm", mutates_args=("prefix", "blocks", "out"))
        def attn_res_rmsnorm_out(prefix: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor,
                                 res_norm_w: torch.Tensor, res_proj_w: torch.Tensor,
                                 norm_w: torch.Tensor, out: torch.Tensor, n_blocks: int,
                                 block_write: int, eps: float, norm_eps: float) -> None:
            launch(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, n_blocks,
                   block_write, eps, norm_eps)

        _op = attn_res_rmsnorm_out
    return _op


def attn_res_rmsnorm(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks: int,
                     block_write: int, eps: float, norm_eps: float, *, variant=None):
    """Fused replacement of references.attn_res.attn_res_rmsnorm (same signature and state)."""
    _check(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write)
    out = torch.empty_like(prefix)
    if variant is not None:
        launch(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, n_blocks, block_write,
               eps, norm_eps, variant)
    else:
        _custom_op()(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, n_blocks,
                     block_write, float(eps), float(norm_eps))
    return out


def variants(tensors: dict, params: dict) -> list[AttnResConfig]:
    """Every launch variant the harness must certify for these inputs."""
    prefix = tensors["prefix"]
    return AttnResConfig.all_configs(prefix.shape[-1], prefix.element_size() * 8)
