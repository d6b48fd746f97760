"""fused/allreduce_latent_norm_up.py: every tile compiles for sm_90a on a CPU-only machine at the K3 shape
(T = 1, 8, 16 partials) and the tiny and small configs; the dispatcher's picks are certified variants;
the launch hands the kernel the strided halves of a gathered row in place; bad arguments are refused in
one line. On a CUDA device (`@pytest.mark.gpu`): the op through the harness's whole pipeline, the
reference's bits where the kernel rounds as it does, a CUDA graph replay against the eager bits, batch
invariance across the variants, and a timing line beside the four launches it replaces.
fused/allreduce_latent_norm_up_prefold.py (the latent half folded once, then the tail): on the CPU,
its launches and the views they get; on a device, through the harness and the one-launch bits.

Run on the H200: `python -m pytest -q -m gpu -s property_tests/test_fused_allreduce_latent_norm_up.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "allreduce_latent_norm_up"
D3, L3 = K3.hidden, K3.latent


def _meta(B, D, L, T, dtype=torch.bfloat16, device="meta"):
    kw = dict(dtype=dtype, device=device)
    return dict(prefix=torch.empty(B, D, **kw), y_parts=torch.empty(T, B, L, **kw),
                shared_parts=torch.empty(T, B, D, **kw), norm_w=torch.empty(L, **kw), w_up=torch.empty(D, L, **kw))


@pytest.mark.parametrize("T", [1, 8, 16])
def test_every_variant_compiles_at_k3(T):
    from fused import allreduce_latent_norm_up as fm
    listed = fm.variants(_meta(8, D3, L3, T), {})
    assert {c.tokens for c in listed} == {1, 4, 8} and {c.rows_per_warp for c in listed} == {4}
    for cfg in listed:
        assert runtime.compile_for_cpu_check(OP, "bfloat16", T, D3, L3, cfg) is not None


@pytest.mark.parametrize("cfg", [TINY, SMALL], ids=["tiny", "small"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_tile_compiles_at_cpu_configs(cfg, dtype):
    """Every tile (rows per warp 1, 2, 4 x tokens 1, 4, 8) at L = 64 and 128: lanes past the last chunk
    (L / 8 < 32) take the predicated path, threads past it stage nothing."""
    from fused import allreduce_latent_norm_up as fm
    tiles = fm.configs(cfg.hidden)
    assert tiles and all(t.tokens <= fm.MAX_TOKENS for t in tiles)
    for t in tiles:
        runtime.compile_for_cpu_check(OP, dtype, 4, cfg.hidden, cfg.latent, t)


@pytest.mark.parametrize("D", [D3, SMALL.hidden, TINY.hidden])
def test_dispatchers_picks_are_certified_variants(D):
    from fused import allreduce_latent_norm_up as fm
    L = {D3: L3, SMALL.hidden: SMALL.latent, TINY.hidden: TINY.latent}[D]
    for B in range(1, 65):
        listed = fm.variants(_meta(B, D, L, 2), {})
        assert fm.pick(B, D) in listed
        assert len({v.name for v in listed}) == len(listed)


def test_the_staged_rows_fit_beside_each_other():
    """tokens x L x 2 bytes of staged rows at K3: at most 56 KiB, so three CTAs share an SM's 228 KiB."""
    from fused import allreduce_latent_norm_up as fm
    assert fm.MAX_TOKENS * L3 * 2 <= 56 * 1024


def test_ptx_loads_16_bytes_without_spills(ptx_of, ptxas_regs):
    """The K3 tile at B > 4 and T = 8: the latent partials, norm_w and the weight rows arrive by 16-byte
    loads, the staged rows by 16-byte shared loads, and nothing spills."""
    ptx = ptx_of("from fused import allreduce_latent_norm_up as m; "
                 "m._compile('bfloat16', 8, 7168, 3584, m.NormUpConfig(4, 8))")
    assert "ld.global.v4" in ptx and "ld.shared.v4" in ptx and "st.shared.v4" in ptx
    regs, spills = ptxas_regs(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)


def test_custom_op_registers_under_project_namespace():
    from fused import allreduce_latent_norm_up as fm
    fm._custom_op()
    assert hasattr(torch.ops.verify_kernels, OP)


