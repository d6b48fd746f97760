"""skinny_gemm's wgmma variants (fused/skinny_gemm_wgmma.py): every variant compiles for sm_90a on a
CPU-only machine (all K3 shapes at m_pad=64, one shape for the other m_pads, to keep CI near 40 s),
the PTX holds the wgmma / TMA / mbarrier pipeline, bad shapes raise ValueError; numerics,
determinism, CUDA-graph replays and batch invariance are checked on a CUDA device only."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GEMM_SHAPES = [(7168, 49152), (7168, 6144), (12288, 7168), (1536, 7168), (7168, 3584), (7168, 896)]
IDS = [f"{k}to{n}" for k, n in GEMM_SHAPES]


def _wgmma_configs(N, K, m_pad=None):
    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    return [c for c in sg.all_configs(N, K)
            if isinstance(c, SkinnyGemmWgmmaConfig) and (m_pad is None or c.m_pad == m_pad)]


@pytest.mark.parametrize("K,N", GEMM_SHAPES, ids=IDS)
def test_wgmma_variants_listed_and_compile_m64(K, N):
    cfgs = _wgmma_configs(N, K, 64)
    assert {c.rows for c in cfgs} >= {64, 128}
    for cfg in cfgs:
        assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) is not None


# One rank's column-split shapes (K, N) at T = 1, 8, 16 that have a WGMMA_DEFAULTS entry of their own.
RANK_SHAPES = [(7168, 12288), (7168, 1536), (7168, 768), (3584, 7168), (3584, 896), (12288, 896), (12288, 448)]


@pytest.mark.parametrize("K,N", RANK_SHAPES, ids=[f"{k}to{n}" for k, n in RANK_SHAPES])
def test_per_rank_defaults_are_certified_variants_and_compile(K, N):
    """At each per-rank shape with its own default, every M from the default's min_M to 64 is
    dispatched to a wgmma variant that variants() lists (the harness certifies it) and that compiles
    for sm_90a; below min_M the SIMT kernel."""
    import torch

    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    min_m = sg.WGMMA_DEFAULTS[(N, K)][0]
    picks = set()
    for M in range(1, 65):
        cfg = sg.default_config(M, N, K)
        assert isinstance(cfg, SkinnyGemmWgmmaConfig) == (M >= min_m), (M, cfg)
        listed = sg.variants({"x": torch.empty(M, K, device="meta"), "w": torch.empty(N, K, device="meta")}, {})
        assert cfg in listed, (M, cfg)
        if isinstance(cfg, SkinnyGemmWgmmaConfig):
            picks.add(cfg)
    for cfg in sorted(picks, key=lambda c: c.m_pad):
        assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) is not None


@pytest.mark.parametrize("m_pad", [8, 16, 32])
def test_wgmma_variants_compile_other_m_pads(m_pad):
    K, N = 7168, 896                                         # split-K path (counter + fold)
    cfgs = _wgmma_configs(N, K, m_pad)
    assert cfgs and all(c.ksplit > 1 for c in cfgs)
    for cfg in cfgs:
        assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) is not None


def test_wgmma_fp16_and_fp32_out_compile():
    from fused.skinny_gemm_wgmma import configs_for
    for N in (49152, 896):                                   # no split, split-K
        cfg = configs_for(N, 7168, 16)[0]
        runtime.compile_for_cpu_check("skinny_gemm", "float16", "float16", N, 7168, cfg)
        runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "float32", N, 7168, cfg)


def test_wgmma_summation_order_ignores_m_pad():
    """ksplit (with K, the order of every sum) is the same for every m_pad of one (rows, occupancy)."""
    from fused.skinny_gemm_wgmma import M_PADS, configs_for
    for K, N in GEMM_SHAPES:
        by = {}
        for p in M_PADS:
            for c in configs_for(N, K, p):
                by.setdefault((c.rows, c.occupancy), set()).add(c.ksplit)
        assert all(len(s) == 1 for s in by.values()), (K, N, by)


def test_wgmma_ptx_has_tma_wgmma_pipeline(ptx_of):
    code = ("from fused import skinny_gemm_wgmma as wg; "
            "wg.compile_variant('bfloat16', 'bfloat16', 896, 7168, wg.configs_for(896, 7168, 32)[0])")
    ptx = ptx_of(code)
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait" in ptx
    assert "atom.global.acq_rel.add" in ptx                  # split-K ticket (integer, not float)
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    assert ".local" not in ptx                               # no register spills


def test_wgmma_rejects_shapes_it_cannot_do():
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmma, SkinnyGemmWgmmaConfig, check_launch, m_pad_for
    cfg = SkinnyGemmWgmmaConfig(16, 128, 4, 1)
    with pytest.raises(ValueError, match="K=96 must be a positive multiple of 64"):
        SkinnyGemmWgmma(896, 96, cfg)
    with pytest.raises(ValueError, match="N=960 must be a multiple of rows=128"):
        SkinnyGemmWgmma(960, 7168, cfg)
    with pytest.raises(ValueError, match="M=17 is over the variant's m_pad=16"):
        check_launch(17, 896, 7168, cfg)
    with pytest.raises(ValueError, match="M=65 is over 64"):
        m_pad_for(65)
    with pytest.raises(ValueError, match="ksplit=200"):
        SkinnyGemmWgmma(896, 7168, SkinnyGemmWgmmaConfig(16, 128, 4, 200))
    with pytest.raises(ValueError, match="shared memory"):
        SkinnyGemmWgmma(1024, 7168, SkinnyGemmWgmmaConfig(64, 256, 12, 1))


def test_wgmma_new_batch_size_does_not_recompile(ir_of):
    """Every M of an m_pad bucket gets the same wgmma config (the compile key has no M), compiled with a
    dynamic batch: x (?, K) and y (?, N) in the host IR."""
    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    N, K = 3584, 7168
    cfgs = {sg.default_config(M, N, K) for M in range(9, 17)}          # one m_pad bucket
    assert len(cfgs) == 1 and isinstance(next(iter(cfgs)), SkinnyGemmWgmmaConfig)
    ir = ir_of("from fused import skinny_gemm as sg; "
               f"sg._compile('bfloat16', 'bfloat16', {N}, {K}, sg.default_config(9, {N}, {K}))")
    assert f'"(?,{K}):({K},1)"' in ir and f'"(?,{N}):({N},1)"' in ir


def test_wgmma_folds_reach_the_dispatcher_only_where_measured():
    """The shipped variants (configs_for) keep the "last" fold; other folds reach the dispatcher only
    where WGMMA_DEFAULTS names them (the two split shapes, measured on the H200): the cluster fold
    "cspread", at 7168 -> 3584 with the S of the shipped "last" variant (so it gives that variant's
    bits) and at the router shape with S = 8 (a cluster holds at most 8 CTAs; the shipped variant's is
    9). Each is listed by all_configs (compiled in CI) and by variants() at every M it serves
    (certified), and one shape's buckets share one S (the same sums at every M)."""
    import dataclasses

    import torch

    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import BK, M_PADS, configs_for, m_pad_for, stages_for
    folded = set()
    for K, N in GEMM_SHAPES:
        for p in M_PADS:
            assert all(c.fold == "last" for c in configs_for(N, K, p)), (K, N, p)
        splits = set()
        for M in range(1, 65):
            cfg = sg.default_config(M, N, K)
            if getattr(cfg, "fold", "last") == "last":
                continue
            folded.add((N, K, cfg.name))
            splits.add(cfg.ksplit)
            plain = dataclasses.replace(cfg, fold="last", bk=BK, step=0,
                                        stages=stages_for(cfg.rows, cfg.m_pad, cfg.occupancy))
            if N == 3584:
                assert plain in configs_for(N, K, m_pad_for(M)), cfg
            assert cfg in sg.all_configs(N, K)
            x, w = torch.empty(M, K, device="meta"), torch.empty(N, K, device="meta")
            assert cfg in sg.variants({"x": x, "w": w}, {})
        assert len(splits) <= 1, (K, N, splits)
    assert {n for n, _, _ in folded} == {896, 3584}, folded
    assert {name for _, _, name in folded} == {
        "wgmma_m8_r64_st12_s8_o1_cpush_k128", "wgmma_m16_r64_st11_s8_o1_cpush_k128",
        "wgmma_m32_r64_st9_s8_o1_cpush_k128", "wgmma_m64_r64_st6_s8_o1_cpush_k128",
        "wgmma_m8_r64_st12_s2_o1_cpush_k128", "wgmma_m16_r64_st11_s2_o1_cpush_k128",
        "wgmma_m32_r64_st9_s2_o1_cpush_k128", "wgmma_m64_r64_st6_s2_o1_cpush_k128"}
    new = [c for c in configs_for(896, 7168, 64, sweep=True) if c.fold != "last"]
    names = {c.name for c in new}
    assert len(names) == len(new)
    assert {"wgmma_m64_r64_st12_s9_o1_spread", "wgmma_m64_r64_st12_s5_o1_vec"} <= names, names


