"""router_topk's top-k device code (fused/router_topk.py launches it).

The top-k kernel. Default (`cta_thresh_w4`): a token's experts over 4 warps, thread t
holding experts t, t+128, ... (7 at E = 896) with their sigmoids. Each expert gets a total-order key
(the choice's fp32 bits made signed-monotone, -0 as +0, above E-1-id: larger choice first, on equal
choice the lower id). The k-th best of the threads' maxima is a lower bound of the k-th best expert
(the k threads with the best maxima hold k distinct experts at or above it), so only the experts at
or above it can be in the top k: at most k x 7. They are gathered in shared memory, and each one's
rank among them (a count of better keys) is its place in the top k: four barriers instead of k
rounds (property_tests/test_router_select_bound.py checks the bound argument on the CPU).
The argmax rounds (`cta_argmax_w4`, and `warp_argmax_t*`: one warp
per token, lane l holding l, l+32, ...): a round takes the thread's best by a select tree (strict >,
so the lower id wins a tie inside a thread), then a butterfly argmax that prefers the larger choice
and, on equal choice, the lower id, carrying the winner's sigmoid; with several warps the warps'
winners meet in shared memory (one barrier per round, double-buffered by round parity) and are
combined by the same rule; the owner drops the winner. Both ways give the ids in descending order,
as the reference's stable descending sort gives them. Thread r keeps round r's id and s; the
token's first warp sums them (warp reduction) and writes weights s / (sum + 1e-20) * routed_scale.
Every top-k kernel computes the same sigmoids and the same sum, so they agree bit for bit.
Launch: grid ceil(B / tokens_per_cta), 32 x tokens_per_cta x warps_per_token threads per CTA.
"""
import operator

from fused import runtime

RENORM_EPS = 1e-20
RANK_LANES = 4          # independent partial counts in the threshold select's rank loops (r0..r3)
PRELOAD_MAX = 64        # logit partials per thread up to which all are loaded before any sigmoid


def make_select(E: int, k: int, S: int, tokens_per_cta: int, warps_per_token: int, select_kind: str):
    """The top-k device code as a @cute.jit function select(mLogit, mBias, mIds, mW, routed_scale,
    bidx) for E experts, the top k, S logit partials; `select_kind` "threshold" or "rounds"."""
    cutlass, cute = runtime.cutlass_modules()
    from cutlass import Float32, Int32, Int64

    tpc, wpt, T = tokens_per_cta, warps_per_token, 32 * warps_per_token
    pl = -(-E // T)                                  # experts per thread
    thresh = select_kind == "threshold"
    cap = k * pl                                     # candidates at most (threshold_select)
    preload = S * pl <= PRELOAD_MAX                  # every load in registers before the arithmetic

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
        rounds give them (thread t < k of the first warp). The counts run in RANK_LANES independent
        sums (short dependent add chains); a thread takes one slot range for all its candidates."""
        keys = cute.make_rmem_tensor(cute.make_layout(pl), Int64)
        mk = Int64(MIN_KEY)
        for j in cutlass.range_constexpr(pl):
            keys[j] = Int64(MIN_KEY)
            if j * T + t < E:
                keys[j] = key_of(choice[j], Int32(j * T) + t)
                mk = Int64(cutlass.select_(keys[j] > mk, keys[j], mk))
        tk[t] = mk
        for i in cutlass.range_constexpr(-(-(cap + RANK_LANES) // T)):
            if i * T + t < cap + RANK_LANES:
                ck[i * T + t] = Int64(MIN_KEY)           # padding past the candidates ranks below all
        if t == 0:
            tcnt[0] = Int32(0)
            tbound[0] = Int64(MIN_KEY)
        cute.arch.sync_threads()
        part = [Int32(0)] * RANK_LANES
        for u in cutlass.range_constexpr(T):
            part[u % RANK_LANES] = part[u % RANK_LANES] + Int32(cutlass.select_(tk[u] > mk, 1, 0))
        above = (part[0] + part[1]) + (part[2] + part[3])
        if above == Int32(k - 1) and mk > Int64(MIN_KEY):
            tbound[0] = mk                               # the k-th best thread maximum
        cute.arch.sync_threads()
        bound = tbound[0]
        mine = Int32(0)
        for j in cutlass.range_constexpr(pl):
            if j * T + t < E:
                mine = mine + Int32(cutlass.select_(keys[j] >= bound, 1, 0))
        slot = Int32(0)
        if mine > Int32(0):
            slot = cute.arch.atomic_add(tcnt.iterator, mine, scope="cta")
        for j in cutlass.range_constexpr(pl):
            if j * T + t < E:
                if keys[j] >= bound:
                    ck[slot] = keys[j]
                    cs[slot] = sig[j]
                    slot = slot + Int32(1)
        cute.arch.sync_threads()
        n = tcnt[0]
        for i in cutlass.range(t, n, T):
            key = ck[i]
            r0, r1, r2, r3 = Int32(0), Int32(0), Int32(0), Int32(0)
            for m in cutlass.range(0, n, RANK_LANES):
                r0 = r0 + Int32(cutlass.select_(ck[m] > key, 1, 0))
                r1 = r1 + Int32(cutlass.select_(ck[m + 1] > key, 1, 0))
                r2 = r2 + Int32(cutlass.select_(ck[m + 2] > key, 1, 0))
                r3 = r3 + Int32(cutlass.select_(ck[m + 3] > key, 1, 0))
            rank = (r0 + r1) + (r2 + r3)
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
        """The top-k of CTA `bidx`'s tokens (tokens_per_cta of them): fold, sigmoid + bias, the
        select, renormalised weights. Every thread of the CTA must call it (barriers)."""
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
            ck = smem.allocate_tensor(Int64, cute.make_layout(cap + RANK_LANES), byte_alignment=16)   # candidates' keys
            cs = smem.allocate_tensor(Float32, cute.make_layout(cap), byte_alignment=16)    # and sigmoids
            oid = smem.allocate_tensor(Int32, cute.make_layout(k), byte_alignment=16)       # rank -> id
            osig = smem.allocate_tensor(Float32, cute.make_layout(k), byte_alignment=16)    # rank -> sigmoid
            tbound = smem.allocate_tensor(Int64, cute.make_layout(1), byte_alignment=16)
            tcnt = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
        if b < mLogit.shape[1]:
            choice = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
            sig = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
            if cutlass.const_expr(preload):
                # every logit partial and bias load before the first sigmoid: the IEEE division's
                # slow-path branch would otherwise keep later loads behind earlier divisions
                part = cute.make_rmem_tensor(cute.make_layout((S, pl)), Float32)
                bias = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
                for j in cutlass.range_constexpr(pl):
                    if j * T + t < E:
                        for s in cutlass.range_constexpr(S):
                            part[s, j] = mLogit[s, b, j * T + t]
                        bias[j] = mBias[j * T + t]
            for j in cutlass.range_constexpr(pl):
                choice[j] = Float32(-float("inf"))
                sig[j] = Float32(0.0)
                e = j * T + t
                if e < E:
                    if cutlass.const_expr(preload):
                        lg = part[0, j]
                        for s in cutlass.range_constexpr(1, S):
                            lg = lg + part[s, j]             # the S partials folded in order
                        bj = bias[j]
                    else:
                        lg = logit(mLogit, b, e)
                        bj = mBias[e]
                    sv = Float32(1.0) / (Float32(1.0) + cute.math.exp(-lg))
                    sig[j] = sv
                    choice[j] = sv + bj
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
