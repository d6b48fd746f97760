"""fused/router_topk.py and its top-k kernel fused/router_topk_select.py: every variant compiles for
sm_90a on a CPU-only machine, the select's loads precede its first division, bad k is refused;
ids, weights, bitwise agreement of the logits paths and CUDA-graph replays are checked on a CUDA
device only (skipped here with the reason, never counted as passed)."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


# ---------------------------------------------------------------------------------------- GPU only

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
