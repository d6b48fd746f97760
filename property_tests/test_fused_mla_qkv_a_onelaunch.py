"""fused/mla_qkv_a_onelaunch.py (mla_qkv_a's GEMV and latent norms in one launch at B = 1): the kernel
compiles for sm_90a on a CPU-only machine with every norm variant at K3 and the CPU configs; the last
CTA plays the norm's threads in whole warps; its PTX has one ticket between two gpu-scope fences; the
one-launch rule and the calls it hands to fused.mla_qkv_a; bad arguments are refused in one line. On a
CUDA device (`@pytest.mark.gpu`): mla_qkv_a's bits for every norm variant, CUDA-graph replays (the
counter back at zero), and a timing line beside the two launches.

Run on the GPU: `python -m pytest -q -m gpu -s property_tests/test_fused_mla_qkv_a_onelaunch.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "mla_qkv_a_onelaunch"


def _dims(cfg):
    return cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.hidden


def _norms(cfg):
    from fused import mla_qkv_a as mq
    q, kv, rope, _ = _dims(cfg)
    return mq.NormConfig.all_configs((q + kv + rope) // 8)


@pytest.mark.parametrize("cfg", [K3, SMALL, TINY], ids=["k3", "small", "tiny"])
def test_every_norm_variant_compiles_in_the_one_launch(cfg):
    from fused import mla_qkv_a_onelaunch as m
    q, kv, rope, D = _dims(cfg)
    gemm = m.one_launch_gemm(1, q + kv + rope, D)
    for norm in _norms(cfg):
        assert runtime.compile_for_cpu_check(OP, "bfloat16", q, kv, rope, D, gemm, norm) is not None


def test_the_last_cta_plays_the_norm_s_threads_in_whole_warps():
    """At K3 the dispatcher's norm (288 threads, one vector each) is played in 3 rounds of 128 threads
    and the 128-thread variant (3 vectors each) in one; the GEMV is skinny_gemm's one-token pick."""
    from fused import mla_qkv_a_onelaunch as m
    from fused import skinny_gemm as sg
    q, kv, rope, D = _dims(K3)
    gemm = m.one_launch_gemm(1, q + kv + rope, D)
    assert gemm == sg.default_config(1, q + kv + rope, D)
    played = {n.num_threads: m.MlaQkvAOneLaunch("bfloat16", q, kv, rope, D, gemm, n) for n in _norms(K3)}
    assert {t: (op.rounds, op.vpt) for t, op in played.items()} == {128: (1, 3), 288: (3, 1)}
    assert all(op.n_ctas * op.gemm.nt == q + kv + rope for op in played.values())


def test_the_rule_takes_one_token_only():
    from fused import mla_qkv_a_onelaunch as m
    q, kv, rope, D = _dims(K3)
    assert m.one_launch_gemm(1, q + kv + rope, D) is not None
    assert m.one_launch_gemm(2, q + kv + rope, D) is None and m.one_launch_gemm(0, q + kv + rope, D) is None


def test_ptx_has_one_ticket_between_gpu_scope_fences_and_spills_nothing(ptx_of, ptxas_regs):
    from property_tests.ptx_tickets import assert_one_ticket_between_fences
    q, kv, rope, D = _dims(K3)
    ptx = ptx_of("from fused import mla_qkv_a_onelaunch as m, mla_qkv_a as mq, skinny_gemm as sg; "
                 f"m._compile('bfloat16', {q}, {kv}, {rope}, {D}, sg.SkinnyGemmConfig(1, 4), mq.NormConfig(288))")
    assert_one_ticket_between_fences(ptx, ptxas_regs)


def test_over_one_token_and_for_other_gemms_the_call_is_mla_qkv_a_s(monkeypatch):
    """B > 1, or a variant whose GEMM is not the one-token pick: fused.mla_qkv_a with the same arguments."""
    from fused import mla_qkv_a as mq
    from fused import mla_qkv_a_onelaunch as m
    from fused import skinny_gemm as sg
    seen = []
    monkeypatch.setattr(mq, "mla_qkv_a", lambda *a, **kw: seen.append((a, kw)) or "two launches")
    monkeypatch.setattr(mq, "_check", lambda *a: None)
    x, w = torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(72, 64, dtype=torch.bfloat16)
    qw, kvw = torch.empty(32, dtype=torch.bfloat16), torch.empty(32, dtype=torch.bfloat16)
    assert m.mla_qkv_a(x, w, qw, kvw, 1e-6) == "two launches"
    other = mq.MlaQkvAConfig(sg.SkinnyGemmConfig(2, 2), mq.NormConfig(32))
    assert m.mla_qkv_a(x[:1], w, qw, kvw, 1e-6, variant=other) == "two launches"
    assert seen[1][1] == {"out": None, "variant": other}


