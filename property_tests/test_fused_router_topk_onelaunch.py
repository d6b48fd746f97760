"""fused/router_topk_onelaunch.py (router_topk's logits GEMV and top-k in one launch at B = 1): both
top-k kernels compile for sm_90a on a CPU-only machine at K3 and the CPU configs; above one token the
call is fused.router_topk's; bad arguments are refused in one line. On a CUDA device (`@pytest.mark.gpu`):
the op through the harness's whole pipeline, router_topk's bits, CUDA-graph replays (the ticket counter
back at zero after every launch), two streams at once, and a timing line beside the two launches.

Run on the GPU: `python -m pytest -q -m gpu -s property_tests/test_fused_router_topk_onelaunch.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "router_topk_onelaunch"
FORM = "fused.router_topk_onelaunch:router_topk"


@pytest.mark.parametrize("cfg", [K3, SMALL, TINY], ids=["k3", "small", "tiny"])
@pytest.mark.parametrize("select", ["threshold", "rounds"])
def test_both_top_k_kernels_compile_in_the_one_launch(cfg, select):
    E, D = cfg.n_experts, cfg.hidden
    assert runtime.compile_for_cpu_check(OP, "bfloat16", E, D, cfg.top_k, select) is not None


def test_the_variants_are_the_128_thread_top_k_kernels():
    from fused import router_topk_onelaunch as m
    listed = m.variants({}, {})
    assert sorted(v.select for v in listed) == ["rounds", "threshold"]
    assert all((v.tokens_per_cta, v.warps_per_token, v.gemm) == (1, 4, None) for v in listed)


def test_the_grid_is_the_gemv_s_and_its_block_the_select_s():
    """The select of one token runs in 4 warps: the GEMV's 128 threads; the last ticket is n_ctas - 1."""
    from fused import router_topk_onelaunch as m
    from fused import skinny_gemm as sg
    op = m.RouterTopkOneLaunch("bfloat16", K3.n_experts, K3.hidden, K3.top_k, "threshold")
    assert op.gemm.threads == 128 == sg.THREADS
    assert op.gemm.cfg == sg.simt_config(1, K3.n_experts, K3.hidden)


def test_ptx_releases_the_logits_before_the_ticket_and_spills_nothing(ptx_of, ptxas_regs):
    """At K3: a gpu-scope acq_rel fence before the ticket, the ticket an acq_rel gpu-scope atomic add, a
    fence again before the last CTA reads the logits, and no register spills."""
    from property_tests.ptx_tickets import assert_one_ticket_between_fences
    ptx = ptx_of("from fused import router_topk_onelaunch as m; m._compile('bfloat16', 896, 7168, 16, 'threshold')")
    assert_one_ticket_between_fences(ptx, ptxas_regs)


def test_over_one_token_the_call_is_router_topk_s(monkeypatch):
    """B > ONE_LAUNCH_MAX: fused.router_topk with the same arguments and variant (its two launches)."""
    from fused import router_topk as rt
    from fused import router_topk_onelaunch as m
    seen = []
    monkeypatch.setattr(rt, "router_topk", lambda *a, **kw: seen.append((a, kw)) or "two launches")
    x, w, bias = torch.empty(2, 64), torch.empty(8, 64), torch.empty(8)
    variant = m.variants({}, {})[1]
    assert m.router_topk(x, w, bias, 4, 2.5, variant=variant) == "two launches"
    assert seen[0][0][3:] == (4, 2.5) and seen[0][1] == {"variant": variant}


def test_custom_op_registers_under_project_namespace():
    from fused import router_topk_onelaunch as m
    m._custom_op()
    assert hasattr(torch.ops.verify_kernels, OP)


def _bad_cases():
    x, w, bias = torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(8, 64, dtype=torch.bfloat16), torch.empty(8)
    yield "cpu", (x, w, bias, 4), ValueError, "x: the fused kernel needs a CUDA tensor"
    yield "fp32", (x.float(), w.float(), bias, 4), TypeError, "x: dtype torch.float32"
    yield "K", (x, torch.empty(8, 32, dtype=torch.bfloat16), bias, 4), ValueError, "w: K=32 does not match"
    yield "bias", (x, w, bias.half(), 4), TypeError, "bias: expected float32 [8]"
    yield "top_k", (x, w, bias, 9), ValueError, "top_k: 9 must be an int in 1..8"


