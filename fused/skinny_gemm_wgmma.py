"""skinny_gemm, Hopper warpgroup-MMA variant: y[M,N] = x[M,K] @ w[N,K].T for 1 <= M <= 64 (bf16/fp16
in, fp32 accumulate, one rounding to y's dtype: bf16, fp16 or fp32), wgmma.mma_async with both
operands in shared memory, loaded by TMA through a `stages`-deep mbarrier pipeline.

Swap-AB: a CTA owns `rows` weight rows (64, 128 or 256: wgmma's M, 64 per instruction) and all tokens,
padded to m_pad in {8, 16, 32, 64} (wgmma's N). Per stage the TMA loads a rows x 64 weight tile and an
m_pad x 64 token tile (both K-major, 128-byte swizzle); token rows >= M lie outside x and are zero
filled by the TMA, and are never stored. One producer warp issues the TMA loads; one consumer
warpgroup runs 4 wgmma (k = 16 each) per stage and releases a stage once the wgmma of the next stage
has been issued (wait_group 1). Each CTA reads its weight rows once and x once per (CTA, k range):
x re-reads from L2 are m_pad/rows of the weight traffic.

Split-K: `ksplit` S CTAs share a column block; CTA ks takes k-tiles [ks*KT//S, (ks+1)*KT//S) of the
KT = K/64 tiles (a static split). With S > 1 each CTA writes its fp32 accumulator fragment to a
workspace, then takes a ticket from the block's int32 counter (atomic add, acq_rel, gpu scope); the
CTA that draws S-1 adds the S partials in ks order, ((p0 + p1) + p2) + ..., rounds once, stores y and
resets the counter to 0 (so CUDA-graph replays start from zero). No float atomics. The fold is
serial in one CTA (S x rows x m_pad x 4 bytes read from L2): on the H200 it made S = 9-28 variants
2-9x slower at m_pad 32/64, while S <= 2 variants matched or beat cuBLAS on 5 of the 6 K3 shapes.

Two cheaper folds (`fold_configs`; `configs_for(..., sweep=True)` lists them for the bench): both
write the partials token-major and only for the M real tokens, and read them 16 bytes at a time with
all 128 consumer threads. "vec": the last CTA folds all M x rows outputs. "spread": every split CTA
takes its ticket, spins (thread 0, ld.acquire) until the counter reaches S, then folds its own 1/S
slice of the M x rows outputs; a second round of tickets lets the last CTA out reset the counter.
The spin is safe only if the whole grid is resident, which `validate` enforces for the H200 (N/rows
x S <= 132 x occupancy, and the CTA's shared memory allows that occupancy) and `resident_or_vec`
checks against the device's own SM count at launch (a smaller part runs it as "vec"); the launch is
cooperative, so the driver places the whole grid at once: a co-running kernel that holds SMs only
delays it, and two spread launches on two streams cannot each hold part of the SMs and wait on each
other. "partials" leaves the fold to the caller: each split CTA writes its fp32 partial to
y[ks, M, N] and exits (router_topk's top-k kernel folds them in ks order, the same adds). Both fold in the same ks order as "last", so they give its
bits at the same (rows, occupancy, S). The dispatcher uses them where the H200 sweep measured them
faster (skinny_gemm.WGMMA_DEFAULTS: the router shape 7168 -> 896, where "last" left one CTA adding
nine partials of up to 64 x 64 outputs); the shipped `configs_for` variants keep "last".

Cluster folds ("cluster", "cspread"): the S split CTAs of a column block are launched as one
thread-block cluster (1 x S, S <= 8), which the hardware places on one GPC at once, so a CTA only
ever waits on peers that are running (no residency condition, no cooperative launch). After its main
loop every CTA arrives on a cluster barrier (its stages are then free), stores each fp32 fragment
element into the stage buffers of the CTA that adds it (st.shared::cluster), and a second cluster
barrier (release / acquire) publishes the stores; the adder sums the S partials of its elements in
ks order, the same adds as "last". "cluster" gathers everything in CTA 0; "cspread" deals the
fragment over the S CTAs (a reduce-scatter), so each receives about 1/S of it. No workspace, no
counter, no fence to gpu scope, no global round trip; bitwise equal to "last" at the same S. "cpush" deals the fragment as cspread does, without its two cluster barriers: each CTA
initialises an mbarrier of its own and arrives (relaxed) on the cluster barrier at entry; after its
main loop it waits on that barrier (long since complete: every peer has started and initialised its
mbarrier), pushes its partial by st.async into a receive buffer beside the stages of each owner
(the stages may still be in use there), each store completing its bytes on the owner's mbarrier,
and waits on its own mbarrier for the owned x S x 128 floats it adds. Bitwise equal to "cspread"
and faster on the H200; it is the default at both split shapes (skinny_gemm.WGMMA_DEFAULTS).

Tiling options (`bk`, `step`; skinny_gemm.WGMMA_TILES picks them per shape): `bk` = 128 loads two
128-byte swizzle rows of each weight row per stage (half the stages, twice the bytes each; the chain
runs the same k16 steps in the same order). `step` < rows starts a CTA's rows-deep tile every `step`
weight rows, so N/step CTAs cover N where N/rows would leave SMs idle (3584 / 56 x S 2 = 128 CTAs
against 112; 6144 / 48 = 128 against 96; 7168 / 56 = 128 against 112): each CTA also loads and
multiplies the next tile's first rows - step rows (its neighbour reads them from L2 at about the same
time; the last tile's rows past N are zero filled by the TMA) and stores only its own `step` columns.
Neither changes S or the k order, so both give the plain variant's bits (checked on the H200).

Summation order of y[m, n]: the wgmma chain over the k-tiles of each split in k order (inside a tile
the tensor core's fixed k order), then the splits in ks order. It depends on K, the k tile (64) and S
only. S is a function of (N, K, rows, occupancy) (`ksplit_for`), never of M, m_pad or the token's
position; padded tokens are zeros in their own accumulator columns. So the result is deterministic and
batch invariant: a token row gives the same bits at any M <= m_pad with the same variant, and (on the
assumption that a wgmma output element does not depend on the instruction's N, checked by the GPU
test) across m_pad variants with the same rows and occupancy. Not bitwise equal to the mma.sync or
SIMT kernels (other orders). `fresh_acc` (router_topk's fp32 logits only): each k-tile's 4 wgmma
chain from zero into a second fragment (scale-d off on the first), which is added to the accumulator
with IEEE fp32 adds in k-tile order: the tensor core aligns and truncates its addends to the largest
one, and a chain that carries the running sum in C erred ~3x more than cuBLAS's fp32 GEMM.
The adds wait for each tile's wgmma (wait_group 0).

The launcher (`launch`) owns the workspace and the counters: allocated with torch on x's device on
first use per (device, N, K, variant) and reused, so warm a variant up before capturing it in a CUDA
graph; concurrent launches of one variant on different streams would share them and must be ordered.
"""

