"""fused/skinny_gemm.py and its SIMT kernel fused/skinny_gemm_mma.py: every static configuration and
variant compiles for sm_90a on a CPU-only machine; a new batch size reuses the compiled kernel; the
default is a certified variant. Numerics are checked on a CUDA device only (skipped here with the
reason, never counted as passed)."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GEMM_SHAPES = [(7168, 49152), (7168, 6144), (12288, 7168), (1536, 7168), (7168, 3584), (7168, 896)]


@pytest.mark.parametrize("K,N", GEMM_SHAPES, ids=[f"{k}to{n}" for k, n in GEMM_SHAPES])
def test_skinny_gemm_compiles_every_variant(K, N):
    """The SIMT variants; the wgmma ones compile in test_fused_skinny_gemm_wgmma.py."""
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
