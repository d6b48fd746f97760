"""fused/mla_q_absorb.py: every static configuration (absorption configs, and the q_b GEMM variants its
dispatcher picks for B = 1..64) compiles for sm_90a on a CPU-only machine at the K3 per-rank shapes
(96 / T heads, T = 1, 8, 16) and at tiny / small; a new batch size reuses the compiled kernel; bad
arguments are rejected in one line. On a CUDA device (`gpu` marker; skipped here, never counted as
passed): every variant through the harness's whole pipeline, a CUDA-graph replay, batch invariance
within a variant, and a timing table.

Run on the H200: `python3 -m pytest -q -s -m gpu property_tests/test_fused_mla_q_absorb.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TPS = (1, 8, 16)


def _m():
    from fused import mla_q_absorb
    return mla_q_absorb


def _shape(cfg, T=1):
    """(H, Dh, rope, kv_lora, q_lora) of one rank."""
    return cfg.heads_per_rank(T), cfg.head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank


@pytest.mark.parametrize("T", TPS)
def test_every_absorb_config_compiles_at_k3_per_rank(T):
    m = _m()
    H, Dh, rope, kv, _ = _shape(K3, T)
    for cfg in m.all_configs():
        assert runtime.compile_for_cpu_check("mla_q_absorb", "bfloat16", H, Dh, rope, kv, cfg) is not None
    assert runtime.compile_for_cpu_check("mla_q_absorb", "float16", H, Dh, rope, kv, m.default_absorb(8, H))


@pytest.mark.parametrize("T", TPS)
def test_the_gemms_the_dispatcher_picks_compile_at_k3_per_rank(T):
    """launch 1 is skinny_gemm: each variant its dispatcher picks for B = 1..64 at this rank's q_b shape."""
    from fused import skinny_gemm as sg
    H, Dh, rope, _, q_lora = _shape(K3, T)
    N = H * (Dh + rope)
    for cfg in {sg.default_config(B, N, q_lora) for B in range(1, 65)}:
        assert runtime.compile_for_cpu_check("skinny_gemm", "bfloat16", "bfloat16", N, q_lora, cfg) is not None