def test_wgmma_cluster_folds_validate_and_ptx(ptx_of, ir_of):
    """The cluster folds launch the S split CTAs of a column block as one (1, S, 1) cluster, stage
    the partials in distributed shared memory and never touch a global workspace or counter.
    "cspread": st.shared::cluster through mapa, two cluster barriers. "cpush" (the default): one
    relaxed cluster arrive at entry, waited on once per thread, then st.async stores (.v4 where every
    CTA owns a multiple of 4 elements), each completing on the owner's mbarrier, and one wait on its
    own mbarrier at cluster scope; its receive buffer takes its bytes from the stages. S above 8, partials
    that do not fit the weight stages, or stages that leave no room for cpush's buffer, are refused
    by name."""
    import dataclasses

    from fused import skinny_gemm as sg
    from fused import skinny_gemm_wgmma as wg
    d = sg.default_wgmma(896, 7168, 64)
    assert (d.fold, d.ksplit, d.bk) == ("cpush", 8, 128) and wg.workspace_shapes(896, d) == ((1,), (1,))
    assert wg.own_buffer_bytes(d) == 64 * 64 * 4 and d.stages == 6    # 7 stages of 32 KB leave no room
    for bad, words in ((dict(ksplit=9), "ksplit must be 2..8"), (dict(ksplit=1), "ksplit must be 2..8"),
                       (dict(fold="cluster", stages=7), "must fit its weight stages"),
                       (dict(stages=7), "7 stages need 247808 bytes")):
        with pytest.raises(ValueError, match=words):
            wg.validate(896, 7168, dataclasses.replace(d, **bad))
    frag = 64 * 64 // wg.CONSUMER_THREADS
    for fold in ("cspread", "cpush"):
        code = ("from fused import skinny_gemm as sg, skinny_gemm_wgmma as wg; "
                "wg.compile_variant('bfloat16', 'bfloat16', 896, 7168, "
                f"wg.with_fold(sg.default_wgmma(896, 7168, 64), {fold!r}, 8))")
        body = ptx_of(code)
        body = body[body.index(".entry"):]
        assert "mapa.shared::cluster" in body
        assert "atom.global" not in body and "ld.global" not in body and ".local" not in body
        assert "cluster_dim = array<i64: 1, 8, 1>" in ir_of(code)
        if fold == "cspread":
            assert body.count("st.shared::cluster.f32") == frag          # every element to its owner CTA
            assert body.count("barrier.cluster.wait") == 4               # 2 consumer + 2 producer
            assert "st.async" not in body
        else:
            stores = [ln for ln in body.splitlines() if "st.async" in ln]
            assert len(stores) == 8 and all("complete_tx::bytes.v4.f32" in ln for ln in stores)   # 4 per owner
            assert body.count("barrier.cluster.arrive.relaxed") == 1 == body.count("barrier.cluster.arrive")
            assert body.count("barrier.cluster.wait") == 2               # 1 consumer + 1 producer
            assert body.count("mbarrier.try_wait.parity.acquire.cluster") == 1
            assert "fence.mbarrier_init.release.cluster" in body
            assert body.count("ld.shared.v4") == 8 * 8 and "st.shared::cluster" not in body   # S parts x S owners