@pytest.mark.parametrize("name,args,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_are_refused_in_one_line(name, args, exc, msg):
    from fused.router_topk_onelaunch import router_topk
    with pytest.raises(exc) as info:
        router_topk(*args, 2.5)
    assert msg in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------- GPU only

HARNESS_CASES = [("k3", 1, "bfloat16", "normal", 1), ("k3", 1, "float16", "near_ties", 1),
                 ("k3", 1, "bfloat16", "near_ties", 8), ("small", 1, "bfloat16", "wide_range", 1),
                 ("tiny", 1, "float16", "outliers", 1), ("small", 3, "bfloat16", "normal", 1)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,batch,dtype,dist,tp", HARNESS_CASES,
                         ids=[f"{c[0]}-B{c[1]}-{c[2]}-{c[3]}-T{c[4]}" for c in HARNESS_CASES])
def test_every_variant_through_the_harness(config, batch, dtype, dist, tp):
    from property_tests.harness_case import judge_case
    from verify.model.case import Case
    v = judge_case(Case("router_topk", 11, batch, config, dtype, dist, tp), candidate=FORM)
    assert v.status == "pass", f"{v.stage}: {v.reason}"


def _inputs(E: int, D: int, seed: int = 0, B: int = 1, tied: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    if tied:                # 4 distinct gate rows and biases: exact ties the lower id must win
        w = w[torch.arange(E, device="cuda") % 4].contiguous()
        bias = bias[torch.arange(E, device="cuda") % 4].contiguous()
    return x, w, bias


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("E,k,D", [(896, 16, 7168), (48, 8, 1024), (20, 16, 256)])
def test_router_topk_s_bits_with_either_select(E, k, D, tied):
    """The same SIMT logits and the same top-k code: ids and weights bit for bit those of
    fused.router_topk's two launches with that select, several seeds."""
    from fused import router_topk as rt
    from fused import router_topk_onelaunch as m
    for seed in range(3):
        x, w, bias = _inputs(E, D, seed, tied=tied)
        for v in m.variants({}, {}):
            assert _same(m.router_topk(x, w, bias, k, 2.5, variant=v), rt.router_topk(x, w, bias, k, 2.5, variant=v)), v.name
        assert _same(m.router_topk(x, w, bias, k, 2.5), rt.router_topk(x, w, bias, k, 2.5))


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replays_give_the_eager_bits_and_leave_the_counter_at_zero():
    """Captured once, replayed on new inputs and poisoned outputs: every replay the eager bits of its
    inputs, so the last CTA was found each time (the counter starts every launch at zero)."""
    from fused import router_topk_onelaunch as m
    x, w, bias = _inputs(896, 7168)
    ids, wts = torch.empty(1, 16, dtype=torch.int64, device="cuda"), torch.empty(1, 16, device="cuda")
    m.launch(x, w, bias, 16, 2.5, ids, wts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.launch(x, w, bias, 16, 2.5, ids, wts)
    for seed in range(1, 5):
        x.copy_(_inputs(896, 7168, seed)[0])
        ids.fill_(-1)
        wts.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _same((ids, wts), m.router_topk(x, w, bias, 16, 2.5)), seed
    assert all(int(cnt.item()) == 0 for _, cnt in m._buffers.values())


@pytest.mark.gpu
@needs_gpu
def test_two_streams_at_once_keep_their_own_counters():
    """Routers on two streams overlapping (the layer's side stream): each stream's launches take tickets
    from its own counter, so both give their eager bits every time."""
    from fused import router_topk_onelaunch as m
    (xa, w, bias), xb = _inputs(896, 7168, 1), _inputs(896, 7168, 2)[0]
    want_a, want_b = m.router_topk(xa, w, bias, 16, 2.5), m.router_topk(xb, w, bias, 16, 2.5)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = {0: [], 1: []}
    for _ in range(20):
        for i, (s, x) in enumerate(zip(streams, (xa, xb))):
            with torch.cuda.stream(s):
                got[i].append(m.router_topk(x, w, bias, 16, 2.5))
    torch.cuda.synchronize()
    assert all(_same(r, want_a) for r in got[0]) and all(_same(r, want_b) for r in got[1])


@pytest.mark.gpu
@needs_gpu
def test_k3_time_beside_the_two_launches():
    """us per call at K3, B = 1 (CUDA-graph replays, weights not rotated: printed, not asserted)."""
    from fused import router_topk as rt
    from fused import router_topk_onelaunch as m
    from property_tests.gpu_timing import graph_us
    x, w, bias = _inputs(896, 7168)
    one = lambda: m.router_topk(x, w, bias, 16, 2.5)
    two = lambda: rt.router_topk(x, w, bias, 16, 2.5)
    one(), two()
    a, b = graph_us(one), graph_us(two)
    print(f"\nrouter_topk K3 B=1: one launch {a:.1f} us, two launches {b:.1f} us")
    assert a > 0 and b > 0
