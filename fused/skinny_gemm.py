"""skinny_gemm: y[M,N] = x[M,K] @ w[N,K].T, bf16/fp16 in, fp32 accumulate, one rounding.

Decode GEMMs are weight-bandwidth bound: the kernel reads W once with 16-byte coalesced loads.
A CTA owns `n_per_cta` output columns and `m_tile` rows; its threads split K (thread t takes
16-byte chunks t, t+T, ...) so each x chunk loaded serves all the CTA's columns. Partial sums are
reduced by warp shuffles, then across warps through shared memory in a fixed order: the
reduction order depends only on (K, threads), never on M or the variant, so results are
deterministic and batch invariant. M is dynamic; the grid's m-tiles are the fastest grid index so
the m-tiles of one column block run together and share W through L2.

Variants: `gemv` m_tile in {1,2,4,8} (one m-tile when M <= 8) and `tiled` m_tile=8 for M > 8.
Both are SIMT (CUDA-core FMA): past M ~ 16 the FMA rate, not HBM, is the limit.
`wgmma_*` (fused/skinny_gemm_wgmma.py): Hopper warpgroup MMA, swap-AB, 64 or 128 weight rows per
CTA, weight and token tiles through a TMA pipeline in shared memory, fixed-order split-K over CTAs,
for 1 <= M <= 64; its order depends on (K, its split-K S) only, so it is batch invariant within a
variant but not bitwise equal to the SIMT kernel. At the 6144- and 7168-column K3 shapes the
default adds skinny_gemm_wgmma's bk / step tiling (WGMMA_TILES): the plain variant's bits on 128
CTAs; the two split-K shapes take its 128 k per stage alone. The two split-K defaults (7168 -> 3584
and the router shape 7168 -> 896) fold their partials inside a thread-block cluster (fold "cpush",
WGMMA_DEFAULTS). `default_config` picks SIMT for small M and the wgmma variant of M's bucket above a
per-shape threshold measured on the H200: a dispatcher that switches kernels with M is batch
invariant within each M (the harness's permuted-batch check), not across M. The mma.sync kernel of
fused/skinny_gemm_mma.py runs only when named as a variant (router_topk's logits use it).
"""

import dataclasses
import math
import operator
from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm_mma as mma
from fused import skinny_gemm_wgmma as wgmma
from fused.skinny_gemm_mma import SkinnyGemmMmaConfig
from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig

DTYPES = ("bfloat16", "float16")   # working dtypes of x and w (the harness draws only these)
THREADS = 128                      # fixed: it defines the reduction order (batch invariance)
K3_SHAPES = ((7168, 49152), (7168, 6144), (12288, 7168), (1536, 7168), (7168, 3584), (7168, 896))


@dataclass(frozen=True)
class SkinnyGemmConfig:
    m_tile: int          # rows of y per CTA (accumulators per column held in registers)
    n_per_cta: int       # columns of y per CTA

    @property
    def name(self) -> str:
        return f"{'gemv' if self.m_tile <= 8 else 'tiled'}_m{self.m_tile}_n{self.n_per_cta}"


def _n_per_cta(n: int, m_tile: int) -> int:
    # enough CTAs to fill 132 SMs several times over, few enough x re-reads
    for cand in (8, 4, 2, 1):
        if n % cand == 0 and n // cand >= 4 * 132 and cand * m_tile <= 32:
            return cand
    return 1 if n % 2 else 2


Config = SkinnyGemmConfig | SkinnyGemmMmaConfig | SkinnyGemmWgmmaConfig


def all_configs(N: int, K: int) -> list[Config]:
    """Every variant the dispatcher can pick for this (N, K): one SIMT variant per m_tile bucket,
    then the shipped wgmma variants of each m_pad bucket. (The mma.sync kernel of
    skinny_gemm_mma.py is no longer picked here: the wgmma kernel was faster at every measured M
    and shape; router_topk still uses it for its fp32 logits.)"""
    simt = [SkinnyGemmConfig(m, _n_per_cta(N, m)) for m in (1, 2, 4, 8)]
    return simt + [c for p in wgmma.M_PADS for c in wgmma_configs(N, K, p)]