def _bad_cases():
    t = lambda **kw: _meta(**{**dict(B=3, D=64, L=32, T=2), **kw}, device="cpu")
    base = t()
    yield "fp32", t(dtype=torch.float32), TypeError, "prefix: dtype torch.float32"
    yield "dtype", dict(base, w_up=base["w_up"].half()), TypeError, "w_up: dtype torch.float16"
    yield "parts", t(T=17), ValueError, "y_parts: 17 partials (dim 0); the fused tail takes 1..16"
    yield "shared", dict(base, shared_parts=torch.empty(3, 3, 64, dtype=torch.bfloat16)), ValueError, \
        "shared_parts: expected shape"
    yield "batch", dict(base, y_parts=torch.empty(2, 4, 32, dtype=torch.bfloat16)), ValueError, "y_parts: expected shape"
    yield "norm_w", dict(base, norm_w=torch.empty(31, dtype=torch.bfloat16)), ValueError, "norm_w: expected shape"
    yield "L", t(L=36), ValueError, "latent=36 must be a multiple of 8"
    yield "D", t(D=62), ValueError, "hidden=62 must be a multiple of 4"
    yield "cpu", base, ValueError, "prefix: the fused kernel needs a CUDA tensor"


PREFOLD = "fused.allreduce_latent_norm_up_prefold:allreduce_latent_norm_up"


@pytest.mark.parametrize("form", ["fused.allreduce_latent_norm_up:allreduce_latent_norm_up", PREFOLD],
                         ids=["one_launch", "two_launch"])