def test_spread_fold_runs_as_vec_where_the_grid_cannot_be_resident(monkeypatch):
    """On a Hopper part with fewer SMs than the H200's 132 (H100 PCIe: 114; H20: 78) the spinning
    "spread" fold could wait forever for a CTA that cannot be scheduled: it runs as "vec" there."""
    import dataclasses

    from fused import runtime
    from fused import skinny_gemm_wgmma as wg
    cfg = wg.SkinnyGemmWgmmaConfig(64, 64, 12, 9, 1, "spread")                      # 126 CTAs
    for sms, fold in ((132, "spread"), (126, "spread"), (125, "vec"), (114, "vec"), (78, "vec")):
        monkeypatch.setattr(runtime, "sm_count", lambda dev, n=sms: n)
        assert wg.resident_or_vec("cuda:0", 896, cfg) == dataclasses.replace(cfg, fold=fold), sms
    last = dataclasses.replace(cfg, fold="last")
    assert wg.resident_or_vec("cuda:0", 896, last) is last


def test_wgmma_spread_fold_requires_resident_grid():
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmma, SkinnyGemmWgmmaConfig
    with pytest.raises(ValueError, match="252 CTAs > 132 SMs x occupancy 1"):
        SkinnyGemmWgmma(896, 7168, SkinnyGemmWgmmaConfig(64, 64, 12, 18, 1, "spread"))
    with pytest.raises(ValueError, match="needs 2 CTAs per SM resident"):
        SkinnyGemmWgmma(896, 7168, SkinnyGemmWgmmaConfig(64, 64, 12, 9, 2, "spread"))
    with pytest.raises(ValueError, match="fold='atomic' must be one of"):
        SkinnyGemmWgmma(896, 7168, SkinnyGemmWgmmaConfig(64, 64, 12, 9, 1, "atomic"))
    SkinnyGemmWgmma(896, 7168, SkinnyGemmWgmmaConfig(64, 64, 12, 18, 1, "vec"))     # no spin: any grid