def simt_config(M: int, N: int, K: int) -> SkinnyGemmConfig:
    m_tile = 1 << max(0, math.ceil(math.log2(max(M, 1)))) if M <= 8 else 8
    return SkinnyGemmConfig(m_tile, _n_per_cta(N, m_tile))


# Tensor-core choice measured on the H200 (results/performance.md): (N, K) -> (min_M, {m_pad: (rows,
# CTAs per SM[, split-K fold[, S]])}). The wgmma variant is the default for min_M <= M <= 64: min_M is
# the smallest M whose SIMT bucket was slower than the wgmma m8 variant (the m8 variant costs the same
# for every M <= 8). Shapes not listed keep the SIMT kernel. The two split shapes fold their split-K
# partials inside a thread-block cluster by "cpush" (the S split CTAs of a column block are one
# cluster; each deals its fp32 fragments by st.async into a receive buffer of their owner, no cluster
# barrier after the entry): 7168 -> 3584 at S = 2 and the router shape at S = 8 (a cluster holds at
# most 8 CTAs), 128 k per stage. One S per shape and the same k order, so every M bucket gives the
# bits of the "last" fold at that S.
WGMMA_DEFAULTS: dict[tuple[int, int], tuple[int, dict[int, tuple]]] = {
    (49152, 7168): (3, {8: (64, 1), 16: (64, 2), 32: (64, 2), 64: (128, 1)}),
    (6144, 7168): (3, {8: (64, 1), 16: (64, 1), 32: (64, 1), 64: (64, 1)}),
    (7168, 12288): (2, {8: (64, 1), 16: (64, 1), 32: (64, 1), 64: (64, 1)}),
    (7168, 1536): (2, {8: (64, 1), 16: (64, 1), 32: (64, 1), 64: (64, 1)}),
    (3584, 7168): (3, {p: (64, 1, "cpush") for p in wgmma.M_PADS}),
    (896, 7168): (2, {p: (64, 1, "cpush", 8) for p in wgmma.M_PADS}),
    # The column-split shapes of one rank (T = 1, 8, 16: g_proj, latent_up, o_proj): the fastest
    # shipped variant of each bucket timed beside the SIMT buckets by `bench --variants` on the H200.
    # Not listed, where no wgmma variant beat the SIMT kernel at any M: 448 and 224 columns of K = 7168
    # (latent_down), 448 of K = 3584 (latent_up at T = 16).
    (12288, 7168): (3, {8: (64, 1), 16: (64, 2), 32: (64, 2), 64: (64, 2)}),
    (1536, 7168): (5, {p: (64, 1) for p in wgmma.M_PADS}),
    (768, 7168): (5, {p: (64, 1) for p in wgmma.M_PADS}),
    (7168, 3584): (2, {p: (64, 1) for p in wgmma.M_PADS}),
    (896, 3584): (9, {p: (64, 1) for p in wgmma.M_PADS}),
    (896, 12288): (5, {p: (64, 1) for p in wgmma.M_PADS}),
    (448, 12288): (5, {p: (64, 1) for p in wgmma.M_PADS}),
}


# Shapes whose default runs with 128 k per stage and (step > 0) a 64-row tile every `step` rows
# (skinny_gemm_wgmma's bk / step), so the 6144 and 7168 columns fill 128 CTAs where 64-row blocks gave
# 96 or 112: (N, K) -> (bk, step). Same S, same k order, so the same bits as the plain variant. The
# two cluster-fold shapes take 128 k per stage without the overlap (faster there on the H200).
WGMMA_TILES: dict[tuple[int, int], tuple[int, int]] = {
    (3584, 7168): (128, 0), (896, 7168): (128, 0), (6144, 7168): (128, 48), (7168, 1536): (128, 56),
    (7168, 12288): (128, 56),
}