@pytest.mark.parametrize("name,args,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_are_refused_in_one_line(form, name, args, exc, msg):
    from verify.ops.registry import import_callable
    with pytest.raises(exc) as info:
        import_callable(form)(**args, eps=1e-5)
    assert msg in str(info.value) and "\n" not in str(info.value)


def test_launch_reads_the_gathered_halves_in_place(monkeypatch):
    """launch() on the CPU with the kernel replaced by a stand-in that computes the op from exactly the
    views it is handed: the column halves of a gathered [T, B, L + D] row arrive as the same strided
    views (no copy), norm_w as [1, L], every base 16-byte aligned; the result is the reference's bits."""
    from fused import allreduce_latent_norm_up as fm
    from references.moe_tp import allreduce_latent_norm_up as ref
    B, D, L, T = 3, 64, 32, 4
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    gathered = r(T, B, L + D)
    t = dict(prefix=r(B, D), y_parts=gathered[..., :L], shared_parts=gathered[..., L:], norm_w=r(L), w_up=r(D, L))
    seen = {}

    def kernel(P, Y, S, N, W, out, eps):
        seen["views"] = (Y.data_ptr(), S.data_ptr(), Y.stride(), S.stride())
        assert all(a.data_ptr() % 16 == 0 for a in (P, Y, S, N, W, out)) and N.shape == (1, L)
        out.copy_(ref(P, Y, S, N[0], W, eps))

    monkeypatch.setattr(fm, "_compile", lambda *static: kernel)
    monkeypatch.setattr(fm.runtime, "sm_count", lambda device: 132)
    out = torch.empty(B, D, dtype=torch.bfloat16)
    fm.launch(**t, eps=1e-5, out=out)
    assert torch.equal(out.view(torch.int16), ref(**t, eps=1e-5).view(torch.int16))
    assert seen["views"] == (gathered.data_ptr(), gathered[..., L:].data_ptr(), (B * (L + D), L + D, 1),
                             (B * (L + D), L + D, 1))


@pytest.mark.parametrize("T,B,gathered", [(1, 3, True), (4, 3, True), (4, 3, False), (8, 1, True), (4, 2, False),
                                           (16, 1, True), (16, 2, True), (8, 3, True), (8, 3, False),
                                           (4, 5, False)])
def test_the_two_launch_form_folds_once_then_runs_the_tail_on_one_partial(monkeypatch, T, B, gathered):
    """fused.allreduce_latent_norm_up_prefold on the CPU, both kernels replaced by stand-ins that compute
    their op from the views they are handed: above ONE_LAUNCH_MAX partial rows (T x B) the halves of one
    gathered row are folded by one launch reading the row in place, separate halves by one launch each,
    and the tail gets one partial of each; up to it (T = 1 included) the tail gets the T partials
    unfolded; the result is the reference's bits."""
    from fused import allreduce_fold as fold
    from fused import allreduce_latent_norm_up as fm
    from fused import allreduce_latent_norm_up_prefold as pf
    from references.allreduce import allreduce_fold as ref_fold
    from references.moe_tp import allreduce_latent_norm_up as ref
    D, L = 64, 32
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    row = r(T, B, L + D)
    y, sh = (row[..., :L], row[..., L:]) if gathered else (r(T, B, L), r(T, B, D))
    t = dict(prefix=r(B, D), y_parts=y, shared_parts=sh, norm_w=r(L), w_up=r(D, L))
    seen = []
    monkeypatch.setattr(fm.runtime, "require_cuda", lambda name, x: None)
    monkeypatch.setattr(fold, "_custom_op", lambda: lambda parts, out: (
        seen.append(("fold", parts.data_ptr(), tuple(parts.shape))), out.copy_(ref_fold(parts))))

    def tail(prefix, y_parts, shared_parts, norm_w, w_up, eps, out):
        seen.append(("tail", tuple(y_parts.shape), tuple(shared_parts.shape)))
        out.copy_(ref(prefix, y_parts, shared_parts, norm_w, w_up, eps))
    monkeypatch.setattr(fm, "_custom_op", lambda: tail)
    got = pf.allreduce_latent_norm_up(**t, eps=1e-5)
    assert pf.ONE_LAUNCH_MAX == 16
    assert torch.equal(got.view(torch.int16), ref(**t, eps=1e-5).view(torch.int16))
    if T * B <= pf.ONE_LAUNCH_MAX:
        assert seen == [("tail", (T, B, L), (T, B, D))]
        return
    folds = ([("fold", row.data_ptr(), (T, B, L + D))] if gathered else
             [("fold", y.data_ptr(), (T, B, L)), ("fold", sh.data_ptr(), (T, B, D))])
    assert seen == folds + [("tail", (1, B, L), (1, B, D))]


# ---------------------------------------------------------------------------------------- GPU only

def _inputs(B, T, D=D3, L=L3, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(dtype)
    gathered = r(T, B, L + D, scale=T ** -0.5)
    return dict(prefix=r(B, D), y_parts=gathered[..., :L], shared_parts=gathered[..., L:],
                norm_w=(1 + 0.1 * torch.randn(L, generator=g, device="cuda")).to(dtype), w_up=r(D, L, scale=L ** -0.5))


HARNESS_CASES = [("tiny", 5, "bfloat16", "normal", 1), ("tiny", 37, "float16", "heavy_tailed", 2),
                 ("small", 13, "bfloat16", "zero_rows", 4), ("small", 64, "float16", "normal", 1),
                 ("small", 3, "bfloat16", "order_sensitive", 4), ("tiny", 9, "bfloat16", "nonfinite", 2),
                 ("small", 24, "float16", "wide_range", 8), ("small", 7, "bfloat16", "small_rows", 16),
                 ("k3", 1, "bfloat16", "normal", 8), ("k3", 8, "float16", "normal", 16),
                 ("k3", 64, "bfloat16", "normal", 8), ("small", 5, "bfloat16", "range_edges", 2)]
PREFOLD_CASES = HARNESS_CASES[:6] + HARNESS_CASES[8:11]      # the two-launch form: T = 1..16, K3 included


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,batch,dtype,dist,tp", HARNESS_CASES,
                         ids=[f"{c[0]}-B{c[1]}-{c[2]}-{c[3]}-T{c[4]}" for c in HARNESS_CASES])
def test_every_variant_through_the_harness(config, batch, dtype, dist, tp):
    from property_tests.harness_case import judge_case
    from verify.model.case import Case
    v = judge_case(Case(OP, 11, batch, config, dtype, dist, tp))
    assert v.status == "pass", f"{v.stage}: {v.reason}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B,T", [(1, 1), (1, 8), (8, 16), (64, 8)])
def test_the_kernel_is_the_reference_within_one_ulp_and_deterministic(B, T):
    """Against the reference on the device (its RMS mean and GEMV sums in torch's order): every element
    within 4 bf16 ulps of its terms' size (|prefix| + |out| + 1/16: prefix and the MoE output may cancel,
    each rounding is of its terms), and two runs the same bits. The harness judges the bound itself."""
    from fused.allreduce_latent_norm_up import allreduce_latent_norm_up
    from references.moe_tp import allreduce_latent_norm_up as ref
    t = _inputs(B, T)
    got, again, want = allreduce_latent_norm_up(**t, eps=1e-5), allreduce_latent_norm_up(**t, eps=1e-5), ref(**t, eps=1e-5)
    assert torch.equal(got, again)
    scale = t["prefix"].float().abs() + want.float().abs() + 2 ** -4
    err = (got.float() - want.float()).abs() / scale
    assert float(err.max()) <= 2 ** -6, float(err.max())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_cuda_graph_replay_gives_the_eager_bits(B):
    from fused.allreduce_latent_norm_up import allreduce_latent_norm_up
    t = _inputs(B, 8)
    out = _replayed_after_a_change(allreduce_latent_norm_up, t)
    assert torch.equal(out, allreduce_latent_norm_up(**t, eps=1e-5))


