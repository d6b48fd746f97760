"""Every CuTe DSL kernel of skinny_gemm, mxfp4_dequant, mla_cache_write and router_topk compiles for sm_90a on a CPU-only machine, for each static
configuration and variant it supports; a new batch size reuses the compiled kernel; numerics are
checked on a CUDA device only (skipped here with the reason, never counted as passed)."""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GEMM_SHAPES = [(7168, 49152), (7168, 6144), (12288, 7168), (1536, 7168), (7168, 3584), (7168, 896)]


def test_runtime_import_is_lazy():
    import subprocess
    import sys
    code = "import sys, fused, fused.runtime; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("K,N", GEMM_SHAPES, ids=[f"{k}to{n}" for k, n in GEMM_SHAPES])
def test_skinny_gemm_compiles_every_variant(K, N):
    """The SIMT variants; the wgmma ones compile in test_fused_compile_wgmma.py."""
    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    for cfg in sg.all_configs(N, K):
        if isinstance(cfg, SkinnyGemmWgmmaConfig):
            continue
        assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) is not None


@pytest.mark.parametrize("K,N", GEMM_SHAPES, ids=[f"{k}to{n}" for k, n in GEMM_SHAPES])
def test_mma_kernel_configs_compile(K, N):
    """The mma.sync kernel (router_topk's logits; skinny_gemm's dispatcher no longer picks it):
    every config of every m_pad bucket compiles for sm_90a; all share warps_for(K), the reduction
    order (batch invariance)."""
    from fused import skinny_gemm_mma as mma
    cfgs = [c for p in (8, 16, 32, 64) for c in mma.configs_for(N, K, p)]
    assert {c.m_pad for c in cfgs} == {8, 16, 32, 64}
    assert {c.warps for c in cfgs} == {mma.warps_for(K)}
    for cfg in cfgs:
        assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) is not None


def test_skinny_gemm_mma_fp16_and_fp32_out_compile():
    from fused.skinny_gemm_mma import configs_for
    cfg = configs_for(7168, 1536, 16)[0]
    runtime.compile_for_cpu_check("skinny_gemm", "float16", "float16", 7168, 1536, cfg)
    runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "float32", 7168, 1536, cfg)


def test_skinny_gemm_default_is_a_certified_variant():
    """The dispatcher's pick for every M is one of the variants the harness certifies at that M
    (`variants()`), M = 1 stays on the SIMT kernel, a wgmma pick's token tile covers M."""
    import torch

    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    for K, N in GEMM_SHAPES:
        assert isinstance(sg.default_config(1, N, K), sg.SkinnyGemmConfig)
        for M in range(1, 65):
            cfg = sg.default_config(M, N, K)
            listed = sg.variants({"x": torch.empty(M, K, device="meta"), "w": torch.empty(N, K, device="meta")}, {})
            assert cfg in listed, (K, N, M, cfg)
            if isinstance(cfg, SkinnyGemmWgmmaConfig):
                assert cfg.m_pad >= M and N % cfg.rows == 0


def test_skinny_gemm_fp16_and_fp32_out_compile():
    from fused import skinny_gemm as sg
    cfg = sg.default_config(8, 7168, 1536)
    runtime.compile_for_cpu_check("skinny_gemm", "float16", "float16", 7168, 1536, cfg)
    runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "float32", 7168, 1536, cfg)


def test_skinny_gemm_new_batch_size_does_not_recompile(ir_of):
    """A new batch size reuses the compiled kernel: the dispatcher picks one config for every M of a
    bucket (the compile key is dtype, N, K and config, no M), and that kernel was compiled with a
    dynamic batch: x and y are (?, K) and (?, N) in its host IR, only the weight is static."""
    from fused import skinny_gemm as sg
    N, K = 896, 7168
    keys = {sg.default_config(M, N, K) for M in (5, 6, 7, 8)}        # one m_tile bucket
    assert len(keys) == 1
    ir = ir_of("from fused import skinny_gemm as sg; "
               f"sg._compile('bfloat16', 'bfloat16', {N}, {K}, sg.default_config(5, {N}, {K}))")
    assert f'"(?,{K}):({K},1)"' in ir and f'"(?,{N}):({N},1)"' in ir and f'"({N},{K}):({K},1)"' in ir


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_mxfp4_dequant_compiles_every_variant(out_dtype):
    from fused import mxfp4_dequant as fm
    cfgs = fm.all_configs(out_dtype)
    assert fm.default_config(out_dtype) in cfgs and any(c.bulk for c in cfgs) == (out_dtype == "bfloat16")
    for cfg in cfgs:
        runtime.compile_for_cpu_check("mxfp4_dequant", out_dtype, cfg)