def default_wgmma(N: int, K: int, m_pad: int) -> SkinnyGemmWgmmaConfig | None:
    """The wgmma variant WGMMA_DEFAULTS names for this shape's m_pad bucket (with its WGMMA_TILES
    tiling), or None."""
    entry = WGMMA_DEFAULTS.get((N, K))
    if entry is None or not wgmma.supports(K):
        return None
    rows, occ, *fold = entry[1][m_pad]
    for c in wgmma.configs_for(N, K, m_pad):
        if (c.rows, c.occupancy) == (rows, occ):
            if (N, K) in WGMMA_TILES:
                bk, step = WGMMA_TILES[(N, K)]
                c = dataclasses.replace(c, bk=bk, step=step, stages=wgmma.stages_for(rows, m_pad, occ, bk))
            if fold:
                c = wgmma.with_fold(c, fold[0], fold[1] if len(fold) > 1 else c.ksplit)
            return c
    return None


def default_config(M: int, N: int, K: int) -> Config:
    entry = WGMMA_DEFAULTS.get((N, K))
    if entry is not None and entry[0] <= M <= 64:
        cfg = default_wgmma(N, K, wgmma.m_pad_for(M))
        if cfg is not None:
            return cfg
    return simt_config(M, N, K)


def wgmma_configs(N: int, K: int, m_pad: int) -> list[SkinnyGemmWgmmaConfig]:
    """The shipped wgmma variants of one m_pad bucket, plus the default's split-K fold where it is
    not one of them: every variant a launch in this bucket can be dispatched to."""
    out = wgmma.configs_for(N, K, m_pad)
    d = default_wgmma(N, K, m_pad)
    return out + ([d] if d is not None and d not in out else [])


