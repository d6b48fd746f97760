"""moe_experts_mxfp4's fused kernel on a CUDA device: the spec's derived rule (k, floor ulps of
tolerance_specs/moe_experts_mxfp4.toml) against the float64 reference over a grid of edge shapes and
routings, every launch variant; run-to-run bits, batch position, CUDA graph replay, no recompile for a
new batch size; and a timing table at the K3 per-rank shapes (printed with -s).

    python3 -m pytest -q -s -m gpu property_tests/test_moe_experts_mxfp4_gpu.py
"""
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

K3_L, K3_I, K3_E, K3_K = 3584, 3072, 896, 16
E2M1_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)


def expert_weights(E, L, inter, seed, device="cuda"):
    """Uniform codes, scale bytes around the one that makes the values' std fan_in^-1/2 (+-2)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def one(O, fan_in):
        base = 127 + round(math.log2(1.0 / (math.sqrt(fan_in) * E2M1_RMS)))
        packed = torch.randint(0, 256, (E, O, fan_in // 2), generator=g, device=device, dtype=torch.uint8)
        scale = torch.randint(base - 2, base + 3, (E, O, fan_in // 32), generator=g, device=device).to(torch.uint8)
        return packed, scale

    return (*one(2 * inter, L), *one(L, inter))


def routing(kind, B, E, k, seed, pad=True):
    """ids [B, k] int64 and fp32 weights (rows sum to 1) on the CPU, then the device.
    random: k distinct experts per token, 1 in 8 slots padding (-1, slot 0 real);
    same: every token the same k experts (own slot order); exclusive: token 0's experts chosen by no
    other token and token B-1's slot-0 expert by no other token; one token's weight 1 with the others
    near 0 (2^-20) and one exactly 0."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=g)
    if kind == "same":
        ids = torch.stack([perm[:k][torch.randperm(k, generator=g)] for _ in range(B)])
    elif kind == "exclusive":
        pool = perm[k + 1:]
        rows = [perm[:k]] + [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(B - 1)]
        ids = torch.stack(rows)
        if B > 1:
            ids[-1, 0] = perm[k]
    else:
        ids = torch.argsort(torch.rand(B, E, generator=g), dim=1)[:, :k].clone()
        padded = torch.rand(B, k, generator=g) < (0.125 if pad else 0.0)
        padded[:, 0] = False
        ids[padded] = -1
    w = torch.rand(B, k, generator=g, dtype=torch.float64) + 0.05
    w = (w / w.sum(-1, keepdim=True)).to(torch.float32)
    if kind == "exclusive":
        w[0] = torch.rand(k, generator=g) * 2.0 ** -20
        w[0, 0], w[0, -1] = 1.0, 0.0
    return ids.contiguous().cuda(), w.cuda()


def every_byte(w13_s, w2_s, w13_p, w2_p, e):
    """Expert e holds every scale byte: w13 runs through 0..254, w2 gets 0xFF once; groups above byte
    131 get zero codes (values stay in range, a scale decoded to inf would turn them into NaN)."""
    w13_s[e] = torch.arange(w13_s[e].numel(), device="cuda").remainder(255).to(torch.uint8).reshape(w13_s[e].shape)
    w2_s[e].view(-1)[7] = 0xFF
    big = (w13_s[e] > 131) & (w13_s[e] != 0xFF)
    w13_p[e].view(*w13_s[e].shape, 16)[big] = 0


def judge(inputs, params):
    """check(y): the spec's derived rule against the float64 reference, the wd reference as baseline
    (both computed once)."""
    from references.moe import moe_experts_mxfp4 as ref
    from verify.judge.compare import compare_derived
    from verify.model.specs import load_spec
    spec = load_spec("moe_experts_mxfp4").output("y")
    dtype = inputs["z"].dtype
    k, floor = spec.bounds(dtype)
    t64 = dict(inputs, z=inputs["z"].double(), weights=inputs["weights"].double())
    oracle = ref(**t64, **params)
    base = ref(**inputs, **params)
    return lambda y: compare_derived("y", y, oracle, base, k, floor, element_floor=spec.element_floor_for(dtype))