def test_mxfp4_dequant_bulk_variant_stores_through_one_bulk_copy(ptx_of):
    """The bf16 default writes its output span with one bulk async copy from shared memory after a
    proxy fence, and no st.global; it waits for the copy's reads before exiting."""
    ptx = ptx_of("from fused import mxfp4_dequant as fm; fm._compile('bfloat16', fm.default_config('bfloat16'))")
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 1
    assert "fence.proxy.async.shared::cta" in ptx and re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
    assert "st.global" not in ptx and ptx.count("st.shared.v4.b32") == 4 and ".local" not in ptx


def test_mxfp4_dequant_bulk_variant_refuses_other_dtypes():
    from fused import mxfp4_dequant as fm
    with pytest.raises(ValueError, match="bf16 only"):
        fm.Mxfp4Dequant(fm.Mxfp4DequantConfig(256, 4, bulk=True), "float16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mla_cache_write_compiles_every_variant(dtype):
    from fused import mla_cache_write as fm
    for cfg in fm.all_configs():
        runtime.compile_for_cpu_check("mla_cache_write", dtype, 576, cfg)


@pytest.mark.parametrize("E,k,D", [(896, 16, 7168), (48, 8, 1024)])
def test_router_topk_compiles_every_variant(E, k, D):
    from fused import router_topk as fr
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    wg = E % 64 == 0                    # the wgmma logits (every token bucket) need 64-row blocks
    for cfg in fr.all_configs():
        fns = fr.compile_all_for("bfloat16", E, D, k, cfg)
        # SIMT + mma.sync in 4 token buckets (+ wgmma cpush and partials in 4), each with its top-k kernel
        assert len(fns) == (26 if wg else 10) and all(f is not None for f in fns)
    mid, big = fr.logits_config(16, E, D), fr.logits_config(64, E, D)
    assert mid.fresh_acc and mid.ksplit > 1 and type(mid) is type(big)
    if wg:      # wgmma: its split-K partials folded in each column block's cluster (cpush, S = 8),
        # fresh accumulators per k-tile; no fold that spins on split peers across the grid (two
        # streams could deadlock); the top-k kernel reads fp32 logits
        assert isinstance(big, SkinnyGemmWgmmaConfig) and fr.partials(big) == 1
        assert (big.fold, big.ksplit) == ("cpush", 8) and big.fresh_acc
    else:
        assert big.fresh_acc and fr.partials(big) == big.ksplit > 1


@pytest.mark.parametrize("S", [1, 7, 9])
def test_router_topk_select_loads_everything_before_the_first_sigmoid(ptx_of, S):
    """Every logit partial and bias load precedes the first IEEE division: behind a division's
    slow-path branch ptxas does not hoist loads, and the round trips then run one after another
    (H200: the top-k kernel 3.55 -> 2.59 us at B = 1 when this was fixed)."""
    ptx = ptx_of(f"from fused import router_topk as fr; fr._compile(896, 16, 1, {S}, 4, 'threshold')")
    body = ptx[ptx.index(".entry"):]
    first_div = min(body.index(op) for op in ("rcp.rn.f32", "div.rn.f32") if op in body)
    assert body.count("ld.global") == 7 * (S + 1)            # 7 experts per thread: S partials + bias each
    assert "ld.global" not in body[first_div:]
    assert ".local" not in ptx                                # no register spills


def test_router_topk_variants_cover_every_logits_path():
    """Each launch variant a token count can take is certified: the four top-k kernels with the
    default logits, and the default top-k with every other logits path that applies at that M."""
    from fused import router_topk as fr
    x = lambda M: torch.empty(M, 7168, dtype=torch.bfloat16)
    w = torch.empty(896, 7168, dtype=torch.bfloat16)
    kinds = lambda M: sorted(type(v.gemm).__name__ for v in fr.variants({"x": x(M), "w_gate": w}, {}) if v.gemm)
    wg = ["SkinnyGemmWgmmaConfig"]
    assert kinds(1) == wg + wg                                           # SIMT default; both wgmma folds certified
    assert all(kinds(M) == ["SkinnyGemmConfig", "SkinnyGemmMmaConfig"] + wg for M in (2, 8, 9, 16, 17, 64))  # cpush default, partials too
    assert kinds(65) == []                                               # over 64 tokens: the SIMT GEMV only
    parts = {M: fr.partials(fr.logits_config(M, 896, 7168)) for M in range(1, 65)}
    assert all(p == 1 for p in parts.values())                          # no split-K left for the top-k to fold


def test_router_topk_rejects_k_over_warp():
    from fused import router_topk as fr
    with pytest.raises(ValueError, match="top_k"):
        fr.RouterTopk(896, 33, fr.RouterTopkConfig())
    with pytest.raises(ValueError, match="warps_per_token"):
        fr.RouterTopk(896, 16, fr.RouterTopkConfig(4, None, 4))
    with pytest.raises(ValueError, match="one token per CTA"):
        fr.RouterTopk(896, 16, fr.RouterTopkConfig(4, None, 1))            # threshold select, 4 tokens


def test_custom_ops_register_under_project_namespace():
    from fused import mla_cache_write, mxfp4_dequant, router_topk, skinny_gemm
    for mod in (skinny_gemm, mxfp4_dequant, mla_cache_write, router_topk):
        mod._custom_op()
    for name in ("skinny_gemm", "mxfp4_dequant", "mla_cache_write", "router_topk"):
        assert hasattr(torch.ops.verify_kernels, name)


# ---------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_skinny_gemm_matches_float64(M):
    from fused.skinny_gemm import skinny_gemm
    x = torch.randn(M, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 1536, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    base = torch.nn.functional.linear(x, w).double()
    got = skinny_gemm(x, w).double()
    assert (got - ref).abs().max() <= 2 * (base - ref).abs().max() + 1e-6


@pytest.mark.gpu
@needs_gpu
def test_skinny_gemm_mma_matches_float64_and_is_batch_invariant():
    from fused.skinny_gemm import skinny_gemm
    from fused.skinny_gemm_mma import configs_for
    x = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 1536, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    base = torch.nn.functional.linear(x, w).double()
    for c64, c8 in zip(configs_for(7168, 1536, 64), configs_for(7168, 1536, 8)):
        got = skinny_gemm(x, w, variant=c64)
        assert (got.double() - ref).abs().max() <= 2 * (base - ref).abs().max() + 1e-6
        assert torch.equal(got, skinny_gemm(x, w, variant=c64))
        one = skinny_gemm(x[5:6].clone(), w, variant=c8)
        assert torch.equal(one.view(torch.int16), got[5:6].view(torch.int16))


@pytest.mark.gpu
@needs_gpu
def test_mxfp4_dequant_bitwise():
    """Every variant and output dtype, every code, the extreme scale bytes (0: subnormal scale,
    254: overflow to inf, 255: NaN), a row count that leaves a partial CTA, and an offset input."""
    from fused.mxfp4_dequant import all_configs, mxfp4_dequant
    from references.mxfp4 import mxfp4_dequant as ref_dq
    packed = torch.randint(0, 256, (67, 512), dtype=torch.uint8)
    scale = torch.randint(0, 255, (67, 32), dtype=torch.uint8)
    scale[:8, :8] = torch.tensor([0, 1, 2, 126, 127, 253, 254, 255], dtype=torch.uint8)
    base = torch.zeros(67 * 512 + 5, dtype=torch.uint8)
    base[5:] = packed.reshape(-1)
    offset = base[5:].view(67, 512)                  # not 16-byte aligned
    for dt in ("bfloat16", "float16", "float32"):
        ref = ref_dq(packed, scale, dt)
        nan = ref.isnan()
        for cfg in all_configs(dt):
            for pk in (packed.cuda(), offset.cuda()):
                got = mxfp4_dequant(pk, scale.cuda(), dt, variant=cfg).cpu()
                assert torch.equal(got.isnan(), nan), (dt, cfg)
                assert torch.equal(got[~nan], ref[~nan]), (dt, cfg)
                assert torch.equal(got[~nan].signbit(), ref[~nan].signbit()), (dt, cfg)
        assert torch.equal(mxfp4_dequant(packed.cuda(), scale.cuda(), dt).cpu().nan_to_num(),
                           ref.nan_to_num())


@pytest.mark.gpu
@needs_gpu
def test_mla_cache_write_bitwise():
    from fused.mla_cache_write import mla_cache_write
    from references.mla import mla_cache_write as ref_cw
    cache = torch.randn(16, 64, 576, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(9, 576, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(16 * 64, device="cuda")[:9]
    slots[::2] = -1
    ref = cache.clone()
    ref_cw(latent, ref, slots)
    mla_cache_write(latent, cache, slots)
    assert torch.equal(ref.view(torch.int16), cache.view(torch.int16))


@pytest.mark.gpu
@needs_gpu
def test_router_topk_ids_and_weights():
    from fused.router_topk import router_topk
    from references.moe import router_topk as ref_rt
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(48, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(48, device="cuda") * 0.01
    rid, rw = ref_rt(x, w, bias, 8, 2.5)
    ids, wts = router_topk(x, w, bias, 8, 2.5)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(wts, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("E,k,D", [(896, 16, 7168), (48, 8, 1024), (20, 16, 256)])
@pytest.mark.parametrize("B", [1, 5, 64])
def test_router_topk_kernels_agree_bit_for_bit(B, E, k, D, tied):
    """The threshold select and the argmax rounds (one warp or four per token) compute the same ids,
    sigmoids and sum. `tied`: 4 distinct gate
    rows and biases, so every token's choice has exact ties the lower id must win. E = 20 < 128
    threads: most threads of the 4-warp kernels hold no expert."""
    from fused import router_topk as fr
    g = torch.Generator(device="cuda").manual_seed(B * 7 + E)
    x = torch.randn(B, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    if tied:
        w = w[torch.arange(E, device="cuda") % 4].contiguous()
        bias = bias[torch.arange(E, device="cuda") % 4].contiguous()
    cfgs = fr.all_configs()
    outs = [fr.router_topk(x, w, bias, k, 2.5, variant=c) for c in cfgs]
    assert cfgs[0].select == "threshold" and cfgs[1].select == "rounds"
    for c, (ids, wts) in zip(cfgs[1:], outs[1:]):
        assert torch.equal(ids, outs[0][0]), c.name
        assert torch.equal(wts.view(torch.int32), outs[0][1].view(torch.int32)), c.name
    assert all(len(set(r)) == k for r in outs[0][0].tolist())        # k distinct experts per token


@pytest.mark.gpu
@needs_gpu
def test_skinny_gemm_unaligned_views_give_the_aligned_bits():
    """x and w as views 2 bytes past a 16-byte boundary: copied to aligned storage, same bits."""
    from fused.skinny_gemm import skinny_gemm
    for M in (1, 8, 33):
        x = torch.randn(M, 1536, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(7168, 1536, device="cuda", dtype=torch.bfloat16)
        xb = torch.empty(M * 1536 + 1, device="cuda", dtype=torch.bfloat16)
        wb = torch.empty(7168 * 1536 + 1, device="cuda", dtype=torch.bfloat16)
        xb[1:].copy_(x.reshape(-1))
        wb[1:].copy_(w.reshape(-1))
        got = skinny_gemm(xb[1:].view(M, 1536), wb[1:].view(7168, 1536))
        assert torch.equal(got.view(torch.int16), skinny_gemm(x, w).view(torch.int16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("select", ["threshold", "rounds"])
def test_router_topk_in_a_cuda_graph(B, select):
    """The two launches captured in a CUDA graph replay to the bits of an eager call, on poisoned
    outputs and logits every replay."""
    from fused import router_topk as fr
    cfg = fr.RouterTopkConfig(select=select)
    g = torch.Generator(device="cuda").manual_seed(B)
    x = torch.randn(B, 7168, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(896, 7168, device="cuda", generator=g) * 7168 ** -0.5).to(torch.bfloat16)
    bias = torch.randn(896, device="cuda", generator=g) * 0.01
    ids_ref, w_ref = fr.router_topk(x, w, bias, 16, 2.5)
    ids = torch.empty_like(ids_ref)
    wts = torch.empty_like(w_ref)
    logits = fr.logits_workspace(B, 896, 7168, "cuda")
    fr.launch(x, w, bias, 16, 2.5, ids, wts, logits, cfg)          # warm-up: compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fr.launch(x, w, bias, 16, 2.5, ids, wts, logits, cfg)
    for _ in range(3):
        ids.fill_(-1)
        wts.fill_(float("nan"))
        logits.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids, ids_ref)
        assert torch.equal(wts.view(torch.int32), w_ref.view(torch.int32))