def test_wgmma_spread_fold_ptx(ptx_of):
    """"spread": integer ticket and acquire spin, 16-byte partial loads, no float atomics, no spills."""
    code = ("from fused import skinny_gemm_wgmma as wg; "
            "c = wg.SkinnyGemmWgmmaConfig(64, 64, 12, 9, 1, 'spread'); "
            "wg.compile_variant('bfloat16', 'bfloat16', 896, 7168, c)")
    ptx = ptx_of(code)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert "atom.global.acq_rel.add" in ptx and "ld.acquire.gpu.global.s32" in ptx
    assert ptx.count("ld.global.v4") >= 9                    # one 16-byte load per split (S = 9)
    assert "atom.global.add.f32" not in ptx and "red.global.add.f32" not in ptx
    assert ".local" not in ptx


@pytest.mark.parametrize("fold,coop", [("spread", True), ("vec", False), ("last", False)])
def test_wgmma_only_the_spread_fold_launches_cooperatively(ir_of, fold, coop):
    """"spread" CTAs spin on their split peers: launched as a plain grid, two of them on two streams
    can each be placed in part and wait forever (H200: a two-stream stress test hung the
    plain launch within 40 s and ran 640 cooperative rounds in 1.3 s). The cooperative launch makes
    the driver place the whole grid at once; the other folds never wait and launch plainly."""
    ir = ir_of("from fused import skinny_gemm_wgmma as wg; "
               f"c = wg.SkinnyGemmWgmmaConfig(64, 64, 12, 9, 1, {fold!r}); "
               "wg.compile_variant('bfloat16', 'bfloat16', 896, 7168, c)")
    assert f"cooperative_launch = {str(coop).lower()}" in ir      # stated either way: an empty dump fails
    assert f"cooperative_launch = {str(not coop).lower()}" not in ir


