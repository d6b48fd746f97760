"""fused/router_topk_latent_down.py (router_topk and the latent-down GEMV over the same h in one launch at
B = 1): the kernel compiles for sm_90a on a CPU-only machine at the K3 per-rank shapes with both top-k
kernels; its PTX has the router's one ticket between two gpu-scope fences; the one-launch rule and the
calls it hands to the two ops' own launches; bad arguments are refused in one line. On a CUDA device
(`@pytest.mark.gpu`): router_topk_onelaunch's and skinny_gemm's bits, CUDA-graph replays (the counter
back at zero), and a timing line beside the two launches.

Run on the GPU: `python -m pytest -q -m gpu -s property_tests/test_fused_router_topk_latent_down.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "router_topk_latent_down"
SHAPES = [(K3, 1), (K3, 8), (K3, 16), (SMALL, 1), (TINY, 1)]
SHAPE_IDS = ["k3-T1", "k3-T8", "k3-T16", "small", "tiny"]


def _dims(cfg, T: int):
    """(E, L, D, k): the router's experts, one rank's latent rows, the hidden size, top-k."""
    return cfg.n_experts, cfg.latent // T, cfg.hidden, cfg.top_k


@pytest.mark.parametrize("select", ["threshold", "rounds"])
@pytest.mark.parametrize("cfg,T", SHAPES, ids=SHAPE_IDS)
def test_both_top_k_kernels_compile_in_the_shared_grid(cfg, T, select):
    E, L, D, k = _dims(cfg, T)
    assert runtime.compile_for_cpu_check(OP, "bfloat16", E, L, D, k, select) is not None


@pytest.mark.parametrize("cfg,T", SHAPES, ids=SHAPE_IDS)
def test_the_grid_holds_both_launches_grids(cfg, T):
    """The halves are the router's grid (E / its columns per CTA) and skinny_gemm's pick at one token
    (the SIMT GEMV of one row), each of 128 threads."""
    from fused import router_topk_latent_down as m
    from fused import skinny_gemm as sg
    E, L, D, k = _dims(cfg, T)
    op = m.RouterTopkLatentDown("bfloat16", E, L, D, k, "threshold")
    assert op.latent.cfg == sg.default_config(1, L, D) == m.latent_config(1, L, D)
    assert op.n_r * op.router.gemm.nt == E and op.n_l * op.latent.nt == L
    assert op.router.gemm.threads == op.latent.threads == 128


def test_the_rule_takes_one_token_only():
    from fused import router_topk_latent_down as m
    for T in (1, 8, 16):
        E, L, D, k = _dims(K3, T)
        assert m.latent_config(1, L, D) is not None, T
        assert m.latent_config(2, L, D) is None and m.latent_config(0, L, D) is None


def test_ptx_has_the_router_s_ticket_between_gpu_scope_fences_and_spills_nothing(ptx_of, ptxas_regs):
    from property_tests.ptx_tickets import assert_one_ticket_between_fences
    E, L, D, k = _dims(K3, 8)
    ptx = ptx_of("from fused import router_topk_latent_down as m; "
                 f"m._compile('bfloat16', {E}, {L}, {D}, {k}, 'threshold')")
    assert_one_ticket_between_fences(ptx, ptxas_regs)


def test_over_one_token_the_calls_are_the_two_ops_own(monkeypatch):
    """B > 1: router_topk_onelaunch's router_topk (with the select's variant) and skinny_gemm into z."""
    from fused import router_topk_latent_down as m
    from fused import router_topk_onelaunch as rto
    from fused import skinny_gemm as sg
    seen = []
    monkeypatch.setattr(rto, "_check", lambda *a: None)
    monkeypatch.setattr(rto, "router_topk", lambda *a, **kw: seen.append(("router", a, kw)) or ("ids", "w"))
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **kw: seen.append(("gemm", a, kw)) or "z")
    h, wr, bias, wl = torch.empty(2, 64), torch.empty(8, 64), torch.empty(8), torch.empty(16, 64)
    assert m.router_topk_latent_down(h, wr, bias, 4, 2.5, wl, select="rounds") == ("ids", "w", "z")
    (_, ra, rkw), (_, ga, gkw) = seen
    assert ra[3:] == (4, 2.5) and rkw["variant"].select == "rounds"
    assert ga[1] is wl and tuple(gkw["out"].shape) == (2, 16)


def test_custom_op_registers_under_project_namespace():
    from fused import router_topk_latent_down as m
    m._custom_op()
    assert hasattr(torch.ops.verify_kernels, OP)


def _bad_cases():
    h = torch.empty(1, 64, dtype=torch.bfloat16)
    wr, bias, wl = torch.empty(8, 64, dtype=torch.bfloat16), torch.empty(8), torch.empty(16, 64, dtype=torch.bfloat16)
    yield "cpu", (h, wr, bias, 4, 2.5, wl), {}, ValueError, "x: the fused kernel needs a CUDA tensor"
    yield "bias", (h, wr, bias.half(), 4, 2.5, wl), {}, TypeError, "bias: expected float32 [8]"
    yield "top_k", (h, wr, bias, 9, 2.5, wl), {}, ValueError, "top_k: 9 must be an int in 1..8"
    yield "latent K", (h, wr, bias, 4, 2.5, wl[:, :32]), {}, ValueError, "w_latent_down: (16, 32) does not take h"
    yield "latent dtype", (h, wr, bias, 4, 2.5, wl.half()), {}, TypeError, "w_latent_down: dtype torch.float16"
    yield "select", (h, wr, bias, 4, 2.5, wl), {"select": "sort"}, ValueError, "select: 'sort' is not one of"
    yield "z_out", (h, wr, bias, 4, 2.5, wl), {"z_out": torch.empty(1, 32, dtype=torch.bfloat16)[:, ::2]}, ValueError, \
        "z_out: expected a contiguous torch.bfloat16 [1, 16]"


@pytest.mark.parametrize("name,args,kw,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_are_refused_in_one_line(name, args, kw, exc, msg):
    from fused.router_topk_latent_down import router_topk_latent_down
    with pytest.raises(exc) as info:
        router_topk_latent_down(*args, **kw)
    assert msg in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------- GPU only

def _inputs(cfg, T: int, seed: int = 0, dtype=torch.bfloat16, tied: bool = False):
    E, L, D, k = _dims(cfg, T)
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(1, D, device="cuda", generator=g).to(dtype)
    wr = (torch.randn(E, D, device="cuda", generator=g) * D ** -0.5).to(dtype)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    wl = (torch.randn(L, D, device="cuda", generator=g) * D ** -0.5).to(dtype)
    if tied:                # 4 distinct gate rows and biases: exact ties the lower id must win
        wr = wr[torch.arange(E, device="cuda") % 4].contiguous()
        bias = bias[torch.arange(E, device="cuda") % 4].contiguous()
    return h, wr, bias, k, wl


def _two_launches(h, wr, bias, k, wl, select=None):
    from fused import router_topk_onelaunch as rto
    from fused import skinny_gemm as sg
    variant = None if select is None else rto.variants({}, {})[rto.SELECTS.index(select)]
    return (*rto.router_topk(h, wr, bias, k, 2.5, variant=variant), sg.skinny_gemm(h, wl))


def _same(a, b) -> bool:
    return (torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
            and torch.equal(a[2].view(torch.int16), b[2].view(torch.int16)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("cfg,T", SHAPES, ids=SHAPE_IDS)
def test_the_two_launches_bits_with_either_select(cfg, T, tied):
    """The same logits GEMV and top-k code, the same latent GEMV: ids, weights and z bit for bit those of
    router_topk_onelaunch's and skinny_gemm's launches, both dtypes, several seeds."""
    from fused import router_topk_latent_down as m
    for dtype in (torch.bfloat16, torch.float16):
        for seed in range(3):
            h, wr, bias, k, wl = _inputs(cfg, T, seed, dtype, tied)
            for s in m.SELECTS:
                assert _same(m.router_topk_latent_down(h, wr, bias, k, 2.5, wl, select=s),
                             _two_launches(h, wr, bias, k, wl, s)), (dtype, seed, s)
            assert _same(m.router_topk_latent_down(h, wr, bias, k, 2.5, wl), _two_launches(h, wr, bias, k, wl))


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replays_give_the_eager_bits_and_leave_the_counter_at_zero():
    """Captured once, replayed on new inputs and poisoned outputs: every replay the eager bits of its
    inputs, so the router's last CTA was found each time."""
    from fused import router_topk_latent_down as m
    from fused import router_topk_onelaunch as rto
    h, wr, bias, k, wl = _inputs(K3, 8)
    ids, wts, z = m.router_topk_latent_down(h, wr, bias, k, 2.5, wl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.launch(h, wr, bias, k, 2.5, wl, ids, wts, z)
    for seed in range(1, 5):
        h.copy_(_inputs(K3, 8, seed)[0])
        ids.fill_(-1)
        wts.fill_(float("nan"))
        z.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _same((ids, wts, z), _two_launches(h, wr, bias, k, wl)), seed
    assert all(int(cnt.item()) == 0 for _, cnt in rto._buffers.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [8, 16])
def test_k3_time_beside_the_two_launches(T):
    """us per call at K3 per-rank shapes, B = 1 (CUDA-graph replays, weights not rotated: printed, not
    asserted)."""
    from fused import router_topk_latent_down as m
    from property_tests.gpu_timing import graph_us
    h, wr, bias, k, wl = _inputs(K3, T)
    one = lambda: m.router_topk_latent_down(h, wr, bias, k, 2.5, wl)
    two = lambda: _two_launches(h, wr, bias, k, wl)
    one(), two()
    a, b = graph_us(one), graph_us(two)
    print(f"\nrouter + latent down K3 T={T} B=1: one launch {a:.1f} us, two launches {b:.1f} us")
    assert a > 0 and b > 0