@pytest.mark.parametrize("cfg_name", ["tiny", "small"])
def test_every_absorb_config_compiles_at_small_shapes(cfg_name):
    """Configs are clipped to the shape (fit): tiny has 4 column vectors and Dh = 16."""
    m = _m()
    cfg = {"tiny": TINY, "small": SMALL}[cfg_name]
    H, Dh, rope, kv, _ = _shape(cfg, 16)            # one head per rank: H is a grid dim only
    for a in m.all_configs():
        f = m.fit(a, Dh, kv)
        assert Dh % f.groups == 0 and (kv // 8) % f.n_vec == 0
        assert runtime.compile_for_cpu_check("mla_q_absorb", "bfloat16", H, Dh, rope, kv, a) is not None


@pytest.mark.parametrize("nv,g", [(16, 8), (8, 16)])
def test_the_eight_token_tiles_load_weights_in_16_bytes_and_do_not_spill(ptx_of, ptxas_regs, nv, g):
    """m_tile = 8 (the most accumulators): every w_uk load is a 16-byte vector, the weight loads precede
    the first barrier (they do not wait for q), and ptxas keeps everything in registers."""
    ptx = ptx_of("from fused import mla_q_absorb as m; "
                 f"m._compile('bfloat16', 96, 128, 64, 512, m.AbsorbConfig(8, {nv}, {g}))")
    v4 = lambda text: text.count("ld.global.v4") + text.count("ld.global.nc.v4")
    assert v4(ptx) == 128 // g + 8 * 16 // 128 + 1, v4(ptx)    # w_uk rows, q_nope vectors, the q_rot copy
    assert v4(ptx[:ptx.index("bar.sync")]) == 128 // g + 1      # w_uk rows and q_nope: all before the barrier
    regs, spills = ptxas_regs(ptx)
    assert spills == 0, (regs, spills)


def test_every_pick_is_a_listed_variant():
    """The default launch (absorb config by B and H, GEMM by skinny_gemm's dispatcher) is one of the
    variants the harness certifies at that B."""
    from fused import skinny_gemm as sg
    m = _m()
    for T in TPS:
        H, Dh, rope, kv, q_lora = _shape(K3, T)
        for B in range(1, 65):
            t = {"q_c": torch.empty(B, q_lora, device="meta"), "w_q_b": torch.empty(H * (Dh + rope), q_lora,
                                                                                      device="meta")}
            listed = m.variants(t, {})
            assert len(listed) == len(set(listed)) == len(m.all_configs())
            pick = m.MlaQAbsorbConfig(m.default_absorb(B, H), sg.default_config(B, H * (Dh + rope), q_lora))
            assert pick in listed, (T, B)


def test_new_batch_size_does_not_recompile(ir_of):
    """The compile key holds no B (one m_tile bucket maps B = 5..8 to one config), and the kernel was
    compiled with a dynamic batch: q and q_abs are (?, ...) in its host IR, only w_uk is static."""
    m = _m()
    assert len({m.default_absorb(B, 12) for B in (5, 6, 7, 8)}) == 1
    ir = ir_of("from fused import mla_q_absorb as m; m._compile('bfloat16', 12, 128, 64, 512, m.default_absorb(5, 12))")
    assert '"(?,2304):(2304,1)"' in ir and '"(?,6912):(6912,1)"' in ir and '"(1536,512):(512,1)"' in ir


def _args(B=3, H=2, Dh=16, rope=8, kv=32, q_lora=32, dtype=torch.bfloat16):
    return dict(q_c=torch.zeros(B, q_lora, dtype=dtype), w_q_b=torch.zeros(H * (Dh + rope), q_lora, dtype=dtype),
                w_uk=torch.zeros(H, Dh, kv, dtype=dtype))


@pytest.mark.parametrize("change,word", [
    (dict(q_c=torch.zeros(3, 32, 1, dtype=torch.bfloat16)), "q_c, w_q_b, w_uk: expected"),
    (dict(q_c=torch.zeros(3, 32)), "q_c: dtype torch.float32"),
    (dict(w_uk=torch.zeros(2, 16, 32, dtype=torch.float16)), "q_c: dtype torch.bfloat16 / w_q_b"),
    (dict(w_q_b=torch.zeros(48, 40, dtype=torch.bfloat16)), "w_q_b: q_lora=40"),
    (dict(w_q_b=torch.zeros(47, 32, dtype=torch.bfloat16)), "w_q_b: 47 rows"),
    (dict(w_q_b=torch.zeros(2 * 20, 32, dtype=torch.bfloat16)), "rope=4 must be a multiple of 8"),
    (dict(out=torch.zeros(3, 2, 30, dtype=torch.bfloat16)), "out: expected a contiguous"),
    (dict(), "q_c: the fused kernel needs a CUDA tensor"),
])
def test_bad_arguments_are_rejected_by_name_in_one_line(change, word):
    m = _m()
    args = {**_args(), **change}
    with pytest.raises((ValueError, TypeError)) as err:
        m.mla_q_absorb(**args)
    assert str(err.value).startswith(word) and "\n" not in str(err.value), str(err.value)


def _absorb_stand_in(static, seen):
    """The absorption kernel's arithmetic in torch, in its order: group g sums rows d of its block in
    increasing d, the groups' partials are added in group order, one rounding; q_rot copied."""
    from fused import mla_q_absorb as m
    _dtype, H, Dh, rope, kv, cfg = static
    G = m.fit(cfg, Dh, kv).groups

    def kernel(q, w, out):
        assert q.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
        seen.update(w=w.data_ptr(), out=out.data_ptr())
        qh = q.view(q.shape[0], H, Dh + rope).float()
        wh = w.view(H, Dh, kv).float()
        parts = []
        for g in range(G):
            s = torch.zeros(q.shape[0], H, kv)
            for d in range(g * Dh // G, (g + 1) * Dh // G):
                s = s + qh[:, :, d, None] * wh[None, :, d]
            parts.append(s)
        tot = parts[0]
        for p in parts[1:]:
            tot = tot + p
        o = out.view(q.shape[0], H, kv + rope)
        o[..., :kv] = tot.to(out.dtype)
        o[..., kv:] = q.view(q.shape[0], H, Dh + rope)[..., Dh:]
    return kernel


@pytest.mark.parametrize("cfg_name", ["tiny", "small"])
def test_launch_wiring_on_cpu_with_the_kernels_emulated(cfg_name, monkeypatch):
    """launch() with both compiled kernels replaced by stand-ins (skinny_gemm: the reference GEMM; the
    absorption: its sum order in torch): q_abs lands in out's [B, H, kv_lora + rope] layout within the
    spec's bound of the float64 oracle, and a misaligned out (one element past a 16-byte boundary)
    reaches the kernel as an aligned copy and comes back with the aligned run's bits."""
    from fused import mla_q_absorb as m
    from fused import skinny_gemm as sg
    from references.gemm import skinny_gemm as ref_gemm
    from references.mla import mla_q_absorb as ref
    from verify.model.case import Case
    from verify.ops.mla import make_q_absorb_inputs
    seen: dict[str, int] = {}
    monkeypatch.setattr(sg, "_compile", lambda *st: lambda x, w, y: y.copy_(ref_gemm(x, w)))
    monkeypatch.setattr(m, "_compile", lambda *st: _absorb_stand_in(st, seen))
    t = make_q_absorb_inputs(Case("mla_q_absorb", 3, 5, cfg_name, "bfloat16")).tensors
    H, Dh, kv = t["w_uk"].shape
    rope = t["w_q_b"].shape[0] // H - Dh
    oracle = ref(*(t[k].double() for k in ("q_c", "w_q_b", "w_uk")))
    base = ref(t["q_c"], t["w_q_b"], t["w_uk"]).double()
    for a in m.all_configs():
        out = torch.empty(5, H, kv + rope, dtype=torch.bfloat16)
        m.launch(t["q_c"], t["w_q_b"], t["w_uk"], out, m.MlaQAbsorbConfig(a))
        assert seen["out"] == out.data_ptr()
        err, err0 = (out.double() - oracle).abs().amax(-1), (base - oracle).abs().amax(-1)
        assert bool((err <= 3 * err0 + oracle.abs().amax(-1) * 2.0 ** -8).all()), a.name
        assert torch.equal(out[..., kv:], base[..., kv:].to(out.dtype))
        buf = torch.empty(out.numel() + 8, dtype=out.dtype)
        odd = buf[1:1 + out.numel()].view(out.shape)
        m.launch(t["q_c"], t["w_q_b"], t["w_uk"], odd, m.MlaQAbsorbConfig(a))
        assert seen["out"] != odd.data_ptr() and torch.equal(odd, out), a.name


# ---------------------------------------------------------------------------------------- GPU only

_CASE = '{{"batch":{},"config":"{}","dist":"{}","dtype":"{}","extra":[],"op":"mla_q_absorb","seed":{},"tp":{}}}'
HARNESS_CASES = [_CASE.format(1, "k3", "normal", "bfloat16", 3, 1),
                 _CASE.format(64, "k3", "normal", "float16", 4, 1),
                 _CASE.format(8, "k3", "heavy_tailed", "bfloat16", 5, 8),
                 _CASE.format(37, "k3", "normal", "bfloat16", 6, 16),
                 _CASE.format(13, "small", "wide_range", "float16", 7, 1),
                 _CASE.format(5, "tiny", "range_edges", "bfloat16", 8, 1),
                 _CASE.format(3, "small", "nonfinite", "bfloat16", 9, 1)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case_json", HARNESS_CASES)
def test_every_variant_passes_the_harness(case_json):
    """The harness's whole pipeline (evaluate_case: the default launch and every variant of
    `variants()`, oracle comparison by the spec's class, every guard; tp > 1 per rank on its heads)."""
    from property_tests.harness_case import judge_case
    from verify.model.case import Case
    v = judge_case(Case.from_json(case_json))
    assert v.status == "pass", f"{v.stage}: {v.reason}"


def _k3_inputs(B, T, dtype=torch.bfloat16, seed=0):
    H, Dh, rope, kv, q_lora = _shape(K3, T)
    g = torch.Generator(device="cuda").manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda")
    return (rn(B, q_lora).to(dtype), (rn(H * (Dh + rope), q_lora) * q_lora ** -0.5).to(dtype),
            (rn(H, Dh, kv) * Dh ** -0.5).to(dtype))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", TPS)
def test_cuda_graph_replay_gives_the_eager_bits(T):
    """Captured once, replayed after q_c changes in place: the eager call's bits on the new values."""
    m = _m()
    q_c, w_q_b, w_uk = _k3_inputs(9, T)
    out = m.mla_q_absorb(q_c, w_q_b, w_uk)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        m.mla_q_absorb(q_c, w_q_b, w_uk, out=out)
    q_c.copy_(torch.randn_like(q_c.float()).to(q_c.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), m.mla_q_absorb(q_c, w_q_b, w_uk).view(torch.int16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", TPS)
def test_batch_invariance_within_each_variant(T):
    """Within a variant a token's bits do not depend on B or its position: a row alone, the batch
    permuted and the batch itself give the same bits."""
    m = _m()
    B = 37
    q_c, w_q_b, w_uk = _k3_inputs(B, T, seed=T)
    perm = torch.randperm(B, device="cuda")
    for v in m.variants({"q_c": q_c, "w_q_b": w_q_b}, {}):
        full = m.mla_q_absorb(q_c, w_q_b, w_uk, variant=v)
        assert torch.equal(full, m.mla_q_absorb(q_c, w_q_b, w_uk, variant=v)), v.name
        assert torch.equal(full[perm], m.mla_q_absorb(q_c[perm].contiguous(), w_q_b, w_uk, variant=v)), v.name
        for row in (0, 5, B - 1):
            one = m.mla_q_absorb(q_c[row:row + 1].clone(), w_q_b, w_uk, variant=v)
            assert torch.equal(one[0].view(torch.int16), full[row].view(torch.int16)), (v.name, row)


@pytest.mark.gpu
@needs_gpu
def test_timing_table():
    """Prints (run with -s) us per call at the K3 per-rank shapes (T = 1, 8, 16; B = 1, 8, 64), each in
    a CUDA graph: the fused op (the dispatcher's pick; launch 1, the q_b GEMM, alone; the fastest of
    every listed variant, to tune the pick), the reference eager and torch.compile of the reference.
    Checks each graph's output is the eager bits; asserts nothing about speed (a record, not a gate)."""
    from fused import skinny_gemm as sg
    from property_tests.test_fused_kda_verify import _graph_us
    from references.mla import mla_q_absorb as ref
    m = _m()
    compiled = torch.compile(ref)
    rows = []
    for T in TPS:
        for B in (1, 8, 64):
            q_c, w_q_b, w_uk = _k3_inputs(B, T, seed=B)
            out = m.mla_q_absorb(q_c, w_q_b, w_uk)
            want = out.clone()
            q = torch.empty(B, w_q_b.shape[0], dtype=q_c.dtype, device="cuda")
            res = {}
            t_fused = _graph_us(lambda: m.mla_q_absorb(q_c, w_q_b, w_uk, out=out))
            assert torch.equal(out, want), (T, B)
            t_var = {}
            for v in m.variants({"q_c": q_c, "w_q_b": w_q_b}, {}):
                t_var[v.absorb.name] = _graph_us(lambda: m.mla_q_absorb(q_c, w_q_b, w_uk, out=out, variant=v))
            best = min(t_var, key=t_var.get)
            t_gemm = _graph_us(lambda: sg.launch(q_c, w_q_b, q))
            t_ref = _graph_us(lambda: res.__setitem__("r", ref(q_c, w_q_b, w_uk)))
            t_comp = _graph_us(lambda: res.__setitem__("c", compiled(q_c, w_q_b, w_uk)))
            H = w_uk.shape[0]
            mb = (q_c.numel() + w_q_b.numel() + w_uk.numel() + out.numel()) * 2 / 1e6
            rows.append((T, H, B, m.default_absorb(B, H).name, mb, t_fused, t_gemm, best, t_var[best], t_ref, t_comp))
            torch.cuda.empty_cache()
    print("\nmla_q_absorb, bf16, K3 per rank, CUDA graphs, us per call (gemm = launch 1 alone; best = the fastest "
          "listed variant)")
    print(f"{'T':>3} {'H':>3} {'B':>3} {'pick':>18} {'MB':>6} {'fused':>7} {'gemm':>7} {'best':>18} {'best us':>7} "
          f"{'ref':>7} {'compile':>7} {'ref/fused':>9}")
    for T, H, B, pick, mb, f, g_, best, tb, r, c in rows:
        print(f"{T:>3} {H:>3} {B:>3} {pick:>18} {mb:>6.2f} {f:>7.1f} {g_:>7.1f} {best:>18} {tb:>7.1f} {r:>7.1f} "
              f"{c:>7.1f} {r / f:>9.2f}")
    assert all(v > 0 for row in rows for v in row[5:7] + row[8:])