def test_wgmma_partials_fold_ptx_writes_partials_and_never_waits(ptx_of):
    """"partials": each split CTA stores its fp32 partial (no bf16 conversion) and exits: no
    ticket, no spin, no fold loads, no float atomics."""
    ptx = ptx_of("from fused import skinny_gemm_wgmma as wg; "
                 "c = wg.SkinnyGemmWgmmaConfig(64, 64, 12, 9, 1, 'partials', True); "
                 "wg.compile_variant('bfloat16', 'float32', 896, 7168, c)")
    body = ptx[ptx.index(".entry"):]
    assert "wgmma.mma_async" in ptx and body.count("st.global.b32") == 64 * 64 // 128   # the fp32 fragment
    assert "atom.global" not in body and "ld.acquire" not in body and "ld.global" not in body
    assert "cvt.rn.bf16" not in body and ".local" not in body


def test_wgmma_partials_fold_writes_fp32_only():
    from fused import skinny_gemm_wgmma as wg
    c = wg.SkinnyGemmWgmmaConfig(64, 64, 12, 9, 1, "partials")
    assert c.writes_partials and wg.workspace_shapes(896, c) == ((1,), (1,))
    assert not wg.SkinnyGemmWgmmaConfig(64, 64, 12, 1, 1, "partials").writes_partials   # S = 1: y itself
    with pytest.raises(ValueError, match="writes fp32 partials, not bfloat16"):
        wg.compile_variant("bfloat16", "bfloat16", 896, 7168, c)


def test_wgmma_vec_fold_compiles():
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    cfg = SkinnyGemmWgmmaConfig(32, 64, 12, 5, 1, "vec")
    assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", 896, 7168, cfg) is not None


# ---------------------------------------------------------------------------------------- GPU only
def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(1e-30))) - 7)


def _assert_rows_and_replays_match(x, w, cfg, full):
    """Rows of the M = 64 result equal to the same rows computed at M = 1, 7, 33 (batch invariance),
    and three CUDA-graph replays of the launch (after a warm-up that compiles and allocates) equal to it."""
    from fused.skinny_gemm import skinny_gemm
    for M in (1, 7, 33):
        part = skinny_gemm(x[64 - M:].clone(), w, variant=cfg)
        assert torch.equal(part.view(torch.int16), full[64 - M:].view(torch.int16)), (cfg.name, M)
    out = torch.empty_like(full)
    skinny_gemm(x, w, out=out, variant=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        skinny_gemm(x, w, out=out, variant=cfg)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), full.view(torch.int16)), cfg.name


