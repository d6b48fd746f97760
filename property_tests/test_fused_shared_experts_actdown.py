"""fused/shared_experts_actdown.py (the shared experts in two launches: SiTU-and-mul inside the down GEMV's
loads): the act-in-the-loads GEMV compiles for sm_90a on a CPU-only machine at every K3 per-rank shape and
SIMT bucket and the CPU configs, loads h by 16-byte vectors and spills nothing; the two launches run at one token where
the down GEMM is SIMT and shared_experts's three elsewhere; the act chunk is SituMul's arithmetic (the
one-line refusals of both forms: test_fused_shared_experts.py). On a CUDA device (`@pytest.mark.gpu`): the
op through the harness's whole pipeline, shared_experts's bits for every variant, a CUDA-graph replay, and
a timing line.

Run on the GPU: `python -m pytest -q -m gpu -s property_tests/test_fused_shared_experts_actdown.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from property_tests.test_fused_shared_experts import D3, K3_INTER, _inputs, _meta  # noqa: E402
from references.config import SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "shared_experts_actdown"
FORM = "fused.shared_experts_actdown:shared_experts"


@pytest.mark.parametrize("T", [1, 8, 16])
def test_every_simt_bucket_compiles_at_k3(T):
    from fused import skinny_gemm as sg
    for m in (1, 2, 4, 8):
        cfg = sg.SkinnyGemmConfig(m, sg._n_per_cta(D3, m))
        assert runtime.compile_for_cpu_check(OP, "bfloat16", D3, K3_INTER[T], cfg) is not None


@pytest.mark.parametrize("cfg", [SMALL, TINY], ids=["small", "tiny"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiles_at_the_cpu_configs(cfg, dtype):
    from fused import skinny_gemm as sg
    for inter in (cfg.shared_inter, 16, 8):
        assert runtime.compile_for_cpu_check(OP, dtype, cfg.hidden, inter, sg.simt_config(3, cfg.hidden, inter))


def test_ptx_loads_the_gate_and_up_chunks_by_16_bytes_without_spills(ptx_of, ptxas_regs):
    """Per chunk of a: the gate and up chunks of h and the weight chunk arrive by 16-byte loads; the
    sigmoid's exp is the accurate expf as in SituMul; nothing spills."""
    ptx = ptx_of("from fused import shared_experts_actdown as m, skinny_gemm as sg; "
                 "m._compile('bfloat16', 7168, 768, sg.SkinnyGemmConfig(1, 8))")
    assert ptx.count("ld.global.v4") >= 2 + 8 and "fma.rm.f32" in ptx
    regs, spills = ptxas_regs(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)


@pytest.mark.parametrize("T", [1, 8, 16])
def test_two_launches_at_one_token_where_the_down_gemm_is_simt(T):
    """At every K3 per-rank shape: B = 1 picks the SIMT down GEMV (two launches); above one token (each
    CTA would recompute B rows of activations), a tensor-core down variant and an intermediate that is
    not a multiple of 8 take shared_experts's three."""
    from fused import shared_experts as se
    from fused import shared_experts_actdown as m
    from fused import skinny_gemm as sg
    pair = m.two_launch_pick(1, D3, K3_INTER[T])
    assert pair is not None and pair == se.picks(1, D3, K3_INTER[T]), T
    for B in (2, 5, 8):
        assert isinstance(se.picks(B, D3, K3_INTER[T])[1], sg.SkinnyGemmConfig)
        assert m.two_launch_pick(B, D3, K3_INTER[T]) is None, (T, B)
    wgmma_down = next(v for v in se.variants(_meta(1, D3, K3_INTER[T]), {})
                      if not isinstance(v.down, sg.SkinnyGemmConfig))
    assert m.two_launch_pick(1, D3, K3_INTER[T], wgmma_down) is None
    assert m.two_launch_pick(1, 64, 12) is None


