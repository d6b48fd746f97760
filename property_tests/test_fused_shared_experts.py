"""fused/shared_experts.py: the SiTU-and-mul kernel compiles for sm_90a on a CPU-only machine at every K3
per-rank intermediate (6144 / T for T = 1, 8, 16) and the tiny and small configs, as do the GEMMs the
dispatcher picks at K3; the dispatcher's picks are certified variants; a new batch size reuses the
compiled kernel; bad arguments are refused in one line; launch() chains the three launches in the
reference's rounding order. On a CUDA device (`@pytest.mark.gpu`): every variant through the
harness's whole pipeline, a CUDA graph replay (fork and join captured) against the eager bits, batch
invariance within each variant, the side stream against the fused routed experts running at the same
time on the main stream (both bitwise equal to each alone, eager and in a graph), twins without the
fork or without the join caught reading stale data, and timing tables.

Run on the H200: `python -m pytest -q -m gpu -s property_tests/test_fused_shared_experts.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TP = (1, 8, 16)
K3_INTER = {T: K3.shared_inter // T for T in TP}        # 6144, 768, 384 per rank
D3 = K3.hidden


def _meta(B, D, inter, dtype=torch.bfloat16, device="meta"):
    kw = dict(dtype=dtype, device=device)
    return dict(x=torch.empty(B, D, **kw), w_gate_up=torch.empty(2 * inter, D, **kw),
                w_down=torch.empty(D, inter, **kw))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_situ_mul_compiles_at_k3_per_rank_and_cpu_configs(dtype):
    """One compile per (dtype, I): K3 at T = 1, 8, 16 and the tiny / small intermediates of every split
    (a width that is not a multiple of 8 runs padded to the next one)."""
    widths = set(K3_INTER.values())
    widths |= {-(-(c.shared_inter // T) // 8) * 8 for c in (TINY, SMALL) for T in (1, 2, 4, 8, 16)}
    for inter in sorted(widths):
        assert runtime.compile_for_cpu_check("shared_experts", dtype, inter) is not None


@pytest.mark.parametrize("T", TP)
def test_the_gemms_the_dispatcher_picks_compile_at_k3(T):
    """Launches 1 and 3 are skinny_gemm at (2I, D) and (D, I): this module's picks for B = 1, 8, 64 compile
    (the rest of its variants compile in test_fused_skinny_gemm*.py)."""
    from fused import shared_experts as fm
    inter = K3_INTER[T]
    for i, (N, K) in enumerate(((2 * inter, D3), (D3, inter))):
        for cfg in {fm.picks(B, D3, inter)[i] for B in (1, 8, 64)}:
            assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) is not None


@pytest.mark.parametrize("T", TP)
def test_dispatchers_picks_are_certified_variants(T):
    """For every B the pair the dispatcher launches is in variants(), is skinny_gemm's pair wherever this
    module has no measured pair of its own, is made of variants skinny_gemm certifies at that M, and
    every GEMM variant skinny_gemm certifies at that M for each launch is listed."""
    from fused import shared_experts as fm
    from fused import skinny_gemm as sg
    inter = K3_INTER[T]
    for B in range(1, 65):
        t = _meta(B, D3, inter)
        listed = fm.variants(t, {})
        pick = fm.picks(B, D3, inter)
        assert listed[0] == fm.SharedExpertsConfig(*pick)
        if B <= 32:
            assert pick == (sg.default_config(B, 2 * inter, D3), sg.default_config(B, D3, inter))
        a = torch.empty(B, inter, dtype=torch.bfloat16, device="meta")
        gu, down = set(sg.variants({"x": t["x"], "w": t["w_gate_up"]}, {})), set(sg.variants({"x": a, "w": t["w_down"]}, {}))
        assert pick[0] in gu and pick[1] in down, (B, pick)
        assert {v.gate_up for v in listed} >= gu
        assert {v.down for v in listed} >= down
        assert len({v.name for v in listed}) == len(listed)


def test_new_batch_size_does_not_recompile(ir_of):
    """The compile key is (dtype, I): no batch. h and a are (?, ...) in the host IR."""
    ir = ir_of("from fused import shared_experts as m; m._compile('bfloat16', 768)")
    assert '"(?,1536):(1536,1)"' in ir and '"(?,768):(768,1)"' in ir


def test_ptx_loads_and_stores_16_bytes(ptx_of, ptxas_regs):
    """A thread's gate and up chunks arrive by two 16-byte loads and its 8 results leave by one 16-byte
    store; the sigmoid's exp is the accurate expf (range reduction before ex2.approx); nothing spills."""
    ptx = ptx_of("from fused import shared_experts as m; m._compile('bfloat16', 6144)")
    assert ptx.count("ld.global.v4") == 2 and ptx.count("st.global.v4") == 1
    assert "fma.rm.f32" in ptx
    regs, spills = ptxas_regs(ptx)
    assert spills == 0, (regs, spills)