def _case(M, N, K, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("K,N", [(1536, 7168), (7168, 896), (7168, 3584)], ids=["1536to7168", "7168to896", "7168to3584"])
@pytest.mark.parametrize("M", [1, 5, 16, 33, 64])
def test_wgmma_matches_float64_deterministic(K, N, M):
    """Error <= torch's own bf16 linear error + 1 bf16 ulp of the largest |y|; two runs bitwise equal;
    padded token rows never written (the NaN-poisoned rows past M stay NaN)."""
    from fused.skinny_gemm import skinny_gemm
    from fused.skinny_gemm_wgmma import configs_for, m_pad_for
    x, w = _case(M, N, K)
    ref = x.double() @ w.double().T
    bound = (torch.nn.functional.linear(x, w).double() - ref).abs().max() + _bf16_ulp(ref.abs().max())
    for cfg in configs_for(N, K, m_pad_for(M)):
        big = torch.full((M + 3, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = skinny_gemm(x, w, out=big[:M], variant=cfg)
        assert torch.isnan(big[M:]).all(), cfg.name
        assert (got.double() - ref).abs().max() <= bound, cfg.name
        again = skinny_gemm(x, w, variant=cfg)
        assert torch.equal(got.view(torch.int16), again.view(torch.int16)), cfg.name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("K,N", [(1536, 7168), (7168, 896)], ids=["1536to7168", "7168to896"])
def test_wgmma_batch_invariant_and_graph_replays(K, N):
    """A token row at M=64 == the same row at M=1, 7, 33 with the same variant (bitwise); CUDA-graph
    replays (split-K counters reset by the kernel) give the eager bits; strided x views too."""
    from fused.skinny_gemm import skinny_gemm
    from fused.skinny_gemm_wgmma import configs_for
    x, w = _case(64, N, K, seed=1)
    for cfg in configs_for(N, K, 64):
        full = skinny_gemm(x, w, variant=cfg)
        _assert_rows_and_replays_match(x, w, cfg, full)
        wide = torch.zeros(64, K + 64, device="cuda", dtype=torch.bfloat16)
        wide[:, 32:32 + K] = x
        strided = skinny_gemm(wide[:, 32:32 + K], w, variant=cfg)
        assert torch.equal(strided.view(torch.int16), full.view(torch.int16)), cfg.name


@pytest.mark.gpu
@needs_gpu
def test_wgmma_same_bits_across_m_pad():
    """Same rows/occupancy (same split-K), other m_pad: equal bits if a wgmma output element does not
    depend on the instruction's N (the assumption the module docstring states; checked here)."""
    from fused.skinny_gemm import skinny_gemm
    from fused.skinny_gemm_wgmma import M_PADS, configs_for
    K, N = 7168, 896
    x, w = _case(8, N, K, seed=2)
    outs = {}
    for p in M_PADS:
        for c in configs_for(N, K, p):
            outs.setdefault((c.rows, c.occupancy), []).append(skinny_gemm(x, w, variant=c))
    for key, ys in outs.items():
        for y in ys[1:]:
            assert torch.equal(y.view(torch.int16), ys[0].view(torch.int16)), key


def _fold_variants(N, K, m_pad):
    """The bench-only "vec" / "spread" folds, and every cluster fold at every split shipped variant's S
    that a cluster holds (and at S = 8 where the shipped S is above it)."""
    from fused.skinny_gemm_wgmma import CLUSTER_FOLDS, MAX_CLUSTER, configs_for, validate, with_fold
    out = [c for c in configs_for(N, K, m_pad, sweep=True) if c.fold != "last"]
    for c in configs_for(N, K, m_pad):
        for fold in CLUSTER_FOLDS if c.ksplit > 1 else ():
            cand = with_fold(c, fold, min(c.ksplit, MAX_CLUSTER))
            try:
                validate(N, K, cand)
            except ValueError:
                continue
            out.append(cand)
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("K,N", [(7168, 896), (7168, 3584), (7168, 6144)], ids=["7168to896", "7168to3584", "7168to6144"])
@pytest.mark.parametrize("M", [1, 5, 16, 33, 64])
def test_wgmma_fold_variants_match_float64_and_last_fold(K, N, M):
    """"vec" / "spread" / "cluster" / "cspread" folds: error <= torch's + 1 bf16 ulp, padded rows never
    written, two runs bitwise equal, and the same bits as the "last" fold with the same (rows,
    occupancy, S): every fold adds the partials in the same ks order."""
    import dataclasses

    from fused.skinny_gemm import skinny_gemm
    from fused.skinny_gemm_wgmma import m_pad_for
    x, w = _case(M, N, K, seed=3)
    ref = x.double() @ w.double().T
    bound = (torch.nn.functional.linear(x, w).double() - ref).abs().max() + _bf16_ulp(ref.abs().max())
    cfgs = _fold_variants(N, K, m_pad_for(M))
    assert cfgs
    for cfg in cfgs:
        big = torch.full((M + 3, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = skinny_gemm(x, w, out=big[:M], variant=cfg)
        assert torch.isnan(big[M:]).all(), cfg.name
        assert (got.double() - ref).abs().max() <= bound, cfg.name
        for _ in range(3):
            again = skinny_gemm(x, w, variant=cfg)
            assert torch.equal(got.view(torch.int16), again.view(torch.int16)), cfg.name
        last = skinny_gemm(x, w, variant=dataclasses.replace(cfg, fold="last"))
        assert torch.equal(got.view(torch.int16), last.view(torch.int16)), cfg.name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("K,N", [(7168, 896), (7168, 3584)], ids=["7168to896", "7168to3584"])
def test_wgmma_fold_variants_batch_invariant_and_graph_replays(K, N):
    """A row at M=64 == the same row at M=1, 7, 33 (the fold slices move with M, the order does not);
    CUDA-graph replays give the eager bits (the spread fold's counter returns to 0)."""
    from fused.skinny_gemm import skinny_gemm
    x, w = _case(64, N, K, seed=4)
    for cfg in _fold_variants(N, K, 64):
        full = skinny_gemm(x, w, variant=cfg)
        _assert_rows_and_replays_match(x, w, cfg, full)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 17, 64])
def test_wgmma_partials_folded_in_ks_order_give_the_spread_bits(M):
    """The "partials" launch's [S, M, N] fp32 partials, added in ks order by the caller, equal the
    "spread" and "last" folds' fp32 y bit for bit (same k ranges, same adds); rows past M untouched."""
    import dataclasses

    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import configs_for, m_pad_for
    K, N = 7168, 896
    x, w = _case(M, N, K, seed=6)
    base = next(c for c in configs_for(N, K, m_pad_for(M)) if (c.rows, c.occupancy) == (64, 1))
    for fresh in (False, True):
        cfg = dataclasses.replace(base, fold="partials", fresh_acc=fresh)
        S = cfg.ksplit
        part = torch.full((S, M + 2, N), float("nan"), device="cuda")
        view = part[:, :M]
        sg.launch(x, w, view, cfg)
        assert torch.isnan(part[:, M:]).all() and not torch.isnan(view).any()
        folded = view[0].clone()
        for s in range(1, S):
            folded = folded + view[s]
        for fold in ("spread", "last"):
            y = torch.empty(M, N, device="cuda")
            sg.launch(x, w, y, dataclasses.replace(cfg, fold=fold))
            assert torch.equal(y, folded), (fold, fresh)


def test_tiled_defaults_keep_the_plain_variants_sums_and_fill_one_wave():
    """WGMMA_TILES' defaults (bk 128, and where step > 0 a 64-row tile every `step` rows) differ from
    the shipped plain variant of their bucket only in bk, step, stages and the split-K fold: same rows,
    occupancy and S (the router shape's cluster fold: 8, the most a cluster holds), so the same k
    ranges in the same order; a stepped grid is one wave of more CTAs than the plain one's, and every
    grid is one wave; bad bk / step are refused by name."""
    import dataclasses

    from fused import skinny_gemm as sg
    from fused import skinny_gemm_wgmma as wg
    for (N, K), (bk, step) in sg.WGMMA_TILES.items():
        for p in wg.M_PADS:
            d = sg.default_wgmma(N, K, p)
            plain = next(c for c in wg.configs_for(N, K, p) if (c.rows, c.occupancy) == (d.rows, d.occupancy))
            assert (d.bk, d.step) == (bk, step)
            assert dataclasses.replace(d, bk=wg.BK, step=0, stages=plain.stages, fold="last",
                                       ksplit=plain.ksplit) == plain
            assert d.ksplit == plain.ksplit or ((N, K), d.ksplit) == ((896, 7168), wg.MAX_CLUSTER)
            if step:
                assert wg.num_ctas(N, plain) < wg.num_ctas(N, d) <= wg.SMS, (N, K, p)
            assert wg.num_ctas(N, d) <= wg.SMS, (N, K, p)
            assert d in sg.all_configs(N, K)
    N, K = 3584, 7168
    base = wg.configs_for(N, K, 8)[0]
    for bad, words in ((dict(bk=96), "bk=96"), (dict(step=60), "step=60"), (dict(step=72), "step=72"),
                       (dict(step=56, fold="vec"), "'last' or a cluster fold")):
        with pytest.raises(ValueError, match=words):
            wg.validate(N, K, dataclasses.replace(base, **bad))
    with pytest.raises(ValueError, match="bk=128"):
        wg.validate(N, 1600, dataclasses.replace(base, bk=128, ksplit=1))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("K,N", [(7168, 3584), (7168, 6144), (1536, 7168)],
                         ids=["7168to3584", "7168to6144", "1536to7168"])
def test_tiled_defaults_give_the_plain_variants_bits(K, N):
    """The overlapping-tile, 128-k default equals the plain 64-row variant of its bucket bit for bit
    at M = 1, 8, 29, 64 (so the plain variant's accuracy evidence carries over), writes every column
    once and nothing past M, and replays in a CUDA graph to the same bits."""
    import dataclasses

    from fused import skinny_gemm as sg
    from fused import skinny_gemm_wgmma as wg
    for M in (1, 8, 29, 64):
        x, w = _case(M, N, K, seed=M)
        d = sg.default_wgmma(N, K, wg.m_pad_for(M))
        plain = dataclasses.replace(d, bk=wg.BK, step=0, stages=wg.stages_for(d.rows, d.m_pad, d.occupancy),
                                    fold="last")
        big = torch.full((M + 3, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = sg.skinny_gemm(x, w, out=big[:M], variant=d)
        assert torch.isnan(big[M:]).all() and not torch.isnan(got).any(), (d.name, M)
        want = sg.skinny_gemm(x, w, variant=plain)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (d.name, M)
    x, w = _case(64, N, K, seed=9)
    d = sg.default_wgmma(N, K, 64)
    _assert_rows_and_replays_match(x, w, d, sg.skinny_gemm(x, w, variant=d))


@pytest.mark.gpu
@needs_gpu
def test_two_spread_launches_on_two_streams_do_not_wait_on_each_other():
    """property_tests/spread_stream_stress.py in a child with a time limit: a filler matmul, a spread GEMM on a
    low-priority stream, another on a high-priority stream after a delay swept over the filler's
    run, 640 rounds; both results bitwise equal to the first. Launched as plain grids this hung
    (H200); a hang here is the child killed at the limit."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, os.path.join(root, "property_tests", "spread_stream_stress.py")],
                           capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("two spread launches on two streams hung (child killed after 120 s)")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "done 640 rounds" in r.stdout and "bitwise=True" in r.stdout, r.stdout[-2000:]


def test_sm_count_is_read_once_per_device(monkeypatch):
    """runtime.sm_count: the device's SM count (the persistent kda grid and the resident check of the
    spread fold size themselves from it), read from the driver once per device index."""
    import types

    import torch

    from fused import runtime
    calls = []

    def props(idx):
        calls.append(idx)
        return types.SimpleNamespace(multi_processor_count=100 + idx)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(runtime, "_sm_counts", {})
    assert [runtime.sm_count(d) for d in ("cuda:1", torch.device("cuda", 1), "cuda:3")] == [101, 101, 103]
    assert calls == [1, 3]