def test_custom_op_registers_under_project_namespace():
    from fused import mla_qkv_a_onelaunch as m
    m._custom_op()
    assert hasattr(torch.ops.verify_kernels, OP)


def test_bad_arguments_are_refused_in_one_line():
    """mla_qkv_a's checks, the same one-line errors."""
    from fused.mla_qkv_a_onelaunch import mla_qkv_a
    x, w = torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(72, 64, dtype=torch.bfloat16)
    qw, kvw = torch.empty(32, dtype=torch.bfloat16), torch.empty(32, dtype=torch.bfloat16)
    for args, exc, msg in (((x, w, qw, kvw, 1e-6), ValueError, "x: the fused kernel needs a CUDA tensor"),
                           ((x, w[:60], qw, kvw, 1e-6), ValueError, "w_qkv_a: 60 rows < q_lora 32"),
                           ((x, w, qw, kvw, 0.0), ValueError, "eps: must be > 0")):
        with pytest.raises(exc) as info:
            mla_qkv_a(*args)
        assert msg in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------- GPU only

def _inputs(cfg, seed: int = 0, dtype=torch.bfloat16):
    q, kv, rope, D = _dims(cfg)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(q + kv + rope, D, device="cuda", generator=g) * D ** -0.5).to(dtype)
    qw = (1 + 0.1 * torch.randn(q, device="cuda", generator=g)).to(dtype)
    kvw = (1 + 0.1 * torch.randn(kv, device="cuda", generator=g)).to(dtype)
    return x, w, qw, kvw


def _same(a, b) -> bool:
    return all(torch.equal(p.view(torch.int16), r.view(torch.int16)) for p, r in zip(a, b))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", [K3, SMALL, TINY], ids=["k3", "small", "tiny"])
def test_mla_qkv_a_s_bits_for_every_norm_variant(cfg, dtype):
    """The same GEMV code and the norm's own sums, played by 128 threads: q_c, kv_c and k_rot bit for bit
    those of fused.mla_qkv_a's two launches with each norm variant, several seeds."""
    from fused import mla_qkv_a as mq
    from fused import mla_qkv_a_onelaunch as m
    for seed in range(3):
        x, w, qw, kvw = _inputs(cfg, seed, dtype)
        for v in mq.variants({"x": x, "w_qkv_a": w}, {}):
            assert _same(m.mla_qkv_a(x, w, qw, kvw, 1e-6, variant=v), mq.mla_qkv_a(x, w, qw, kvw, 1e-6, variant=v)), v
        assert _same(m.mla_qkv_a(x, w, qw, kvw, 1e-6), mq.mla_qkv_a(x, w, qw, kvw, 1e-6)), seed


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replays_give_the_eager_bits_and_leave_the_counter_at_zero():
    from fused import mla_qkv_a_onelaunch as m
    x, w, qw, kvw = _inputs(K3)
    outs = m.mla_qkv_a(x, w, qw, kvw, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.mla_qkv_a(x, w, qw, kvw, 1e-6, out=outs)
    for seed in range(1, 5):
        x.copy_(_inputs(K3, seed)[0])
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _same(outs, m.mla_qkv_a(x, w, qw, kvw, 1e-6)), seed
    from fused import grid_sync
    kept = grid_sync.kept_under(OP)
    assert kept and all(int(cnt.item()) == 0 for _, cnt in kept)


@pytest.mark.gpu
@needs_gpu
def test_k3_time_beside_the_two_launches():
    """us per call at K3, B = 1 (CUDA-graph replays, weights not rotated: printed, not asserted)."""
    from fused import mla_qkv_a as mq
    from fused import mla_qkv_a_onelaunch as m
    from property_tests.gpu_timing import graph_us
    x, w, qw, kvw = _inputs(K3)
    one = lambda: m.mla_qkv_a(x, w, qw, kvw, 1e-6)
    two = lambda: mq.mla_qkv_a(x, w, qw, kvw, 1e-6)
    one(), two()
    a, b = graph_us(one), graph_us(two)
    print(f"\nmla_qkv_a K3 B=1: one launch {a:.1f} us, two launches {b:.1f} us")
    assert a > 0 and b > 0