def test_compile_cache_hits_for_a_second_call():
    from fused import shared_experts as fm
    fm._compile("bfloat16", 64)
    before = runtime.cache_info()
    fm._compile("bfloat16", 64)
    after = runtime.cache_info()
    assert after.hits == before.hits + 1 and after.entries == before.entries


def test_custom_ops_register_under_project_namespace():
    from fused import shared_experts as fm
    fm._custom_ops()
    assert hasattr(torch.ops.verify_kernels, "shared_experts_fork")
    assert hasattr(torch.ops.verify_kernels, "shared_experts_join")


def _bad_cases():
    t = lambda **kw: _meta(**{**dict(B=3, D=64, inter=32), **kw}, device="cpu")
    base = t()
    yield "fp32", t(dtype=torch.float32), TypeError, "x: dtype torch.float32"
    yield "dtype", dict(base, w_down=base["w_down"].half()), TypeError, "w_down: dtype torch.float16"
    yield "odd", dict(base, w_gate_up=torch.empty(63, 64, dtype=torch.bfloat16)), ValueError, "must be even"
    yield "w_gate_up", dict(base, w_gate_up=torch.empty(64, 60, dtype=torch.bfloat16)), ValueError, "w_gate_up: expected shape"
    yield "w_down", dict(base, w_down=torch.empty(64, 30, dtype=torch.bfloat16)), ValueError, "w_down: expected shape"
    yield "D", t(D=60), ValueError, "hidden=60 must be a multiple of 8"
    yield "cpu", base, ValueError, "x: the fused kernel needs a CUDA tensor"


@pytest.mark.parametrize("form", ["fused.shared_experts:shared_experts", "fused.shared_experts_actdown:shared_experts"],
                         ids=["three_launch", "two_launch"])
