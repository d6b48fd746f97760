"""router_topk: fp32 router logits, sigmoid, + bias, exact top-k, renormalised weights.

Two launches on the caller's stream: (1) a skinny_gemm kernel writes fp32 logit partials
ws[S, B, E] (bf16 products are exact in fp32; fp32 accumulation); (2) the top-k kernel folds the S
partials in order s = 0..S-1 (IEEE fp32 adds), then selects the top k of
choice = sigmoid(logit) + bias by k rounds of argmax.

The logits GEMM (`logits_config`): the SIMT GEMV (S = 1, IEEE FMA chains) up to M = SIMT_MAX tokens;
above it the tensor-core kernel with split-K over S CTAs (`split_for`, so 56 x S CTAs fill the 132
SMs at E = 896; per-M choice measured on the H200, results/gpu/router_topk.md) and `fresh_acc`: each
mma.sync sums its 16 products into zeroed fragments that are added to the fp32 accumulator with
IEEE adds. Accumulating straight in the MMA's C fragment was measured on the H200
(results/gpu/router_topk.md): the tensor core aligns and truncates its addends to the largest one,
so a 448-MMA chain over D = 7168 erred 3x more than the fp32 reference and failed the weights'
derived bound at every M >= 9. The logit selects experts: it is held to fp32 accuracy, not to a
bf16 GEMM's.

The top-k kernel. Default (`cta_thresh_w4`, session 5): a token's experts over 4 warps, thread t
holding experts t, t+128, ... (7 at E = 896) with their sigmoids. Each expert gets a total-order key
(the choice's fp32 bits made signed-monotone, -0 as +0, above E-1-id: larger choice first, on equal
choice the lower id). The k-th best of the threads' maxima is a lower bound of the k-th best expert
(the k threads with the best maxima hold k distinct experts at or above it), so only the experts at
or above it can be in the top k: at most k x 7. They are gathered in shared memory, and each one's
rank among them (a count of better keys) is its place in the top k: four barriers instead of k
rounds (the round kernel's top-k took 5.9 us of device time at B = 1 on the H200, more than the
logits GEMM; property_tests/test_router_select_bound.py checks the bound argument on the CPU).
The argmax rounds (`cta_argmax_w4`, the default until session 5, and `warp_argmax_t*`: one warp
per token, lane l holding l, l+32, ...): a round takes the thread's best by a select tree (strict >,
so the lower id wins a tie inside a thread), then a butterfly argmax that prefers the larger choice
and, on equal choice, the lower id, carrying the winner's sigmoid; with several warps the warps'
winners meet in shared memory (one barrier per round, double-buffered by round parity) and are
combined by the same rule; the owner drops the winner. Both ways give the ids in descending order,
as the reference's stable descending sort gives them. Thread r keeps round r's id and s; the
token's first warp sums them (warp reduction) and writes weights s / (sum + 1e-20) * routed_scale.
Every top-k kernel computes the same sigmoids and the same sum, so they agree bit for bit.

The top-k device code is one @cute.jit function (`RouterTopk.device_select`) that the top-k kernel
and the experimental one-launch router (fused/router_topk_fused.py: logits GEMM, grid-wide ticket,
top-k in one kernel) both inline; the shipped kernels' PTX is pinned by
property_tests/test_router_topk_fused.py.
"""
import operator
from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg
from fused import skinny_gemm_mma as mma
from fused.skinny_gemm_mma import SkinnyGemmMmaConfig

DTYPES = ("bfloat16", "float16")   # working dtypes of x and w (the harness draws only these)

RENORM_EPS = 1e-20


SIMT_MAX = 1                        # tokens up to which the SIMT GEMV computes the logits


def split_for(D: int, m_pad: int = 8) -> int:
    """K-split of the tensor-core logits: the largest of 7, 4, 2 leaving >= 16 k-steps of 32 per CTA
    (4 first at 64 tokens, where the accumulators fill the registers: measured 13.4 us vs 16.6 at 7)."""
    steps = D // mma.KSTEP
    for S in ((4, 7, 2) if m_pad == 64 else (7, 4, 2)):
        if steps % S == 0 and steps // S >= 16:
            return S
    return 1