class SkinnyGemm:
    def __init__(self, N: int, K: int, cfg: SkinnyGemmConfig):
        cutlass, _ = runtime.cutlass_modules()
        self.N, self.K, self.cfg = N, K, cfg
        self.threads = THREADS
        self.warps = THREADS // 32
        self.vec = 8                                  # 16-byte chunk of a 2-byte dtype
        self.kv = K // self.vec                       # 16-byte chunks per row
        self.iters = -(-self.kv // THREADS)
        self.mt, self.nt = cfg.m_tile, cfg.n_per_cta
        self.acc_dtype = cutlass.Float32

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()

        @cute.jit
        def host(mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream):
            gX = cute.zipped_divide(mX, (1, self.vec))
            gW = cute.zipped_divide(mW, (1, self.vec))
            m_tiles = (mX.shape[0] + self.mt - 1) // self.mt
            kernel(gX, gW, mY).launch(grid=[m_tiles, self.N // self.nt, 1],
                                      block=[self.threads, 1, 1], stream=stream)

        return host

    def device_body(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        mt, nt, vec, kvn, warps = self.mt, self.nt, self.vec, self.kv, self.warps
        iters, T = self.iters, self.threads

        @cute.jit
        def body(gX: cute.Tensor, gW: cute.Tensor, mY: cute.Tensor):
            """The CTA's share of y (block_idx picks it)."""
            tidx, _, _ = cute.arch.thread_idx()
            bm, bn, _ = cute.arch.block_idx()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            M = mY.shape[0]
            m0 = bm * mt
            n0 = bn * nt
            acc = cute.make_rmem_tensor(cute.make_layout((mt, nt)), Float32)
            acc.fill(0.0)
            xr = cute.make_rmem_tensor(cute.make_layout((vec, mt)), Float32)
            wr = cute.make_rmem_tensor(cute.make_layout((vec, nt)), Float32)
            for it in cutlass.range_constexpr(iters):
                kv = Int32(it * T) + tidx
                if kv < kvn:
                    for j in cutlass.range_constexpr(nt):
                        wr[None, j].store(gW[None, (n0 + j, kv)].load().to(Float32))
                    for m in cutlass.range_constexpr(mt):
                        row = cutlass.min(m0 + m, M - 1)   # clamp: rows past M computed, not stored
                        xr[None, m].store(gX[None, (row, kv)].load().to(Float32))
                    for m in cutlass.range_constexpr(mt):
                        for j in cutlass.range_constexpr(nt):
                            s = acc[m, j]
                            for e in cutlass.range_constexpr(vec):
                                s = s + xr[e, m] * wr[e, j]
                            acc[m, j] = s
            red = cutlass.memory.SmemAllocator().allocate_tensor(
                Float32, cute.make_layout((mt * nt, warps)), byte_alignment=16)
            for m in cutlass.range_constexpr(mt):
                for j in cutlass.range_constexpr(nt):
                    v = cute.arch.warp_reduction(acc[m, j], operator.add)
                    if lane == 0:
                        red[m * nt + j, warp] = v
            cute.arch.sync_threads()
            if tidx < mt * nt:
                m = tidx // nt
                j = tidx - m * nt
                tot = red[tidx, 0]
                for w in cutlass.range_constexpr(1, warps):
                    tot = tot + red[tidx, w]
                if m0 + m < M:
                    mY[m0 + m, n0 + j] = tot.to(mY.element_type)

        return body

    def device_kernel(self):
        return mma.gemm_kernel(self.device_body())


@runtime.compile_cache("skinny_gemm")
def _compile(dtype: str, out_dtype: str, N: int, K: int, cfg: Config):
    if isinstance(cfg, SkinnyGemmWgmmaConfig):
        return wgmma.compile_variant(dtype, out_dtype, N, K, cfg)
    if isinstance(cfg, SkinnyGemmMmaConfig):
        return mma.build(dtype, out_dtype, N, K, cfg)
    return mma.compile_host(SkinnyGemm(N, K, cfg).jit_host(), dtype, out_dtype, N, K)


def _check(x, w):
    import torch

    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x, w: expected 2-D tensors, got x{tuple(x.shape)} w{tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"w: K={w.shape[1]} does not match x's K={x.shape[1]}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"x: dtype {x.dtype} / w: {w.dtype}; the kernel takes bf16 or fp16, both alike")
    if x.shape[1] % 8:
        raise ValueError(f"x: K={x.shape[1]} must be a multiple of 8 (16-byte loads)")
    runtime.require_cuda("x", x)


def launch(x, w, out, variant: Config | None = None) -> None:
    """y = x @ w.T into `out` (bf16/fp16 like x, or fp32), on the current stream."""
    M, K = x.shape
    N = w.shape[0]
    cfg = variant or default_config(M, N, K)
    if M == 0:
        return
    # every kernel here assumes 16-byte aligned rows (vector loads, TMA): a view at an odd offset
    # is copied to fresh storage first, and an out= at one is written through an aligned copy
    x, w, dst = runtime.aligned(x), runtime.aligned(w), runtime.aligned(out)
    if isinstance(cfg, SkinnyGemmMmaConfig) and M > cfg.m_pad:
        raise ValueError(f"x: M={M} is over the variant's m_pad={cfg.m_pad}")
    if isinstance(cfg, SkinnyGemmWgmmaConfig):
        wgmma.check_launch(M, N, K, cfg)
        cfg = wgmma.resident_or_vec(x.device, N, cfg)
    fn = _compile(runtime.dtype_name(x.dtype), runtime.dtype_name(out.dtype), N, K, cfg)
    if isinstance(cfg, SkinnyGemmWgmmaConfig):
        fn(x, w, dst, *wgmma.buffers(x.device, N, K, cfg))
    else:
        fn(x, w, dst)
    runtime.write_back(dst, out)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("skinny_gemm", mutates_args=("out",))
        def skinny_gemm_out(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
            launch(x.contiguous(), w.contiguous(), out)

        _op = skinny_gemm_out
    return _op


def skinny_gemm(x, w, *, out=None, variant: Config | None = None):
    """Fused replacement of references.gemm.skinny_gemm (same signature)."""
    import torch

    _check(x, w)
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if variant is not None:
        launch(x.contiguous(), w.contiguous(), out, variant)
    else:
        _custom_op()(x, w, out)
    return out


def variants(tensors: dict, params: dict) -> list[Config]:
    """The variants the harness certifies for this case: every SIMT m-tile (each handles any M) and
    the tensor-core variants of this M's padding bucket (those a launch at this M can use)."""
    M, K = tensors["x"].shape
    N = tensors["w"].shape[0]
    out: list[Config] = [SkinnyGemmConfig(m, _n_per_cta(N, m)) for m in (1, 2, 4, 8)]
    if 1 <= M <= 64 and wgmma.supports(K):
        out += wgmma_configs(N, K, wgmma.m_pad_for(M))
    return out