SHAPES = {  # (E, L, I, k)
    "tiny": (20, 64, 64, 4), "tiny_tp2": (20, 64, 32, 4), "small": (48, 128, 128, 8),
    "k3_tp1": (40, K3_L, K3_I, K3_K), "k3_tp8": (40, K3_L, 384, K3_K), "k3_tp16": (40, K3_L, 256, K3_K),
}
GRID = [(s, B, kind) for s in ("tiny", "tiny_tp2", "small") for B in (1, 5, 32) for kind in ("random", "same", "exclusive")]
GRID += [(s, B, kind) for s in ("k3_tp1", "k3_tp8", "k3_tp16") for B, kind in ((1, "random"), (2, "exclusive"), (17, "same"), (64, "random"))]


@pytest.mark.parametrize("shape,B,kind", GRID, ids=[f"{s}-B{b}-{k}" for s, b, k in GRID])
def test_matches_reference_every_variant(shape, B, kind):
    from fused import moe_experts_mxfp4 as fm
    E, L, inter, k = SHAPES[shape]
    dtype = torch.float16 if B in (5, 17) else torch.bfloat16
    w13_p, w13_s, w2_p, w2_s = expert_weights(E, L, inter, seed=B)
    ids, w = routing(kind, B, E, k, seed=B)
    if kind == "exclusive":
        every_byte(w13_s, w2_s, w13_p, w2_p, int(ids[0, 0]))
    z = torch.randn(B, L, device="cuda", generator=torch.Generator("cuda").manual_seed(B)).to(dtype)
    t = dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p, w2_scale=w2_s)
    params = dict(situ_beta=4.0, situ_linear_beta=25.0)
    check = judge(t, params)
    for cfg in fm.variants(t, params):
        y = fm.moe_experts_mxfp4(**t, **params, variant=cfg)
        verdict = check(y)
        assert verdict.ok, f"{cfg.name}: {verdict.detail}"
        assert torch.equal(y.view(torch.int16), fm.moe_experts_mxfp4(**t, **params, variant=cfg).view(torch.int16))
    y = fm.moe_experts_mxfp4(**t, **params)                 # the custom op, default variant
    assert check(y).ok
    if B > 1:                                                # batch position: row 1 alone, same bits
        one = fm.moe_experts_mxfp4(**dict(t, z=z[1:2].clone(), ids=ids[1:2].clone(), weights=w[1:2].clone()), **params)
        assert torch.equal(one.view(torch.int16), y[1:2].view(torch.int16))


@pytest.mark.parametrize("B", [1, 3])
def test_unsplit_k3_experts_index_past_2_31_words(B):
    """All 896 K3 experts at the whole intermediate dim (T = 1): w13 is 2.47e9 words, and expert e's rows
    start past word 2^31 from e = 781 on. Token 0 takes the last 16 experts (880..895), the others random:
    every variant within the spec's rule against the float64 reference, so no offset wrapped."""
    from fused import moe_experts_mxfp4 as fm
    w13_p, w13_s, w2_p, w2_s = expert_weights(K3_E, K3_L, K3_I, seed=11)
    assert w13_p.numel() // 4 > 2**31 and 2 * K3_I * 781 * (K3_L // 8) >= 2**31
    ids, w = routing("random", B, K3_E, K3_K, seed=11)
    ids[0] = torch.arange(K3_E - K3_K, K3_E, device="cuda")
    z = torch.randn(B, K3_L, device="cuda", generator=torch.Generator("cuda").manual_seed(11)).to(torch.bfloat16)
    t = dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p, w2_scale=w2_s)
    params = dict(situ_beta=4.0, situ_linear_beta=25.0)
    check = judge(t, params)
    for cfg in fm.variants(t, params):
        verdict = check(fm.moe_experts_mxfp4(**t, **params, variant=cfg))
        assert verdict.ok, f"{cfg.name}: {verdict.detail}"