from dataclasses import dataclass

from fused import runtime

BK = 64                      # k per stage: 64 bf16 = one 128-byte swizzle row
SMS = 132                    # H200 SMs
SMEM_PER_SM = 233472         # bytes (228 KB); 1 KB of it is reserved per resident CTA
CONSUMER_THREADS = 128       # one warpgroup
THREADS = CONSUMER_THREADS + 32
MAX_STAGES = 12
M_PADS = (8, 16, 32, 64)
# Split-K folds. "last": fragment-major partials, the last CTA to arrive adds the S partials (4-byte
# loads, every m_pad column). "vec": token-major partials of the M real tokens only, the last CTA
# adds them with 16-byte loads. "spread": the same partials; every split CTA waits (integer spin on
# the block's counter) until all S have arrived, then folds its own 1/S slice of the M x rows
# outputs, so the fold is spread over S SMs; needs the whole grid resident (validate). Each output
# is ((p0 + p1) + p2) + ... in ks order in all three, whichever CTA adds it. "partials": no fold in
# the kernel; each split CTA writes its fp32 partial of the M real tokens to y[ks, M, N] (y fp32,
# [S, M, N]) for the caller to fold in ks order (router_topk's top-k kernel does), as the mma.sync
# kernel's split-K does: no counter, no wait, nothing to keep resident. "cluster" / "cspread": the S
# split CTAs of a column block are one thread-block cluster and fold through distributed shared
# memory, gathered in CTA 0 / dealt over the S CTAs (module docstring, "Cluster folds"). "cpush": cspread's
# dealing, pushed by st.async into a buffer of its own in each owner, whose mbarrier counts the bytes in
# (no cluster barrier after the kernel's entry).
CLUSTER_FOLDS = ("cluster", "cspread", "cpush")
FOLDS = ("last", "vec", "spread", "partials", *CLUSTER_FOLDS)
MAX_CLUSTER = 8              # portable thread-block cluster size


@dataclass(frozen=True)
class SkinnyGemmWgmmaConfig:
    m_pad: int           # tokens per CTA, padded: 8, 16, 32 or 64 (wgmma N)
    rows: int            # weight rows (output columns) per CTA: 64, 128 or 256 (wgmma M atoms of 64)
    stages: int          # TMA pipeline depth (weight + token tile per stage)
    ksplit: int          # CTAs along K per column block (1: no workspace)
    occupancy: int = 1   # CTAs per SM the stage count was sized for (1 or 2)
    fold: str = "last"   # split-K fold: "last", "vec", "spread" or "partials" (FOLDS); "last" is the shipped kernel
    fresh_acc: bool = False  # each k-tile's 4 wgmma chain from zero, added to the accumulator by IEEE adds
    bk: int = BK         # k per stage: 64 (one 128-byte swizzle row per weight row) or 128 (two)
    step: int = 0        # output columns per CTA (0: rows); below rows, neighbouring CTAs' tiles overlap

    @property
    def name(self) -> str:
        tail = ("" if self.fold == "last" else f"_{self.fold}") + ("_f" if self.fresh_acc else "")
        tail += (f"_k{self.bk}" if self.bk != BK else "") + (f"_n{self.step}" if self.step else "")
        return f"wgmma_m{self.m_pad}_r{self.rows}_st{self.stages}_s{self.ksplit}_o{self.occupancy}{tail}"

    @property
    def cols(self) -> int:
        """Output columns per CTA: `step` where set (a rows-deep tile starting every step rows, the
        rows past step loaded and multiplied but not stored), else rows."""
        return self.step or self.rows

    @property
    def writes_partials(self) -> bool:
        """y is the fp32 split-K partials [ksplit, M, N], folded by the caller."""
        return self.fold == "partials" and self.ksplit > 1


def supports(K: int) -> bool:
    return K % BK == 0 and K >= BK


def stage_bytes(rows: int, m_pad: int, bk: int = BK) -> int:
    return (rows + m_pad) * bk * 2