def test_launch_is_the_gate_up_gemm_then_the_act_down_gemv(monkeypatch):
    """launch() on the CPU with the kernels replaced by stand-ins computing their launch from the buffers
    they are handed: the gate_up GEMM into h [B, 2I] in wd, then one launch from h (no scratch a) with
    the betas as floats; the result is the reference's bits. Elsewhere it is shared_experts.launch."""
    from fused import shared_experts_actdown as m
    from references.moe import shared_experts as ref
    from references.primitives import linear, situ_and_mul
    B, D, inter = 1, 64, 32
    gen = torch.Generator().manual_seed(0)
    t = {k: torch.randn(v.shape, generator=gen).to(torch.bfloat16) for k, v in _meta(B, D, inter).items()}
    calls = []

    def gemm(x, w, out, variant=None):
        calls.append(("gemm", tuple(x.shape), tuple(w.shape)))
        out.copy_(linear(x, w))

    def act_down(h, w_down, out, beta, lbeta):
        assert h.shape == (B, 2 * inter) and h.dtype == torch.bfloat16
        assert isinstance(beta, float) and isinstance(lbeta, float)
        calls.append(("act_down", tuple(h.shape), tuple(w_down.shape)))
        out.copy_(linear(situ_and_mul(h, beta, lbeta), w_down))

    monkeypatch.setattr(m.sg, "launch", gemm)
    monkeypatch.setattr(m, "_compile", lambda *static: act_down)
    monkeypatch.setattr(m.runtime, "aligned", lambda t: t)
    out = torch.full((B, D), float("nan"), dtype=torch.bfloat16)
    m.launch(**t, situ_beta=4.0, situ_linear_beta=25.0, out=out)
    assert calls == [("gemm", (B, D), (2 * inter, D)), ("act_down", (B, 2 * inter), (D, inter))]
    assert torch.equal(out.view(torch.int16), ref(**t).view(torch.int16))
    three = []
    monkeypatch.setattr(m.se, "launch", lambda *a: three.append(a))
    m.launch(**_meta(B, D, 12, device="cpu"), situ_beta=4.0, situ_linear_beta=25.0, out=out)
    assert len(three) == 1 and calls[2:] == []
    m.launch(**_meta(2, D, inter, device="cpu"), situ_beta=4.0, situ_linear_beta=25.0, out=out[:1].expand(2, D))
    assert len(three) == 2 and calls[2:] == []


def test_the_act_chunk_is_situ_mul_s_arithmetic():
    """The chunk's expression is SituMul's, term for term (a change to one that the other lacks would
    break the two forms' equal bits, which the GPU test checks)."""
    import inspect

    from fused import shared_experts as se
    from fused import shared_experts_actdown as m
    exprs = lambda src: [ln.strip().replace("a.beta", "beta").replace("a.lbeta", "lbeta")
                         for ln in src.splitlines() if ln.strip().startswith(("sig =", "act =", "up =", "res[e] ="))]
    assert exprs(inspect.getsource(m._ActChunk.load)) == exprs(inspect.getsource(se.SituMul.device_kernel))
    assert len(exprs(inspect.getsource(m._ActChunk.load))) == 4


# ---------------------------------------------------------------------------------------- GPU only

HARNESS_CASES = [("k3", 1, "bfloat16", "normal", 8), ("k3", 8, "float16", "heavy_tailed", 16),
                 ("k3", 1, "bfloat16", "outliers", 1), ("small", 5, "bfloat16", "zero_rows", 1),
                 ("tiny", 3, "float16", "nonfinite", 8), ("small", 7, "bfloat16", "wide_range", 2),
                 ("small", 64, "bfloat16", "normal", 1)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,batch,dtype,dist,tp", HARNESS_CASES,
                         ids=[f"{c[0]}-B{c[1]}-{c[2]}-{c[3]}-T{c[4]}" for c in HARNESS_CASES])
def test_every_variant_through_the_harness(config, batch, dtype, dist, tp):
    from property_tests.harness_case import judge_case
    from verify.model.case import Case
    v = judge_case(Case("shared_experts", 11, batch, config, dtype, dist, tp), candidate=FORM)
    assert v.status == "pass", f"{v.stage}: {v.reason}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 8, 16])
def test_shared_experts_s_bits_for_every_variant(T):
    """Two launches or three at one token: the same h, the same activations rounded to wd, the same GEMV
    order."""
    from fused import shared_experts as se
    from fused import shared_experts_actdown as m
    B = 1
    for seed in range(2):
        t = _inputs(B, K3_INTER[T], seed=seed)
        for v in se.variants(t, {}):
            assert torch.equal(m.shared_experts(**t, variant=v).view(torch.int16),
                               se.shared_experts(**t, variant=v).view(torch.int16)), v.name


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replay_gives_the_eager_bits():
    """start() captured (fork and join are graph edges), replayed after the inputs change in place."""
    from fused.shared_experts_actdown import shared_experts
    t = _inputs(1, K3_INTER[8])
    shared_experts(**t)
    torch.cuda.synchronize()
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = shared_experts(**t)
        copy = out * 1
    fresh = _inputs(1, K3_INTER[8], seed=1)
    for k in t:
        t[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    want = shared_experts(**t)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(copy.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@needs_gpu
def test_k3_time_beside_the_three_launches():
    """us per call at K3 per-rank shapes, one token (CUDA-graph replays, weights not rotated: printed, not
    asserted)."""
    from fused import shared_experts as se
    from fused import shared_experts_actdown as m
    from property_tests.gpu_timing import graph_us
    B = 1
    for T in (1, 8, 16):
        t = _inputs(B, K3_INTER[T])
        two = lambda: m.shared_experts(**t)
        three = lambda: se.shared_experts(**t)
        two(), three()
        a, b = graph_us(two), graph_us(three)
        print(f"\nshared_experts K3 T={T} B={B}: two launches {a:.1f} us, three launches {b:.1f} us")
        assert a > 0 and b > 0