@pytest.mark.parametrize("name,args,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_are_refused_in_one_line(form, name, args, exc, msg):
    from verify.ops.registry import import_callable
    with pytest.raises(exc) as info:
        import_callable(form)(**args)
    assert msg in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("beta", [0.0, -4.0, "4"])
def test_bad_betas_are_refused_in_one_line(beta):
    from fused.shared_experts import shared_experts
    with pytest.raises(ValueError, match=r"^situ_linear_beta: .* must be a positive float$"):
        shared_experts(**_meta(3, 64, 32, device="cpu"), situ_linear_beta=beta)


def test_wrong_out_is_refused_in_one_line():
    from fused.shared_experts import shared_experts
    with pytest.raises(ValueError, match=r"^out: expected shape \(3, 64\), got \(3, 63\)$"):
        shared_experts(**_meta(3, 64, 32, device="cpu"), out=torch.empty(3, 63, dtype=torch.bfloat16))


@pytest.mark.parametrize("inter", [32, 12])
def test_launch_chains_the_three_launches_in_the_reference_order(monkeypatch, inter):
    """launch() on the CPU with the GEMM and the SiTU kernel replaced by stand-ins that compute their
    launch from exactly the buffers they are handed: h [B, 2I] and a [B, I] in wd (I = 12 padded to
    16 with zeros), the betas as floats; the result is the reference's bits, also for drawn betas and
    an x row holding an infinity (the padding adds no NaN)."""
    from fused import shared_experts as fm
    from references.moe import shared_experts as ref
    from references.primitives import linear, situ_and_mul
    B, D = 3, 64
    width = -(-inter // 8) * 8
    gen = torch.Generator().manual_seed(0)
    t = {k: torch.randn(v.shape, generator=gen).to(torch.bfloat16) for k, v in _meta(B, D, inter).items()}
    t["x"][1, 5] = float("inf")
    calls = []

    def gemm(x, w, out, variant=None):
        calls.append(("gemm", tuple(x.shape), tuple(w.shape)))
        out.copy_(linear(x, w))

    def kernel(h, a, beta, lbeta):
        assert h.dtype == a.dtype == torch.bfloat16 and h.shape == (B, 2 * width) and a.shape == (B, width)
        assert isinstance(beta, float) and isinstance(lbeta, float)
        calls.append(("situ", beta, lbeta))
        a.copy_(situ_and_mul(h, beta, lbeta))

    monkeypatch.setattr(fm.sg, "launch", gemm)
    monkeypatch.setattr(fm, "_compile", lambda *static: kernel)
    for beta, lbeta in ((4.0, 25.0), (2.0, 50.0)):
        calls.clear()
        out = torch.full((B, D), float("nan"), dtype=torch.bfloat16)
        fm.launch(**t, situ_beta=beta, situ_linear_beta=lbeta, out=out)
        assert calls == [("gemm", (B, D), (2 * inter, D)), ("situ", beta, lbeta), ("gemm", (B, width), (D, width))]
        want = ref(**t, situ_beta=beta, situ_linear_beta=lbeta)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        assert not torch.isnan(out[1]).all()


# ---------------------------------------------------------------------------------------- GPU only

def _inputs(B, inter, D=D3, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(dtype)
    return dict(x=r(B, D), w_gate_up=r(2 * inter, D, scale=D ** -0.5), w_down=r(D, inter, scale=inter ** -0.5))


def _bits(t):
    return t.view(torch.int16)


# Cases of the op's draw through the whole pipeline (oracle, guards, every variant of variants()). The
# split hands rank r the columns [r I/T, (r+1) I/T) of both halves: tiny 64 / 16 = 4 and small
# 192 / 16 = 12 per rank run zero-padded to 8 and 16.
HARNESS_CASES = [("tiny", 5, "bfloat16", "normal", 1), ("tiny", 37, "float16", "heavy_tailed", 8),
                 ("small", 13, "bfloat16", "zero_rows", 1), ("small", 64, "float16", "normal", 2),
                 ("small", 3, "bfloat16", "outliers", 8), ("tiny", 9, "bfloat16", "nonfinite", 1),
                 ("small", 24, "float16", "wide_range", 4), ("small", 7, "bfloat16", "small_rows", 1),
                 ("k3", 1, "bfloat16", "normal", 1), ("k3", 8, "float16", "normal", 8),
                 ("k3", 64, "bfloat16", "normal", 16), ("k3", 17, "bfloat16", "heavy_tailed", 8),
                 ("small", 5, "bfloat16", "range_edges", 1), ("small", 6, "bfloat16", "normal", 16),
                 ("tiny", 11, "float16", "nonfinite", 16)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,batch,dtype,dist,tp", HARNESS_CASES,
                         ids=[f"{c[0]}-B{c[1]}-{c[2]}-{c[3]}-T{c[4]}" for c in HARNESS_CASES])
def test_every_variant_through_the_harness(config, batch, dtype, dist, tp):
    from property_tests.harness_case import judge_case
    from verify.model.case import Case
    case = Case("shared_experts", 11, batch, config, dtype, dist, tp)
    v = judge_case(case)
    assert v.status == "pass", f"{v.stage}: {v.reason}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_cuda_graph_replay_gives_the_eager_bits(B):
    """The custom-op form captured once (the fork onto the side stream and the join back are graph
    edges), replayed after the inputs change in place: the replay equals an eager call, bitwise."""
    from fused.shared_experts import shared_experts
    t = _inputs(B, K3_INTER[8])
    shared_experts(**t)
    torch.cuda.synchronize()
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = shared_experts(**t)
        copy = out * 1                  # read on the capture stream after the join
    fresh = _inputs(B, K3_INTER[8], seed=1)
    for k in t:
        t[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    want = shared_experts(**t)
    assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(copy), _bits(want))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 16])
def test_batch_invariant_within_each_variant(T):
    """Each variant listed at B = 64: every row alone (B = 1) and the batch reversed give that row's
    bits of the B = 64 run; two runs agree bitwise (deterministic)."""
    from fused.shared_experts import shared_experts, variants
    t = _inputs(64, K3_INTER[T], seed=2)
    rev = dict(t, x=t["x"].flip(0).contiguous())
    for v in variants(t, {}):
        full = shared_experts(**t, variant=v)
        assert torch.equal(_bits(full), _bits(shared_experts(**t, variant=v))), v.name
        assert torch.equal(_bits(full), _bits(shared_experts(**rev, variant=v).flip(0))), v.name
        for b in (0, 17, 63):
            one = shared_experts(t["x"][b:b + 1], t["w_gate_up"], t["w_down"], variant=v)
            assert torch.equal(_bits(one), _bits(full[b:b + 1])), (v.name, b)


def _routed(B, T, seed=0):
    """The fused routed experts' inputs at K3 per-rank dims (896 experts, top-16, I = 3072 / T padded
    to 256), routing drawn like test_moe_experts_mxfp4_gpu's."""
    from property_tests.test_moe_experts_mxfp4_gpu import K3_E, K3_I, K3_K, K3_L, expert_weights, routing
    inter = max(-(-K3_I // T), 256)
    w13_p, w13_s, w2_p, w2_s = expert_weights(K3_E, K3_L, inter, seed=seed)
    ids, w = routing("random", B, K3_E, K3_K, seed=seed + B)
    z = torch.randn(B, K3_L, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(torch.bfloat16)
    return dict(z=z, ids=ids, weights=w, w13_packed=w13_p, w13_scale=w13_s, w2_packed=w2_p, w2_scale=w2_s,
                situ_beta=4.0, situ_linear_beta=25.0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [8, 16])   # T = 1: the fused routed experts refuse K3's 896 unsplit experts
@pytest.mark.parametrize("B", [1, 64])   # (over 2^31 words); a serving engine splits them (EP or T >= 2)
def test_side_stream_overlapping_the_routed_experts_gives_each_ones_bits(T, B):
    """The shared experts started on their side stream, the fused routed experts on the main stream
    while they run, then the join: both outputs bitwise equal to each run alone, for the module's side
    stream (custom ops) and a caller's stream, eager and replayed from a CUDA graph that captured the
    fork and the join."""
    from fused.moe_experts_mxfp4 import moe_experts_mxfp4
    from fused.shared_experts import shared_experts, start
    s = _inputs(B, K3_INTER[T], seed=3)
    r = _routed(B, T, seed=4)
    want_s, want_r = shared_experts(**s), moe_experts_mxfp4(**r)
    torch.cuda.synchronize()
    for stream in (None, torch.cuda.Stream()):
        for _ in range(3):
            out_s = torch.full_like(want_s, float("nan"))
            out_r = torch.full_like(want_r, float("nan"))
            pending = start(**s, out=out_s, stream=stream)
            moe_experts_mxfp4(**r, out=out_r)
            pending.wait()
            both = out_s + 0                            # read on the main stream after the join
            torch.cuda.synchronize()
            assert torch.equal(_bits(out_r), _bits(want_r)) and torch.equal(_bits(both), _bits(want_s))
    graph, cap = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    out_s, out_r = torch.full_like(want_s, float("nan")), torch.full_like(want_r, float("nan"))
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap), torch.cuda.graph(graph, stream=cap):
        pending = start(**s, out=out_s)
        moe_experts_mxfp4(**r, out=out_r)
        pending.wait()
        both = out_s + 0
    for _ in range(3):
        out_s.fill_(float("nan"))
        out_r.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(out_r), _bits(want_r)) and torch.equal(_bits(both), _bits(want_s))


SLEEP_CYCLES = 200_000_000          # torch.cuda._sleep: ~0.1 s at the H200's ~2 GHz, far longer than a launch


@pytest.mark.gpu
@needs_gpu
def test_a_twin_without_the_join_reads_a_stale_output(monkeypatch):
    """A deliberately long kernel queued on the side stream first: with the join, the main stream's read
    of out waits for it and sees the result; the twin whose wait() skips the event wait reads out before
    the side stream wrote it (the NaN it was filled with)."""
    from fused import shared_experts as fm
    s = _inputs(8, K3_INTER[8], seed=5)
    want = fm.shared_experts(**s)
    side = torch.cuda.Stream()

    def run():
        out = torch.full_like(want, float("nan"))
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
        pending = fm.start(**s, out=out, stream=side)
        pending.wait()
        seen = out + 0
        torch.cuda.synchronize()
        return seen

    assert torch.equal(_bits(run()), _bits(want))
    monkeypatch.setattr(fm, "_join", lambda done: None)
    assert torch.isnan(run()).all(), "the twin without the join was not caught"


@pytest.mark.gpu
@needs_gpu
def test_a_twin_without_the_fork_reads_a_stale_input(monkeypatch):
    """A deliberately long kernel on the main stream, then x rewritten there: with the fork, the side
    stream waits and computes from the new x; the twin that skips the fork's wait computes from the old
    x (the side stream is idle while the main stream sleeps)."""
    from fused import shared_experts as fm
    s = _inputs(8, K3_INTER[8], seed=6)
    new_x = _inputs(8, K3_INTER[8], seed=7)["x"]
    want_new, want_old = fm.shared_experts(**dict(s, x=new_x)), fm.shared_experts(**s)
    assert not torch.equal(_bits(want_new), _bits(want_old))
    side = torch.cuda.Stream()

    def run():
        x = s["x"].clone()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(new_x)
        got = fm.start(x, s["w_gate_up"], s["w_down"], stream=side).wait() + 0
        torch.cuda.synchronize()
        return got

    assert torch.equal(_bits(run()), _bits(want_new))
    monkeypatch.setattr(fm, "_fork", lambda side: None)
    assert torch.equal(_bits(run()), _bits(want_old)), "the twin without the fork was not caught"


@pytest.mark.gpu
@needs_gpu
def test_timing_table():
    """K3 per rank (I = 6144 / T), B = 1, 8, 64: the shared experts fused (CUDA graph) against the
    reference eager and torch.compile of the reference (CUDA graph), and the bytes floor at 4.8 TB/s.
    Prints (run with -s) and writes $OUT/shared_experts_timing.md; asserts nothing about speed (a
    record, not a gate)."""
    from fused.shared_experts import start
    from property_tests.test_mla_decode_attn_gpu import _time_eager, _time_graph
    from references.moe import shared_experts as ref
    compiled = torch.compile(ref, dynamic=False)
    rows = ["| T | I | B | fused us | ref eager us | compiled us | HBM floor us |", "|---|---|---|---|---|---|---|"]
    for T in TP:
        inter = K3_INTER[T]
        for B in (1, 8, 64):
            s = _inputs(B, inter)
            out = torch.empty(B, D3, dtype=torch.bfloat16, device="cuda")
            fused_us = _time_graph(lambda: start(**s, out=out).wait())
            eager_us = _time_eager(lambda: ref(**s))
            try:
                comp = f"{_time_graph(lambda: compiled(**s)):.1f}"
            except Exception as e:          # a record, not a gate: the table keeps the other columns
                comp = f"failed: {type(e).__name__}"
            nbytes = sum(v.numel() * v.element_size() for v in s.values()) + out.numel() * 2
            rows.append(f"| {T} | {inter} | {B} | {fused_us:.1f} | {eager_us:.1f} | {comp} | {nbytes / 4.8e6:.1f} |")
    _record("shared_experts_timing.md", "shared_experts on " + torch.cuda.get_device_name(), rows)


@pytest.mark.gpu
@needs_gpu
def test_side_stream_step_time():
    """K3 per rank, T = 8 and 16 (the fused routed experts refuse K3's unsplit 896 experts at T = 1),
    B = 1, 8, 64: the fused routed experts (top-16 of 896) and the fused shared experts, one after the
    other on the main stream, against the shared experts started on their side stream while the routed
    experts run, then joined (each a CUDA graph). Both forms are first checked to give the same bits.
    Prints and writes $OUT/shared_experts_side_stream.md; asserts nothing about speed."""
    from fused.moe_experts_mxfp4 import moe_experts_mxfp4
    from fused.shared_experts import launch, start
    from property_tests.test_mla_decode_attn_gpu import _time_graph
    rows = ["| T | B | routed us | shared us | serial us | side stream us | saved us | side / serial |",
            "|---|---|---|---|---|---|---|---|"]
    for T in (8, 16):
        for B in (1, 8, 64):
            s = _inputs(B, K3_INTER[T])
            r = _routed(B, T)
            out = torch.empty(B, D3, dtype=torch.bfloat16, device="cuda")
            out_r = torch.empty(B, r["z"].shape[1], dtype=torch.bfloat16, device="cuda")

            def shared():
                launch(**s, situ_beta=4.0, situ_linear_beta=25.0, out=out)

            def serial():
                shared()
                moe_experts_mxfp4(**r, out=out_r)

            def overlapped():
                p = start(**s, out=out)
                moe_experts_mxfp4(**r, out=out_r)
                p.wait()

            serial()
            want = (out.clone(), out_r.clone())
            out.fill_(float("nan"))
            out_r.fill_(float("nan"))
            overlapped()
            torch.cuda.synchronize()
            assert torch.equal(_bits(out), _bits(want[0])) and torch.equal(_bits(out_r), _bits(want[1]))
            routed_us = _time_graph(lambda: moe_experts_mxfp4(**r, out=out_r))
            shared_us, ser, ovl = _time_graph(shared), _time_graph(serial), _time_graph(overlapped)
            rows.append(f"| {T} | {B} | {routed_us:.1f} | {shared_us:.1f} | {ser:.1f} | {ovl:.1f} | "
                        f"{ser - ovl:.1f} | {ovl / ser:.2f} |")
            del r
    _record("shared_experts_side_stream.md", "routed + shared experts on " + torch.cuda.get_device_name(), rows)


def _record(name: str, title: str, rows: list[str]) -> None:
    text = f"\n{title}\n" + "\n".join(rows)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(text + "\n")