def stages_for(rows: int, m_pad: int, occupancy: int, bk: int = BK, reserve: int = 0) -> int:
    """Stages that fit one CTA's share of the SM, `reserve` bytes (a fold's own buffer) set aside."""
    budget = SMEM_PER_SM // occupancy - 1024 - 2048 - reserve   # reserved + barriers/flag/alignment
    return min(MAX_STAGES, budget // stage_bytes(rows, m_pad, bk))


def ksplit_for(N: int, K: int, rows: int, occupancy: int) -> int:
    """CTAs along K. Depends on (N, K, rows, occupancy) only: it fixes the summation order. With
    N/rows >= 132 column blocks there is no split; otherwise the largest S whose grid is resident at
    once (N/rows * S <= 132 * occupancy) and leaves each CTA >= 4 k-tiles."""
    blocks, kt = N // rows, K // BK
    if blocks >= SMS:
        return 1
    s = max(1, (SMS * occupancy) // blocks)
    return max(1, min(s, kt // 4))


# (rows, CTAs per SM) of the shipped variants: the ones that were fastest somewhere in the H200
# sweep of every (rows in 64/128/256) x (1 or 2 CTAs per SM) variant; r256 and r128 at 2 CTAs per SM
# never were (`sweep=True` still lists them for the bench).
SHIPPED = ((64, 1), (64, 2), (128, 1))


def configs_for(N: int, K: int, m_pad: int, sweep: bool = False) -> list[SkinnyGemmWgmmaConfig]:
    """The variants for one m_pad bucket: (rows, occupancy) in SHIPPED (every rows in {64, 128, 256}
    x 1 or 2 CTAs per SM with `sweep`), rows dividing N, 2 CTAs per SM only where it still gives >= 3
    stages."""
    if not supports(K) or m_pad not in M_PADS:
        return []
    out = []
    for rows in (64, 128, 256):
        if N % rows:
            continue
        for occ in (1, 2):
            if not sweep and (rows, occ) not in SHIPPED:
                continue
            st = stages_for(rows, m_pad, occ)
            if st >= 3:
                out.append(SkinnyGemmWgmmaConfig(m_pad, rows, st, ksplit_for(N, K, rows, occ), occ))
    if sweep:
        out += fold_configs([c for c in out if (c.rows, c.occupancy) in SHIPPED])
    return out


def fold_configs(base: list[SkinnyGemmWgmmaConfig]) -> list[SkinnyGemmWgmmaConfig]:
    """Bench-only split-K variants (not certified, not picked by the dispatcher): for each split
    variant, the "vec" and "spread" folds at its S and at about S/2 (fewer, larger k ranges: a cheaper
    fold against less parallel weight streaming; S is static per variant, never a function of M)."""
    out = []
    for c in base:
        if c.ksplit == 1:
            continue
        for s in sorted({c.ksplit, max(2, (c.ksplit + 1) // 2)}, reverse=True):
            for fold in ("vec", "spread"):
                out.append(SkinnyGemmWgmmaConfig(c.m_pad, c.rows, c.stages, s, c.occupancy, fold))
    return out


def m_pad_for(M: int) -> int:
    for p in M_PADS:
        if M <= p:
            return p
    raise ValueError(f"x: M={M} is over 64, the wgmma skinny_gemm's largest token tile")


def cluster_buffer_bytes(cfg: SkinnyGemmWgmmaConfig) -> int:
    """Cluster folds: the fp32 partials (all S, its own included) of the fragment elements one CTA
    adds (at most; "cpush" sizes its buffer by it), staged in its weight stages ("cluster", "cspread")
    or in a buffer of its own ("cpush")."""
    frag = cfg.rows * cfg.m_pad // CONSUMER_THREADS
    owned = frag if cfg.fold == "cluster" else -(-frag // cfg.ksplit)
    return owned * cfg.ksplit * CONSUMER_THREADS * 4


def own_buffer_bytes(cfg: SkinnyGemmWgmmaConfig) -> int:
    """Shared memory a fold needs beside the stages: "cpush"'s receive buffer."""
    return cluster_buffer_bytes(cfg) if cfg.fold == "cpush" and cfg.ksplit > 1 else 0


def with_fold(cfg: SkinnyGemmWgmmaConfig, fold: str, ksplit: int) -> SkinnyGemmWgmmaConfig:
    """cfg with this split-K fold and S, its stages refitted where the fold takes shared memory of
    its own ("cpush"); the same k order, so the same sums as the "last" fold at that S."""
    import dataclasses

    out = dataclasses.replace(cfg, fold=fold, ksplit=ksplit)
    if own_buffer_bytes(out):
        out = dataclasses.replace(out, stages=min(cfg.stages, stages_for(
            cfg.rows, cfg.m_pad, cfg.occupancy, cfg.bk, own_buffer_bytes(out))))
    return out


def workspace_shapes(N: int, cfg: SkinnyGemmWgmmaConfig) -> tuple[tuple[int], tuple[int]]:
    """(fp32 partials, int32 counters) element counts; 1-element dummies without split-K."""
    if cfg.ksplit == 1 or cfg.writes_partials or cfg.fold in CLUSTER_FOLDS:
        return (1,), (1,)
    frag = cfg.rows * cfg.m_pad // CONSUMER_THREADS
    return ((N // cfg.cols) * cfg.ksplit * frag * CONSUMER_THREADS,), (N // cfg.cols,)


def validate(N: int, K: int, cfg: SkinnyGemmWgmmaConfig) -> None:
    if not supports(K):
        raise ValueError(f"w: K={K} must be a positive multiple of {BK} for the wgmma variant")
    if cfg.rows not in (64, 128, 256):
        raise ValueError(f"variant: rows={cfg.rows} must be 64, 128 or 256 ({cfg.name})")
    if cfg.step == 0 and N % cfg.rows:
        raise ValueError(f"w: N={N} must be a multiple of rows={cfg.rows} ({cfg.name}); pick a variant "
                         f"from configs_for(N, K, m_pad)")
    if cfg.m_pad not in M_PADS:
        raise ValueError(f"variant: m_pad={cfg.m_pad} must be one of {M_PADS} ({cfg.name})")
    if cfg.bk not in (BK, 2 * BK) or K % cfg.bk:
        raise ValueError(f"variant: bk={cfg.bk} must be {BK} or {2 * BK} and divide K={K} ({cfg.name})")
    if cfg.step and (cfg.step > cfg.rows or cfg.step % 8 or N % cfg.step or cfg.fold not in ("last", *CLUSTER_FOLDS)
                     or cfg.fresh_acc):
        raise ValueError(f"variant: step={cfg.step} must be a multiple of 8 up to rows={cfg.rows} dividing "
                         f"N={N}, with the 'last' or a cluster fold ({cfg.name})")
    if not 1 <= cfg.ksplit <= K // cfg.bk:
        raise ValueError(f"variant: ksplit={cfg.ksplit} must be in 1..K/{cfg.bk}={K // cfg.bk} ({cfg.name})")
    smem = cfg.stages * stage_bytes(cfg.rows, cfg.m_pad, cfg.bk) + 2048 + own_buffer_bytes(cfg)
    if cfg.stages < 2 or smem > SMEM_PER_SM - 1024:
        raise ValueError(f"variant: {cfg.stages} stages need {smem} bytes of shared memory ({cfg.name})")
    if cfg.fold not in FOLDS:
        raise ValueError(f"variant: fold={cfg.fold!r} must be one of {FOLDS} ({cfg.name})")
    if cfg.fold in CLUSTER_FOLDS:
        need = cluster_buffer_bytes(cfg)
        if not 2 <= cfg.ksplit <= MAX_CLUSTER or (cfg.fold != "cpush" and need > cfg.stages * cfg.rows * cfg.bk * 2):
            raise ValueError(f"variant: fold={cfg.fold!r} makes the ksplit={cfg.ksplit} CTAs of a column block one "
                             f"cluster: ksplit must be 2..{MAX_CLUSTER} and the {need} bytes of partials a CTA "
                             f"adds must fit its weight stages (\"cpush\": a buffer beside them) ({cfg.name})")
    if cfg.fold == "spread":
        # every CTA spins until all S of its column block arrived: only safe if the grid is resident
        if cfg.occupancy not in (1, 2) or smem > SMEM_PER_SM // cfg.occupancy - 1024:
            raise ValueError(f"variant: fold='spread' needs {cfg.occupancy} CTAs per SM resident, but one "
                             f"CTA takes {smem} bytes of shared memory ({cfg.name})")
        if num_ctas(N, cfg) > SMS * cfg.occupancy:
            raise ValueError(f"variant: fold='spread' spins on its split-K peers, so the grid must be "
                             f"resident: {num_ctas(N, cfg)} CTAs > {SMS} SMs x occupancy {cfg.occupancy} "
                             f"({cfg.name}); lower ksplit or use fold='vec'")


class SkinnyGemmWgmma:
    """Compile-time configuration; `__call__` is the @cute.jit host, `kernel` the device code."""

    def __init__(self, N: int, K: int, cfg: SkinnyGemmWgmmaConfig):
        validate(N, K, cfg)
        self.N, self.K, self.cfg = N, K, cfg
        self.kt = K // cfg.bk
        self.blocks = N // cfg.cols
        self.frag = cfg.rows * cfg.m_pad // CONSUMER_THREADS     # fp32 accumulators per thread
        self.storage = None

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        import cutlass.utils.hopper_helpers as sm90
        from cutlass.tensor_utils import LayoutEnum

        cfg = self
        kernel = self.device_kernel()
        recv_words = max(4, own_buffer_bytes(self.cfg) // 4)   # "cpush": S partials of its owned elements

        @cute.jit
        def host(mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor,
                 stream):
            dt = mW.element_type
            c = cfg.cfg
            kmajor = cute.nvgpu.OperandMajorMode.K
            tiled_mma = sm90.make_trivial_tiled_mma(dt, dt, kmajor, kmajor, cutlass.Float32, (1, 1, 1),
                                                    tiler_mn=(64, c.m_pad))
            tile = (c.rows, c.m_pad, c.bk)
            w_sl = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dt, c.stages)
            x_sl = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dt, c.stages)
            g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_w, tW = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mW, cute.slice_(w_sl, (None, None, 0)), (c.rows, c.bk))
            tma_x, tX = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, mX, cute.slice_(x_sl, (None, None, 0)), (c.m_pad, c.bk))

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, 2 * c.stages]
                fbar: cute.struct.MemRange[cutlass.Int64, 2]          # "cpush": the fold's mbarrier
                ticket: cute.struct.MemRange[cutlass.Int32, 4]
                recv: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, recv_words], 16]
                sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(w_sl)], 1024]
                sX: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(x_sl)], 1024]

            cfg.storage = Storage
            # "spread" spins on its split-K peers: a cooperative launch makes the driver place the
            # whole grid at once, so two such launches on two streams cannot each hold part of it
            if cutlass.const_expr(c.fold in CLUSTER_FOLDS):    # a column block's S splits: one cluster
                kernel(tma_w, tW, tma_x, tX, mY, mWs, mCnt, tiled_mma, w_sl, x_sl).launch(
                    grid=[cfg.blocks, c.ksplit, 1], block=[THREADS, 1, 1], cluster=[1, c.ksplit, 1],
                    stream=stream)
            else:
                kernel(tma_w, tW, tma_x, tX, mY, mWs, mCnt, tiled_mma, w_sl, x_sl).launch(
                    grid=[cfg.blocks, c.ksplit, 1], block=[THREADS, 1, 1], stream=stream,
                    cooperative=c.fold == "spread" and c.ksplit > 1)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        import cutlass.pipeline as pipeline
        from cutlass import Float32, Int32

        cfg = self
        rows, S, kt, frag, stages = self.cfg.rows, self.cfg.ksplit, self.kt, self.frag, self.cfg.stages
        warpgroup = cute.nvgpu.warpgroup
        bk, cols = self.cfg.bk, self.cfg.cols
        nkb = bk // 16
        tx_bytes = stage_bytes(rows, self.cfg.m_pad, bk)       # 2-byte dtypes; OOB rows count too
        fold, spread, to_caller = self.cfg.fold, self.cfg.fold == "spread", self.cfg.writes_partials
        fresh = self.cfg.fresh_acc
        E = rows * self.cfg.m_pad                              # floats per split partial
        wait_at_least = spin_wait_op() if spread else None
        st_cluster = st_cluster_op() if fold in CLUSTER_FOLDS else None
        push = fold == "cpush" and S > 1
        own_max = -(-frag // S)                                # "cpush": fragment elements a CTA adds, at most
        # st.async vector width: a run of owned elements goes out as one .v2 / .v4 store where every CTA
        # owns the same count (frag % S == 0); the buffer is chunk-major, [S][own_max / vw][128][vw]
        # floats, so a warp's stores and the owner's reads of one chunk are 32 consecutive vectors (an
        # element-minor [S][128][own_max] strode own_max words from lane to lane: up to 16-way bank
        # conflicts: 7168 -> 3584 at M = 64 1.2 us slower than "cspread" on the H200)
        vw = next(v for v in (4, 2, 1) if own_max % v == 0) if frag % S == 0 else 1
        n_chunks = own_max // vw if frag % S == 0 else own_max

        def owner(i: int) -> int:                              # cluster folds: who adds element i
            return 0 if fold == "cluster" else (i * S) // frag

        def first_owned(j: int) -> int:
            return 0 if fold == "cluster" else (j * frag + S - 1) // S

        @cute.jit
        def fold_tokens(acc: cute.Tensor, tCc: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
                        mCnt: cute.Tensor, ticket: cute.Tensor, bn: Int32, ks: Int32, tidx: Int32, M: Int32):
            """fold "vec" / "spread": partial[t, r] of the M real tokens, token-major; the sum of 4
            adjacent outputs is read as 16 bytes per split, in ks order."""
            blk = bn * S * E                                           # this column block's S partials
            mine = blk + ks * E
            for i in cutlass.range_constexpr(frag):
                r, t = tCc[i]
                if t < M:
                    mWs[mine + t * rows + r] = acc[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
            if tidx == 0:
                ticket[0] = cute.arch.atomic_add(mCnt.iterator + bn, Int32(1), sem="acq_rel", scope="gpu")
                if cutlass.const_expr(spread):
                    wait_at_least(mCnt.iterator + bn, Int32(S))         # every split has written
            cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
            nv = M * (rows // 4)                                       # 4-float vectors of real tokens
            if cutlass.const_expr(spread):
                fold_slice(mY, mWs, blk, bn, (ks * nv) // S, ((ks + 1) * nv) // S, tidx)
                cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
                if tidx == 0:                                          # the last one out resets it
                    done = cute.arch.atomic_add(mCnt.iterator + bn, Int32(1), sem="relaxed", scope="gpu")
                    if done == 2 * S - 1:
                        mCnt[bn] = Int32(0)
            else:
                if ticket[0] == S - 1:                                 # last CTA of this column block
                    fold_slice(mY, mWs, blk, bn, Int32(0), nv, tidx)
                    if tidx == 0:
                        mCnt[bn] = Int32(0)

        @cute.jit
        def fold_slice(mY: cute.Tensor, mWs: cute.Tensor, blk: Int32, bn: Int32, lo: Int32, hi: Int32,
                       tidx: Int32):
            """Outputs [4 lo, 4 hi) of the block's token-major M x rows: sum the S partials in ks order."""
            cute.arch.fence_acq_rel_gpu()
            vec4 = cute.make_layout(4)
            sum4 = cute.make_rmem_tensor(vec4, Float32)
            for v in cutlass.range(lo + tidx, hi, CONSUMER_THREADS, unroll=1):
                e = v * 4
                src = cute.make_ptr(Float32, (mWs.iterator + (blk + e)).toint(), cute.AddressSpace.gmem,
                                    assumed_align=16)                  # 16-byte aligned: e % 4 == 0
                tot = cute.make_tensor(src, vec4).load()
                for s in cutlass.range_constexpr(1, S):
                    tot = tot + cute.make_tensor(src + s * E, vec4).load()
                sum4.store(tot)
                t = e // rows
                c = bn * rows + (e - t * rows)
                for j in cutlass.range_constexpr(4):
                    mY[t, c + j] = sum4[j].to(mY.element_type)

        @cute.jit
        def fold_cluster(acc: cute.Tensor, tCc: cute.Tensor, mY: cute.Tensor, peer_buf: cute.Pointer, n0: Int32,
                         ks: Int32, tidx: Int32, M: Int32):
            """folds "cluster" / "cspread": every CTA of the cluster stores fragment element i of its
            partial into the stage buffers of the CTA that owns i (CTA 0 for "cluster"; CTA i*S//frag
            for "cspread"), at slot (i - first owned, ks); each owner adds its elements' S partials in
            ks order and stores them. The first cluster barrier (every CTA past its main loop, so the
            stages are free) pairs with the producer warp's; the second publishes the stores (arrive
            release, wait acquire)."""
            cute.arch.fence_view_async_shared()                    # wgmma's reads of the stages are done
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            for i in cutlass.range_constexpr(frag):
                j = owner(i)
                slot = ((i - first_owned(j)) * S + ks) * CONSUMER_THREADS + tidx
                st_cluster(cute.arch.map_dsmem_ptr(peer_buf + slot, j), acc[i])
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            for i in cutlass.range_constexpr(frag):
                j = owner(i)
                if ks == j:
                    parts = cute.make_tensor(peer_buf + (i - first_owned(j)) * S * CONSUMER_THREADS + tidx,
                                             cute.make_layout(S, stride=CONSUMER_THREADS))
                    tot = parts[0]
                    for p in cutlass.range_constexpr(1, S):              # ((p0 + p1) + p2) + ...
                        tot = tot + parts[p]
                    r, t = tCc[i]
                    if t < M and r < cols:
                        mY[t, n0 + r] = tot.to(mY.element_type)

        @cute.jit
        def fold_push(acc: cute.Tensor, tCc: cute.Tensor, mY: cute.Tensor, recv: cute.Pointer,
                      fbar: cute.Pointer, n0: Int32, ks: Int32, tidx: Int32, M: Int32):
            """fold "cpush": cspread's dealing without its two cluster barriers. Every CTA pushes fragment
            element i of its partial into the receive buffer of the CTA that owns i (CTA i*S//frag): chunk
            c = e // vw of its owned elements (e = i - first owned) at word ((ks * n_chunks + c) * 128 +
            tidx) * vw, one st.async of vw floats completing its bytes on the owner's fold mbarrier; each
            owner waits on its own mbarrier (acquire at cluster scope) for the owned x S x 128 floats,
            reads each chunk's S partials as vectors and adds them in ks order: cspread's adds. The buffer is its own, not the stages, so no
            peer has to finish its main loop first; a peer has to have started and initialised its
            mbarrier (the entry arrive, waited here). No closing barrier: an owner exits only once every
            store into it has landed."""
            cute.arch.cluster_wait()
            if tidx == 0:
                owned = ((ks + 1) * frag + S - 1) // S - (ks * frag + S - 1) // S
                cute.arch.mbarrier_arrive_and_expect_tx(fbar, owned * (S * CONSUMER_THREADS * 4))
            for j in cutlass.range_constexpr(S):
                lo, hi = first_owned(j), first_owned(j + 1)
                peer_bar = cute.arch.map_dsmem_ptr(fbar, j)
                for e in cutlass.range_constexpr(0, hi - lo, vw):
                    dst = cute.arch.map_dsmem_ptr(recv + ((ks * n_chunks + e // vw) * CONSUMER_THREADS + tidx) * vw, j)
                    runtime.st_async_cluster(dst, [acc[lo + e + u] for u in range(vw)], peer_bar)
            runtime.wait_cluster_phase0(fbar)
            vec = cute.make_layout(vw)
            sums = cute.make_rmem_tensor(vec, Float32)
            for j in cutlass.range_constexpr(S):
                if ks == j:
                    lo, hi = first_owned(j), first_owned(j + 1)
                    for e in cutlass.range_constexpr(0, hi - lo, vw):
                        def part(p):                                     # chunk e // vw of partial p
                            at = recv + ((p * n_chunks + e // vw) * CONSUMER_THREADS + tidx) * vw
                            return cute.make_tensor(cute.make_ptr(Float32, at.toint(), cute.AddressSpace.smem,
                                                                  assumed_align=4 * vw), vec).load()
                        tot = part(0)
                        for p in cutlass.range_constexpr(1, S):          # ((p0 + p1) + p2) + ...
                            tot = tot + part(p)
                        sums.store(tot)
                        for u in cutlass.range_constexpr(vw):
                            r, t = tCc[lo + e + u]
                            if t < M and r < cols:
                                mY[t, n0 + r] = sums[u].to(mY.element_type)

        @cute.jit
        def store(acc: cute.Tensor, tCc: cute.Tensor, mY: cute.Tensor, n0: Int32, M: Int32):
            """y[t, n0 + r] for the real tokens and, with overlapping tiles, the CTA's own columns."""
            for i in cutlass.range_constexpr(frag):
                r, t = tCc[i]
                if cutlass.const_expr(cols == rows):
                    if t < M:
                        mY[t, n0 + r] = acc[i].to(mY.element_type)
                else:
                    if t < M and r < cols:
                        mY[t, n0 + r] = acc[i].to(mY.element_type)

        @cute.jit
        def epilogue(acc: cute.Tensor, tCc: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
                     mCnt: cute.Tensor, ticket: cute.Tensor, peer_buf: cute.Pointer, recv: cute.Pointer,
                     fbar: cute.Pointer, bn: Int32, ks: Int32, tidx: Int32, M: Int32):
            """Consumer threads: store y, or fold the split-K partials (by the caller, inside the cluster,
            or through the workspace)."""
            n0 = bn * cols
            if cutlass.const_expr(S == 1):
                store(acc, tCc, mY, n0, M)
            elif cutlass.const_expr(to_caller):                # y[ks, M, N]: the caller folds
                for i in cutlass.range_constexpr(frag):
                    r, t = tCc[i]
                    if t < M:
                        mY[ks, t, n0 + r] = acc[i]
            elif cutlass.const_expr(push):
                fold_push(acc, tCc, mY, recv, fbar, n0, ks, tidx, M)
            elif cutlass.const_expr(fold in CLUSTER_FOLDS):
                fold_cluster(acc, tCc, mY, peer_buf, n0, ks, tidx, M)
            elif cutlass.const_expr(fold != "last"):
                fold_tokens(acc, tCc, mY, mWs, mCnt, ticket, bn, ks, tidx, M)
            else:
                base = (bn * S + ks) * (frag * CONSUMER_THREADS) + tidx    # fragment-major, thread-minor
                for i in cutlass.range_constexpr(frag):
                    mWs[base + i * CONSUMER_THREADS] = acc[i]
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
                if tidx == 0:
                    ticket[0] = cute.arch.atomic_add(mCnt.iterator + bn, Int32(1), sem="acq_rel", scope="gpu")
                cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
                if ticket[0] == S - 1:                                  # last CTA of this column block
                    cute.arch.fence_acq_rel_gpu()
                    first = bn * S * (frag * CONSUMER_THREADS) + tidx
                    for i in cutlass.range_constexpr(frag):
                        acc[i] = cute.arch.load(mWs.iterator + (first + i * CONSUMER_THREADS), Float32,
                                                cop="cg")
                    for s in cutlass.range(1, S, unroll=1):             # ks order: ((p0 + p1) + p2) + ...
                        part = first + s * (frag * CONSUMER_THREADS)
                        for i in cutlass.range_constexpr(frag):
                            acc[i] = acc[i] + cute.arch.load(mWs.iterator + (part + i * CONSUMER_THREADS),
                                                             Float32, cop="cg")
                    store(acc, tCc, mY, n0, M)
                    if tidx == 0:
                        mCnt[bn] = Int32(0)

        @cute.kernel
        def kernel(tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom, tX: cute.Tensor,
                   mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor, tiled_mma: cute.TiledMma,
                   w_sl: cute.ComposedLayout, x_sl: cute.ComposedLayout):
            tidx, _, _ = cute.arch.thread_idx()
            bn, ks, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            M = mY.shape[1] if cutlass.const_expr(to_caller) else mY.shape[0]
            if warp == 4:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
            storage = cutlass.memory.SmemAllocator().allocate(cfg.storage)
            if cutlass.const_expr(push):
                # the fold's mbarrier, initialised before any peer may push into this CTA: the cluster
                # arrive below (all threads, relaxed) is waited on just before the first push (fold_push)
                if tidx == 0:
                    cute.arch.mbarrier_init(storage.fbar.data_ptr(), 1)
                    cute.arch.mbarrier_init_fence()
                cute.arch.cluster_arrive_relaxed()
            sW = storage.sW.get_tensor(w_sl.outer, swizzle=w_sl.inner)
            sX = storage.sX.get_tensor(x_sl.outer, swizzle=x_sl.inner)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            kt0 = (ks * kt) // S
            nk = ((ks + 1) * kt) // S - kt0

            if warp == 4:                                          # producer warp: TMA loads
                if cutlass.const_expr(cols == rows):
                    gW = cute.local_tile(tW, (rows, bk), (bn, None))
                else:                                              # tiles start every `cols` rows
                    gW = cute.local_tile(cute.domain_offset((bn * cols, 0), tW), (rows, bk), (0, None))
                gX = cute.local_tile(tX, (cfg.cfg.m_pad, bk), (0, None))
                tWs, tWg = cute.nvgpu.cpasync.tma_partition(
                    tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                tXs, tXg = cute.nvgpu.cpasync.tma_partition(
                    tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for i in cutlass.range(nk, unroll=1):
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod)
                    cute.copy(tma_w, tWg[(None, kt0 + i)], tWs[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_x, tXg[(None, kt0 + i)], tXs[(None, prod.index)], tma_bar_ptr=bar)
                    pipe.producer_commit(prod)
                    prod.advance()
                if cutlass.const_expr(push):                       # pairs the entry arrive
                    cute.arch.cluster_wait()
                elif cutlass.const_expr(fold in CLUSTER_FOLDS):    # the consumers' two cluster barriers
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
            else:                                                  # consumer warpgroup: wgmma
                thr = tiled_mma.get_slice(tidx)
                tCrW = tiled_mma.make_fragment_A(thr.partition_A(sW))
                tCrX = tiled_mma.make_fragment_B(thr.partition_B(sX))
                tCc = thr.partition_C(cute.make_identity_tensor((rows, cfg.cfg.m_pad)))
                acc = cute.make_rmem_tensor(tCc.shape, Float32)
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                if cutlass.const_expr(fresh):
                    part = cute.make_rmem_tensor(tCc.shape, Float32)
                for i in cutlass.range(nk, unroll=1):
                    pipe.consumer_wait(read)
                    warpgroup.fence()
                    if cutlass.const_expr(fresh):                  # the tile's chain from zero, then IEEE adds
                        for kb in cutlass.range_constexpr(nkb):
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb > 0)
                            cute.gemm(tiled_mma, part, tCrW[(None, None, kb, read.index)],
                                      tCrX[(None, None, kb, read.index)], part)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        for j in cutlass.range_constexpr(cute.size(acc)):
                            acc[j] = acc[j] + part[j]
                        pipe.consumer_release(done)
                        done.advance()
                    else:
                        for kb in cutlass.range_constexpr(nkb):
                            cute.gemm(tiled_mma, acc, tCrW[(None, None, kb, read.index)],
                                      tCrX[(None, None, kb, read.index)], acc)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)                    # stage i-1's wgmma has finished
                        if i > 0:
                            pipe.consumer_release(done)
                            done.advance()
                    read.advance()
                warpgroup.wait_group(0)
                peer_buf = cute.recast_ptr(storage.sW.data_ptr(), dtype=Float32)
                epilogue(acc, tCc, mY, mWs, mCnt, storage.ticket.get_tensor(cute.make_layout(4)), peer_buf,
                         storage.recv.data_ptr(), storage.fbar.data_ptr(), bn, ks, tidx, M)

        return kernel


def spin_wait_op():
    """wait_at_least(ptr, target): spin (ld.acquire.gpu, nanosleep back-off) until *ptr >= target; PTX
    loop in inline asm because the kernel bodies use no dynamic `while`."""
    cutlass, cute = runtime.cutlass_modules()
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    @dsl_user_op
    def wait_at_least(ptr, target, *, loc=None, ip=None):
        return Int32(llvm.inline_asm(
            Int32.mlir_type, [ptr.to_llvm_ptr(loc=loc, ip=ip), Int32(target).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .pred p;\n\tSPIN_WAIT:\n\tld.acquire.gpu.global.s32 $0, [$1];\n\t"
            "setp.lt.s32 p, $0, $2;\n\t@p nanosleep.u32 64;\n\t@p bra SPIN_WAIT;\n\t}",
            "=r,l,r", has_side_effects=True, loc=loc, ip=ip))

    return wait_at_least


def st_cluster_op():
    """st_cluster(dsmem_ptr, value): st.shared::cluster.f32 to a peer CTA's shared memory (CuTe DSL
    4.8 tensors cannot load or store through a distributed-shared-memory pointer)."""
    cutlass, cute = runtime.cutlass_modules()
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import dsl_user_op

    @dsl_user_op
    def st_cluster(ptr, value, *, loc=None, ip=None):
        llvm.inline_asm(None, [Int32(ptr.toint()).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
                        "st.shared::cluster.f32 [$0], $1;", "r,f", has_side_effects=True, loc=loc, ip=ip)

    return st_cluster


def compile_variant(dtype: str, out_dtype: str, N: int, K: int, cfg: SkinnyGemmWgmmaConfig):
    """Compile one variant: f(x[M,K], w[N,K], y[M,N] (fold "partials": fp32 [ksplit, M, N]), workspace
    fp32, counters int32), M dynamic.
    (skinny_gemm._compile caches it under the op "skinny_gemm".)"""
    if cfg.writes_partials and out_dtype != "float32":
        raise ValueError(f"variant: fold='partials' writes fp32 partials, not {out_dtype} ({cfg.name})")
    ws, cnt = workspace_shapes(N, cfg)
    m = runtime.sym_int()
    return runtime.compile_tvm_ffi(
        SkinnyGemmWgmma(N, K, cfg).jit_host(),
        runtime.fake_tensor(dtype, (m, K)),
        runtime.fake_tensor(dtype, (N, K)),
        runtime.fake_tensor(out_dtype, (cfg.ksplit, m, N) if cfg.writes_partials else (m, N), align=4),
        runtime.fake_tensor("float32", ws),
        runtime.fake_tensor("int32", cnt, align=4))


_buffers: dict[tuple, tuple] = {}


def buffers(device, N: int, K: int, cfg: SkinnyGemmWgmmaConfig):
    """(workspace, counters) for this variant on `device` and the current stream: allocated
    (counters zeroed) on first use and reused; the kernel leaves the counters at zero. One pair per
    stream: launches on one stream run in order, launches on two streams (a side-stream expert) may
    overlap and must not share a split-K workspace."""
    import torch

    key = (str(device), torch.cuda.current_stream(device).cuda_stream, N, K, cfg)
    hit = _buffers.get(key)
    if hit is None:
        ws, cnt = workspace_shapes(N, cfg)
        hit = (torch.empty(ws, dtype=torch.float32, device=device),
               torch.zeros(cnt, dtype=torch.int32, device=device))
        _buffers[key] = hit
    return hit


def check_launch(M: int, N: int, K: int, cfg: SkinnyGemmWgmmaConfig) -> None:
    validate(N, K, cfg)
    if M > cfg.m_pad:
        raise ValueError(f"x: M={M} is over the variant's m_pad={cfg.m_pad} ({cfg.name}); use "
                         f"m_pad_for(M)={m_pad_for(M) if M <= 64 else 'none (M > 64)'}")


def resident_or_vec(device, N: int, cfg: SkinnyGemmWgmmaConfig) -> SkinnyGemmWgmmaConfig:
    """The "spread" fold spins until its split-K peers arrive, so its whole grid must be resident.
    `validate` checks that against the H200's 132 SMs; a device with fewer (an H100 PCIe has 114, an
    H20 78) runs the variant as "vec" instead, which folds the same partials in the same order on
    one CTA: the same bits, never a hang."""
    if cfg.fold != "spread":
        return cfg
    import dataclasses

    if num_ctas(N, cfg) <= runtime.sm_count(device) * cfg.occupancy:
        return cfg
    return dataclasses.replace(cfg, fold="vec")


def num_ctas(N: int, cfg: SkinnyGemmWgmmaConfig) -> int:
    return (N // cfg.cols) * cfg.ksplit