def mma_logits_config(M: int, E: int, D: int) -> SkinnyGemmMmaConfig | None:
    """The split-K, fresh-accumulator tensor-core config for M tokens, or None where it does not apply.
    16 weight rows per CTA where E allows (E = 896: 56 x S CTAs), measured faster than 8 at every M
    (results/gpu/router_topk.md)."""
    if not (2 <= M <= 64 and mma.supports(D) and E % 8 == 0):
        return None
    pad = mma.m_pad_for(M)
    S = split_for(D, pad)
    w = mma.warps_for(D // S)
    rows = 16 if E % 16 == 0 else 8
    return SkinnyGemmMmaConfig(pad, rows, w, mma._unroll(D // S, w, pad), True, S, True)


def logits_config(M: int, E: int, D: int):
    if M > SIMT_MAX:
        cfg = mma_logits_config(M, E, D)
        if cfg is not None:
            return cfg
    return sg.simt_config(max(M, 1), E, D)


@dataclass(frozen=True)
class RouterTopkConfig:
    tokens_per_cta: int = 1          # tokens per CTA
    gemm: object = None              # logits GEMM config; None: logits_config(M, E, D)
    warps_per_token: int = 4         # 1: a warp per token; 4: a token's experts over 128 threads
    pdl: bool = False                # top-k kernel as a programmatic dependent launch (experimental)
    one_launch: bool = False         # logits GEMM + top-k in one kernel (router_topk_fused; experimental)
    select: str = "threshold"        # "threshold": rank the experts above a bound; "rounds": k argmax rounds
    bound: str = "cta"               # threshold: the k-th best thread maximum of the CTA, or of each warp

    @property
    def name(self) -> str:
        base = (f"warp_argmax_t{self.tokens_per_cta}" if self.warps_per_token == 1
                else f"cta_argmax_w{self.warps_per_token}")
        if self.select == "threshold":
            base = f"cta_thresh_w{self.warps_per_token}" + ("_wb" if self.bound == "warp" else "")
        base = "one_launch" if self.one_launch else base
        return base + ("_pdl" if self.pdl else "") + (f"+{self.gemm.name}" if self.gemm is not None else "")


def all_configs() -> list[RouterTopkConfig]:
    """The default (threshold select over 4 warps), the argmax rounds over 4 warps (the default until
    session 5), and the rounds with one warp per token (4 tokens or 1 per CTA)."""
    return [RouterTopkConfig(1, None, 4), RouterTopkConfig(1, None, 4, select="rounds"),
            RouterTopkConfig(4, None, 1, select="rounds"), RouterTopkConfig(1, None, 1, select="rounds")]


def experimental_variants(tensors: dict, params: dict) -> list:
    """Launch variants to measure on the H200 before they may ship (not certified, never picked):
    the default top-k kernel launched as a programmatic dependent of the logits GEMM (PDL). Its grid
    is launched while the GEMM drains; it loads its bias values, then waits (griddepcontrol.wait)
    for the GEMM's results before reading a logit. It hides the second launch's latency. And the
    one-launch router (fused/router_topk_fused.py): the GEMM's CTAs arrive on a grid-wide counter,
    the last ones then run the top-k; the same bits as the two launches, which it falls back to
    where its waiting CTAs would not leave an SM free. And the threshold select over 2, 4 or 8 warps
    with each warp's k-th best thread maximum as its bound (32 compares a thread instead of
    32 x warps; more candidates), and over 8 warps with the CTA's bound."""
    return [RouterTopkConfig(1, None, 4, pdl=True, select="rounds"),
            RouterTopkConfig(1, None, 4, one_launch=True, select="rounds"),
            *[RouterTopkConfig(1, None, w, bound="warp") for w in (2, 4, 8)], RouterTopkConfig(1, None, 8)]


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs: both top-k tilings with the
    default logits GEMM, and the other logits path (SIMT <-> split-K MMA) where this M allows it."""
    M, D = tensors["x"].shape
    E = tensors["w_gate"].shape[0]
    out = all_configs()
    default = logits_config(M, E, D)
    other = sg.simt_config(max(M, 1), E, D) if isinstance(default, SkinnyGemmMmaConfig) else mma_logits_config(M, E, D)
    if other is not None:
        out.append(RouterTopkConfig(1, other, 4))
    return out


class RouterTopk:
    def __init__(self, E: int, top_k: int, cfg: RouterTopkConfig, S: int = 1):
        if not 1 <= top_k <= min(32, E):
            raise ValueError(f"top_k: {top_k} must be in 1..{min(32, E)} for the warp kernel")
        if cfg.warps_per_token not in (1, 2, 4, 8) or (cfg.warps_per_token > 1 and cfg.tokens_per_cta != 1):
            raise ValueError(f"variant: {cfg}: warps_per_token in 1, 2, 4, 8; several warps need one token per CTA")
        if cfg.select not in ("rounds", "threshold") or (cfg.select == "threshold" and (
                cfg.tokens_per_cta != 1 or cfg.pdl or cfg.one_launch)):
            raise ValueError(f"variant: {cfg}: select is 'rounds' or 'threshold' (one token per CTA, no PDL)")
        if cfg.bound not in ("cta", "warp") or (cfg.bound == "warp" and cfg.select != "threshold"):
            raise ValueError(f"variant: {cfg}: bound is 'cta' or 'warp' (threshold select only)")
        self.E, self.k, self.cfg, self.S = E, top_k, cfg, S
        self.threads_per_token = 32 * cfg.warps_per_token
        self.per_lane = -(-E // self.threads_per_token)

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        tpc, wpt = self.cfg.tokens_per_cta, self.cfg.warps_per_token

        @cute.jit
        def host(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                 routed_scale: cutlass.Float32, stream):
            B = mLogit.shape[1]
            if cutlass.const_expr(self.cfg.pdl):
                kernel(mLogit, mBias, mIds, mW, routed_scale).launch(
                    grid=[(B + tpc - 1) // tpc, 1, 1], block=[32 * tpc * wpt, 1, 1], stream=stream,
                    use_pdl=True)
            else:
                kernel(mLogit, mBias, mIds, mW, routed_scale).launch(
                    grid=[(B + tpc - 1) // tpc, 1, 1], block=[32 * tpc * wpt, 1, 1], stream=stream)

        return host

    def device_select(self):
        """The top-k device code as a @cute.jit function select(mLogit, mBias, mIds, mW, routed_scale,
        bidx), inlined into whichever kernel calls it."""
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32, Int64

        E, k, pl, tpc, S = self.E, self.k, self.per_lane, self.cfg.tokens_per_cta, self.S
        wpt, T, pdl = self.cfg.warps_per_token, self.threads_per_token, self.cfg.pdl
        thresh = self.cfg.select == "threshold"
        wbound = self.cfg.bound == "warp"
        cap = k * pl * (wpt if wbound else 1)            # candidates at most (threshold_select)

        @cute.jit
        def logit(mLogit: cute.Tensor, b, e):
            v = mLogit[0, b, e]
            for s in cutlass.range_constexpr(1, S):
                v = v + mLogit[s, b, e]                  # the S partials folded in order
            return v

        def pick(take, a, b):
            """b where `take`, else a, for (value, id, s) triples."""
            return (Float32(cutlass.select_(take, b[0], a[0])), Int32(cutlass.select_(take, b[1], a[1])),
                    Float32(cutlass.select_(take, b[2], a[2])))

        def better(a, b):
            """(value, id, s) of the winner when a's id is known to be lower: larger value, else a."""
            return pick(b[0] > a[0], a, b)

        def prefer(a, b):
            """The winner by the declared rule for ids in any order: larger value, on equal the lower id."""
            return pick((b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1])), a, b)

        MIN_KEY = -(1 << 63)

        def key_of(c, e):
            """A total-order key of (choice c, id e), larger is better: the fp32 bits made
            signed-monotone (-0 taken as +0, so equal choices compare equal) above E-1-e, so an equal
            choice ranks the lower id first: the declared tie-break of the argmax rounds."""
            bits = Float32(cutlass.select_(c == Float32(0.0), Float32(0.0), c)).bitcast(Int32)
            mono = Int32(cutlass.select_(bits >= Int32(0), bits, bits ^ Int32(0x7FFFFFFF)))
            return (Int64(mono) << Int64(32)) | Int64(Int32(E - 1) - e)

        @cute.jit
        def threshold_select(choice, sig, t, tk, tcnt, tbound, ck, cs, oid, osig):
            """The top k without k rounds. Each thread's best key; the k-th best of those (B) bounds the
            k-th best expert from below (the k threads with the best maxima hold k distinct experts >= B),
            so every expert of the top k, and every expert better than one of them, has key >= B: at
            most k * per_lane candidates. Each candidate's rank among the candidates is its rank among
            all experts; rank r < k is written to slot r. Returns (id, sigmoid) of round t, as the
            rounds give them (thread t < k of the first warp)."""
            keys = cute.make_rmem_tensor(cute.make_layout(pl), Int64)
            mk = Int64(MIN_KEY)
            for j in cutlass.range_constexpr(pl):
                keys[j] = Int64(MIN_KEY)
                if j * T + t < E:
                    keys[j] = key_of(choice[j], Int32(j * T) + t)
                    mk = Int64(cutlass.select_(keys[j] > mk, keys[j], mk))
            tk[t] = mk
            if t == 0:
                tcnt[0] = Int32(0)
            if t < (wpt if wbound else 1):
                tbound[t] = Int64(MIN_KEY)
            cute.arch.sync_threads()
            above = Int32(0)
            if cutlass.const_expr(wbound):
                # the k-th best maximum of each warp's 32 threads bounds the k-th best expert as well
                # (k <= 32: warp 0 always holds k experts); the best of the warps' bounds is the bound,
                # and each warp has at most k threads at or above it: <= wpt * k * per_lane candidates
                w0 = (t // 32) * 32
                for u in cutlass.range_constexpr(32):
                    above = above + Int32(cutlass.select_(tk[w0 + u] > mk, 1, 0))
                if above == Int32(k - 1) and mk > Int64(MIN_KEY):
                    tbound[t // 32] = mk
            else:
                for u in cutlass.range_constexpr(T):
                    above = above + Int32(cutlass.select_(tk[u] > mk, 1, 0))
                if above == Int32(k - 1) and mk > Int64(MIN_KEY):
                    tbound[0] = mk                           # the k-th best thread maximum
            cute.arch.sync_threads()
            bound = tbound[0]
            if cutlass.const_expr(wbound):
                for w in cutlass.range_constexpr(1, wpt):
                    bound = Int64(cutlass.select_(tbound[w] > bound, tbound[w], bound))
            for j in cutlass.range_constexpr(pl):
                if j * T + t < E:
                    if keys[j] >= bound:
                        slot = cute.arch.atomic_add(tcnt.iterator, Int32(1), scope="cta")
                        ck[slot] = keys[j]
                        cs[slot] = sig[j]
            cute.arch.sync_threads()
            n = tcnt[0]
            for i in cutlass.range(t, n, T):
                key = ck[i]
                rank = Int32(0)
                for m in cutlass.range(n, unroll=4 if wbound else 1):
                    rank = rank + Int32(cutlass.select_(ck[m] > key, 1, 0))
                if rank < Int32(k):
                    oid[rank] = Int32(E - 1) - Int32(key & Int64(0xFFFFFFFF))
                    osig[rank] = cs[i]
            cute.arch.sync_threads()
            rid = Int32(0)
            rs = Float32(0.0)
            if t < k:
                rid = oid[t]
                rs = osig[t]
            return rid, rs

        def tree_best(cand):
            """Pairwise tree of `better` over (value, id, s) in ascending id order (depth log2 len)."""
            while len(cand) > 1:
                cand = [better(cand[i], cand[i + 1]) if i + 1 < len(cand) else cand[i]
                        for i in range(0, len(cand), 2)]
            return cand[0]

        @cute.jit
        def select(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                   routed_scale: Float32, bidx: Int32):
            """The top-k of CTA `bidx`'s tokens (tokens_per_cta of them): fold, sigmoid + bias, k
            argmax rounds, renormalised weights. Called by `kernel` and by the one-launch router
            (fused/router_topk_fused.py); every thread of the CTA must call it (barriers)."""
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            b = bidx * tpc + warp // wpt
            t = (warp % wpt) * 32 + lane                 # thread within the token: experts t, t+T, ...
            if cutlass.const_expr(wpt > 1 and not thresh):
                smem = cutlass.memory.SmemAllocator()
                xv = smem.allocate_tensor(Float32, cute.make_layout((2, wpt)), byte_alignment=16)
                xi = smem.allocate_tensor(Int32, cute.make_layout((2, wpt)), byte_alignment=16)
                xs = smem.allocate_tensor(Float32, cute.make_layout((2, wpt)), byte_alignment=16)
            if cutlass.const_expr(thresh):
                smem = cutlass.memory.SmemAllocator()
                tk = smem.allocate_tensor(Int64, cute.make_layout(T), byte_alignment=16)        # threads' best keys
                ck = smem.allocate_tensor(Int64, cute.make_layout(cap), byte_alignment=16)      # candidates' keys
                cs = smem.allocate_tensor(Float32, cute.make_layout(cap), byte_alignment=16)    # and sigmoids
                oid = smem.allocate_tensor(Int32, cute.make_layout(k), byte_alignment=16)       # rank -> id
                osig = smem.allocate_tensor(Float32, cute.make_layout(k), byte_alignment=16)    # rank -> sigmoid
                tbound = smem.allocate_tensor(Int64, cute.make_layout(wpt), byte_alignment=16)  # per warp (wb)
                tcnt = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
            if b < mLogit.shape[1]:
                if cutlass.const_expr(pdl):
                    bias = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
                    for j in cutlass.range_constexpr(pl):
                        if j * T + t < E:
                            bias[j] = mBias[j * T + t]
                    cute.arch.griddepcontrol_wait()      # the logits GEMM's results are visible from here
                choice = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
                sig = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
                for j in cutlass.range_constexpr(pl):
                    choice[j] = Float32(-float("inf"))
                    sig[j] = Float32(0.0)
                    e = j * T + t
                    if e < E:
                        sv = Float32(1.0) / (Float32(1.0) + cute.math.exp(-logit(mLogit, b, e)))
                        sig[j] = sv
                        if cutlass.const_expr(pdl):
                            choice[j] = sv + bias[j]
                        else:
                            choice[j] = sv + mBias[e]
                my_id = Int32(0)
                my_s = Float32(0.0)
                if cutlass.const_expr(thresh):
                    my_id, my_s = threshold_select(choice, sig, t, tk, tcnt, tbound, ck, cs, oid, osig)
                for r in cutlass.range_constexpr(0 if thresh else k):
                    # the thread's best by a tree over its experts (ids j*T+t rise with j), a butterfly
                    # argmax over the warp carrying the winner's sigmoid along, then (several warps
                    # per token) the warps' winners through shared memory, double-buffered by round
                    best, bid, bs = tree_best([(choice[j], Int32(j * T) + t, sig[j]) for j in range(pl)])
                    for sh in cutlass.range_constexpr(5):
                        best, bid, bs = prefer((best, bid, bs), tuple(
                            cute.arch.shuffle_sync_bfly(v, offset=1 << sh) for v in (best, bid, bs)))
                    if cutlass.const_expr(wpt > 1):
                        if lane == 0:
                            xv[r % 2, warp] = best
                            xi[r % 2, warp] = bid
                            xs[r % 2, warp] = bs
                        cute.arch.sync_threads()
                        best, bid, bs = xv[r % 2, 0], xi[r % 2, 0], xs[r % 2, 0]
                        for w in cutlass.range_constexpr(1, wpt):
                            best, bid, bs = prefer((best, bid, bs), (xv[r % 2, w], xi[r % 2, w], xs[r % 2, w]))
                    for j in cutlass.range_constexpr(pl):
                        choice[j] = Float32(cutlass.select_(bid == Int32(j * T) + t, Float32(-float("inf")), choice[j]))
                    if t == r:
                        my_id = bid
                        my_s = bs
                if t < 32:                               # the token's first warp holds rounds 0..k-1
                    total = cute.arch.warp_reduction(my_s if t < k else Float32(0.0), operator.add)
                    if t < k:
                        mIds[b, t] = Int64(my_id)
                        mW[b, t] = my_s / (total + Float32(RENORM_EPS)) * routed_scale

        return select

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32
        select = self.device_select()

        @cute.kernel
        def kernel(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                   routed_scale: Float32):
            bidx, _, _ = cute.arch.block_idx()
            select(mLogit, mBias, mIds, mW, routed_scale, bidx)

        return kernel


@runtime.compile_cache("router_topk")
def _compile(E: int, top_k: int, tokens_per_cta: int, S: int, warps_per_token: int = 1, pdl: bool = False,
             select: str = "rounds", bound: str = "cta"):
    cutlass, _ = runtime.cutlass_modules()
    b = runtime.sym_int()
    op = RouterTopk(E, top_k, RouterTopkConfig(tokens_per_cta, None, warps_per_token, pdl, select=select,
                                               bound=bound), S)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor("float32", (S, b, E), align=4),
        runtime.fake_tensor("float32", (E,), align=4),
        runtime.fake_tensor("int64", (b, top_k), align=8),
        runtime.fake_tensor("float32", (b, top_k), align=4),
        cutlass.Float32(1.0))


def compile_all_for(dtype: str, E: int, D: int, top_k: int, cfg: RouterTopkConfig) -> list:
    """Every compiled function a launch with this top-k config can use, for any M (CPU compile checks):
    the SIMT GEMV, the split-K tensor-core logits of each token bucket, and the top-k kernels."""
    tk = (cfg.tokens_per_cta, cfg.warps_per_token, cfg.pdl, cfg.select, cfg.bound)
    out = [sg._compile(dtype, "float32", E, D, sg.simt_config(1, E, D)), _compile(E, top_k, tk[0], 1, *tk[1:])]
    for M in (8, 16, 32, 64):
        g = mma_logits_config(M, E, D)
        if g is not None:
            out += [sg._compile(dtype, "float32", E, D, g), _compile(E, top_k, tk[0], g.ksplit, *tk[1:])]
    return out


def logits_workspace(B: int, E: int, D: int, device, gemm=None):
    import torch

    cfg = gemm or logits_config(B, E, D)
    S = getattr(cfg, "ksplit", 1)
    return torch.empty(S, B, E, dtype=torch.float32, device=device)


def launch(x, w_gate, bias, top_k, routed_scale, ids, weights, logits, variant=None) -> None:
    """logits: fp32 [S, B, E] from logits_workspace (S given by the logits GEMM config)."""
    B, D = x.shape
    E = w_gate.shape[0]
    if B == 0:
        return
    variant = variant or RouterTopkConfig()
    gemm = variant.gemm or logits_config(B, E, D)
    S = getattr(gemm, "ksplit", 1)
    if logits.shape != (S, B, E):
        raise ValueError(f"logits: expected the workspace [{S}, {B}, {E}], got {tuple(logits.shape)}")
    if variant.one_launch:
        from fused import router_topk_fused as one

        if one.fits(x.device, B, E, gemm):
            one.launch(x, w_gate, bias, top_k, routed_scale, ids, weights, logits, gemm)
            return
    sg.launch(x, w_gate, logits if S > 1 else logits[0], gemm)
    if variant.pdl:
        fn = _compile(E, top_k, variant.tokens_per_cta, S, variant.warps_per_token, True)
    else:
        fn = _compile(E, top_k, variant.tokens_per_cta, S, variant.warps_per_token, False, variant.select,
                      variant.bound)
    fn(logits, bias, ids, weights, float(routed_scale))


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("router_topk", mutates_args=("ids", "weights", "logits"))
        def router_topk_out(x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                            routed_scale: float, ids: torch.Tensor, weights: torch.Tensor,
                            logits: torch.Tensor) -> None:
            launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale,
                   ids, weights, logits)

        _op = router_topk_out
    return _op


def router_topk(x, w_gate, bias, top_k: int, routed_scale: float, *, variant=None):
    """Fused replacement of references.moe.router_topk (same signature): (ids int64, weights fp32)."""
    sg._check(x, w_gate)
    E = w_gate.shape[0]
    if bias.dtype != torch.float32 or tuple(bias.shape) != (E,):
        raise TypeError(f"bias: expected float32 [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= min(32, E):
        raise ValueError(f"top_k: {top_k!r} must be an int in 1..{min(32, E)} for the fused kernel")
    B = x.shape[0]
    ids = torch.empty(B, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(B, top_k, dtype=torch.float32, device=x.device)
    logits = logits_workspace(B, E, x.shape[1], x.device, variant.gemm if variant is not None else None)
    if variant is not None:
        launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale,
               ids, weights, logits, variant)
    else:
        _custom_op()(x, w_gate, bias, top_k, float(routed_scale), ids, weights, logits)
    return ids, weights