@pytest.mark.parametrize("shape", ["tiny", "k3_tp8"])
def test_each_launch_against_torch(shape):
    """Stage by stage, to say which launch is wrong when the end-to-end check fails: the route's active
    experts and member lists, a = SiTU-and-mul(w13 z) and o = w2 a per (token, slot) pair against the
    reference's steps in wd (within 4 wd ulps of the row's largest value: other fp32 summation orders
    may round h or o one ulp apart), then y."""
    from fused import moe_experts_mxfp4 as fm
    from references.moe import _dequant_expert, dtype_name
    from references.primitives import linear, situ_and_mul
    E, L, inter, k = SHAPES[shape]
    B = 9
    w13_p, w13_s, w2_p, w2_s = expert_weights(E, L, inter, seed=5)
    ids, w = routing("random", B, E, k, seed=5)
    z = torch.randn(B, L, device="cuda").to(torch.bfloat16)
    scratch = {}
    y = torch.empty_like(z)
    fm.launch(z, ids, w, w13_p, w13_s, w2_p, w2_s, 4.0, 25.0, y, scratch=scratch)
    torch.cuda.synchronize()
    P = B * k
    route = scratch["route"].cpu()
    flat = ids.reshape(-1).cpu()
    n = int(route[0])
    experts = route[1:1 + n].tolist()
    assert sorted(experts) == sorted(set(flat[flat >= 0].tolist())), "route: active experts"
    for a, e in enumerate(experts):
        start, count = int(route[1 + P + a]), int(route[1 + 2 * P + a])
        members = sorted(route[1 + 3 * P + start:1 + 3 * P + start + count].tolist())
        assert members == (flat == e).nonzero().flatten().tolist(), f"route: members of expert {e}"

    def close(got, want, what):
        tol = 4 * want.abs().amax(-1, keepdim=True).float() * 2.0 ** -8
        bad = ((got.float() - want.float()).abs() > tol).any(-1)
        assert not bad.any(), f"{what}: pairs {bad.nonzero().flatten().tolist()[:8]} differ"

    for p in (flat >= 0).nonzero().flatten().tolist():
        w13, w2 = _dequant_expert(int(flat[p]), w13_p, w13_s, w2_p, w2_s, dtype_name(z.dtype))
        a = situ_and_mul(linear(z[p // k:p // k + 1], w13), 4.0, 25.0)
        close(scratch["act"][p:p + 1], a, f"gate_up (pair {p})")
        close(scratch["o"][p:p + 1], linear(scratch["act"][p:p + 1], w2), f"down (pair {p})")
    params = dict(situ_beta=4.0, situ_linear_beta=25.0)
    verdict = judge(dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p,
                         w2_scale=w2_s), params)(y)
    assert verdict.ok, f"combine: {verdict.detail}"


@pytest.mark.parametrize("T", [2, 8])
def test_expert_parallel_ranks_fold_to_the_unsplit_result(T):
    """EP: each rank runs its expert range with foreign ids as -1; the rank-order fp32 fold of the
    partials is judged like the unsplit op (the harness's split rule, here at K3 dims)."""
    from fused import moe_experts_mxfp4 as fm
    from references.primitives import fold_ranks
    from verify.model.opdef import OpInputs
    from verify.ops.moe_splits import shard_moe_experts
    E, L, inter, k = 64, K3_L, 384, K3_K
    w13_p, w13_s, w2_p, w2_s = expert_weights(E, L, inter, seed=T)
    ids, w = routing("random", 8, E, k, seed=T)
    z = torch.randn(8, L, device="cuda").to(torch.bfloat16)
    t = dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p, w2_scale=w2_s)
    params = dict(situ_beta=4.0, situ_linear_beta=25.0)
    shards = shard_moe_experts(OpInputs({n: v.cpu() for n, v in t.items()}, params), T)
    parts = [fm.moe_experts_mxfp4(**{n: v.cuda() for n, v in s.tensors.items()}, **params) for s in shards]
    verdict = judge(t, params)(fold_ranks(parts))
    assert verdict.ok, verdict.detail


@pytest.mark.parametrize("config,batch,dtype,dist,T,knobs", [
    ("small", 8, "bfloat16", "normal", 16, ()), ("small", 17, "float16", "outliers", 4, (("routing", "edges"),)),
    ("tiny", 5, "bfloat16", "mxfp4_grid", 8, (("routing", "same"),)), ("small", 32, "bfloat16", "normal", 2, ())])
def test_expert_parallel_split_through_the_harness(config, batch, dtype, dist, T, knobs):
    """The registry's EP form (moe_experts_mxfp4_ep): every variant under every guard on each rank's
    mostly-padding slots, the partials folded by the split rule and judged against the unsplit oracle."""
    from property_tests.harness_case import judge_case
    from verify.model.case import Case

    v = judge_case(Case("moe_experts_mxfp4_ep", 21, batch, config, dtype, dist, T, knobs))
    assert v.status == "pass", f"{v.stage}: {v.reason}\n  {v.repro}"


def test_cuda_graph_replay_and_no_recompile_for_a_new_batch():
    from fused import moe_experts_mxfp4 as fm
    from fused import runtime
    E, L, inter, k = SHAPES["k3_tp8"]
    w13_p, w13_s, w2_p, w2_s = expert_weights(E, L, inter, seed=3)
    params = dict(situ_beta=4.0, situ_linear_beta=25.0)
    outs = {}
    for B in (3, 7, 64):
        ids, w = routing("random", B, E, k, seed=B)
        z = torch.randn(B, L, device="cuda").to(torch.bfloat16)
        t = dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p, w2_scale=w2_s)
        outs[B] = (t, fm.moe_experts_mxfp4(**t, **params))
        if B == 3:
            misses = runtime.cache_info().misses
    assert runtime.cache_info().misses == misses, "a new batch size recompiled"
    t, want = outs[7]
    out = torch.full_like(want, float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fm.moe_experts_mxfp4(**t, **params, out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------------------------------ timing
def graph_us(calls, reps=None):
    """Median us per call of a CUDA graph replaying `calls` in turn (warm-up compiles first)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    reps = reps or max(len(calls), 16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for i in range(reps):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (5 * reps))
    return sorted(times)[2]


def eager_us(fn, reps=3):
    import time
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def dequant_then_matmul(t, params, bufs):
    """The path a user would otherwise take: each distinct expert dequantised to bf16 (the fused
    mxfp4_dequant kernel), its tokens' rows through cuBLAS, SiTU in torch, the fp32 combine."""
    from fused.mxfp4_dequant import mxfp4_dequant
    from references.primitives import situ_and_mul
    z, w = t["z"], t["weights"]
    y = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e, (rows, slots) in bufs["groups"].items():
        w13 = mxfp4_dequant(t["w13_packed"][e], t["w13_scale"][e], "bfloat16", out=bufs["w13"])
        w2 = mxfp4_dequant(t["w2_packed"][e], t["w2_scale"][e], "bfloat16", out=bufs["w2"])
        a = situ_and_mul(z[rows] @ w13.T, params["situ_beta"], params["situ_linear_beta"])
        y.index_add_(0, rows, (a @ w2.T).float() * w[rows, slots].unsqueeze(1))
    return y.to(z.dtype)


def test_timing_k3_per_rank_shapes():
    """us per call at K3 per-rank shapes (896 experts, top-16; T = 16 pads I to 256): the fused kernel
    in a CUDA graph that rotates 8 routings (the experts' bytes come from HBM, not L2), the floor (a
    device copy of the distinct experts' bytes those routings read: it reads and writes them, so a
    read-only kernel may beat it), GB/s = the distinct bytes over the fused time, the
    dequant-then-cuBLAS path (graph, B <= 16), the reference eager (B <= 4), and every launch variant."""
    from fused import moe_experts_mxfp4 as fm
    lines = [f"{'T':>3} {'I':>5} {'B':>3} {'distinct':>8} {'MB':>8} {'fused':>9} {'floor':>9} {'GB/s':>7} "
             f"{'dq+mm':>9} {'ref eager':>10}  variants " + " / ".join(c.name for c in fm.all_configs())]
    params = dict(situ_beta=4.0, situ_linear_beta=25.0)
    for T in (8, 16):           # T = 1 (896 experts x the whole I) is refused: past 32-bit offsets
        inter = max(-(-K3_I // T), 256)
        w13_p, w13_s, w2_p, w2_s = expert_weights(K3_E, K3_L, inter, seed=T)
        per_expert = sum(x[0].numel() for x in (w13_p, w13_s, w2_p, w2_s))
        for B in (1, 2, 4, 8, 16, 32, 64):
            sets = []
            for r in range(8):
                ids, w = routing("random", B, K3_E, K3_K, seed=1000 * T + 10 * B + r, pad=False)
                z = torch.randn(B, K3_L, device="cuda").to(torch.bfloat16)
                t = dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p, w2_scale=w2_s)
                distinct = torch.unique(ids)
                sets.append((t, torch.empty_like(z), distinct))
            each = [graph_us([lambda s=s, c=c: fm.moe_experts_mxfp4(**s[0], **params, out=s[1], variant=c)
                              for s in sets]) for c in fm.all_configs()]
            fused = each[0]                               # the default (all_configs()[0])
            most = max(len(s[2]) for s in sets)          # one destination, sized for the largest set
            dst = [torch.empty((most,) + x.shape[1:], dtype=x.dtype, device="cuda") for x in (w13_p, w13_s, w2_p, w2_s)]
            floor = graph_us([lambda d=s[2]: [torch.index_select(x, 0, d, out=o[:len(d)])
                                              for x, o in zip((w13_p, w13_s, w2_p, w2_s), dst)] for s in sets])
            del dst
            nd = sum(len(s[2]) for s in sets) / len(sets)
            mb = nd * per_expert / 1e6
            dq = "-"
            if B <= 16:
                bufs = []
                for s in sets[:2]:
                    ids = s[0]["ids"]
                    groups = {}
                    for e in torch.unique(ids).tolist():
                        rows, slots = (ids == e).nonzero(as_tuple=True)
                        groups[e] = (rows, slots)
                    bufs.append(dict(groups=groups, w13=torch.empty(2 * inter, K3_L, dtype=torch.bfloat16, device="cuda"),
                                     w2=torch.empty(K3_L, inter, dtype=torch.bfloat16, device="cuda")))
                dq = f"{graph_us([lambda s=s, b=b: dequant_then_matmul(s[0], params, b) for s, b in zip(sets, bufs)], reps=4):9.1f}"
            ref = "-"
            if B <= 4:
                from references.moe import moe_experts_mxfp4 as ref_fn
                ref = f"{eager_us(lambda: ref_fn(**sets[0][0], **params), reps=2):10.0f}"
            lines.append(f"{T:>3} {inter:>5} {B:>3} {nd:8.1f} {mb:8.1f} {fused:9.1f} {floor:9.1f} "
                         f"{mb * 1e3 / fused:7.0f} {dq:>9} {ref:>10}  variants " + " / ".join(f"{v:.1f}" for v in each))
            print(lines[-1], flush=True)
        del w13_p, w13_s, w2_p, w2_s
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_experts_mxfp4_timing.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