def _replayed_after_a_change(fn, t: dict) -> torch.Tensor:
    """fn(**t) captured in a CUDA graph (after one eager call), prefix and y_parts redrawn in place, the
    graph replayed: its output."""
    fn(**t, eps=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**t, eps=1e-5)
    t["prefix"].normal_()
    t["y_parts"].normal_()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@needs_gpu
def test_every_variant_gives_every_row_the_same_bits_at_any_batch():
    """Batch invariance across the variants: each row of B = 37 equals that row alone (B = 1), for every
    tile the harness certifies."""
    from fused import allreduce_latent_norm_up as fm
    t = _inputs(37, 4)
    base = fm.allreduce_latent_norm_up(**{k: (v[:, 5:6] if k.endswith("parts") else v[5:6] if k == "prefix" else v)
                                          for k, v in t.items()}, eps=1e-5)
    for cfg in fm.variants(t, {}):
        out = fm.allreduce_latent_norm_up(**t, eps=1e-5, variant=cfg)
        assert torch.equal(out[5:6], base), cfg.name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,batch,dtype,dist,tp", PREFOLD_CASES,
                         ids=[f"{c[0]}-B{c[1]}-{c[2]}-{c[3]}-T{c[4]}" for c in PREFOLD_CASES])
def test_the_two_launch_form_through_the_harness(config, batch, dtype, dist, tp):
    from property_tests.harness_case import judge_case
    from verify.model.case import Case
    v = judge_case(Case(OP, 11, batch, config, dtype, dist, tp), candidate=PREFOLD)
    assert v.status == "pass", f"{v.stage}: {v.reason}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B,T", [(2, 16), (8, 8), (64, 16)])
def test_the_two_launch_form_gives_the_one_launch_bits_and_replays_in_a_graph(B, T):
    """Both round the fold once to the working dtype and run the same tail: the same bits, eager and
    replayed from a CUDA graph after the inputs changed (shapes past ONE_LAUNCH_MAX: two launches)."""
    from fused.allreduce_latent_norm_up import allreduce_latent_norm_up as one
    from fused.allreduce_latent_norm_up_prefold import allreduce_latent_norm_up as two
    t = _inputs(B, T)
    assert torch.equal(two(**t, eps=1e-5), one(**t, eps=1e-5))
    out = _replayed_after_a_change(two, t)
    assert torch.equal(out, one(**t, eps=1e-5))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B,T", [(1, 8), (8, 8), (1, 16), (8, 16), (64, 8)])
def test_k3_time_beside_the_four_launches_it_replaces(B, T):
    """us per call (CUDA-graph replays, weights not rotated: printed, not asserted) of the one-launch tail,
    the two-launch form (the latent folded once first) and the four launches (two allreduce_fold,
    latent_norm_up, the residual add)."""
    from fused.allreduce_fold import allreduce_fold
    from fused.allreduce_latent_norm_up import allreduce_latent_norm_up
    from fused.allreduce_latent_norm_up_prefold import allreduce_latent_norm_up as prefolded
    from fused.latent_norm_up import latent_norm_up
    from property_tests.gpu_timing import graph_us
    t = _inputs(B, T)
    fused = lambda: allreduce_latent_norm_up(**t, eps=1e-5)
    four = lambda: t["prefix"] + latent_norm_up(allreduce_fold(t["y_parts"]), t["norm_w"], t["w_up"],
                                                allreduce_fold(t["shared_parts"]), 1e-5)
    two = lambda: prefolded(**t, eps=1e-5)
    fused(), two(), four()
    a, c, b = graph_us(fused), graph_us(two), graph_us(four)
    from fused.allreduce_latent_norm_up_prefold import ONE_LAUNCH_MAX
    form = "its one launch" if T * B <= ONE_LAUNCH_MAX else "two launches"
    print(f"\nallreduce_latent_norm_up K3 T={T} B={B}: fused {a:.1f} us, the prefold form ({form}) {c:.1f} us, "
          f"four launches {b:.1f} us")
    assert a > 0 and b > 0 and c > 0
