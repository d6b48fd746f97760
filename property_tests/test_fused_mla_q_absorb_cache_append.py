"""fused/mla_q_absorb_cache_append.py (mla_q_absorb's q_b GEMV and mla_cache_append in one grid at one
token, then the absorption): the shared kernel compiles for sm_90a on a CPU-only machine at the K3
per-rank shapes and the CPU configs with both index dtypes; its PTX loads the length once, stores after
a barrier and spills nothing; the append's slot arithmetic is mla_cache_append's; the one-launch rule
and the calls it hands to the two ops' own launches; bad arguments are refused in one line. On a CUDA
device (`@pytest.mark.gpu`): the bits of the two ops' three launches (q_abs, the cache, the lengths,
a position with no page), CUDA-graph replays step after step, and a timing line.

Run on the GPU: `python -m pytest -q -m gpu -s property_tests/test_fused_mla_q_absorb_cache_append.py`."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3, SMALL, TINY  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "mla_q_absorb_cache_append"
SHAPES = [(K3, 1), (K3, 8), (K3, 16), (SMALL, 1), (TINY, 1)]
SHAPE_IDS = ["k3-T1", "k3-T8", "k3-T16", "small", "tiny"]


def _dims(cfg, T: int):
    """(H, Dh, rope, q_lora, kv_lora, page): one rank's heads and the MLA widths."""
    return cfg.n_heads // T, cfg.head_dim, cfg.qk_rope_dim, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.page_size


def _static(cfg, T: int, dtype: str = "bfloat16", index: str = "int32"):
    from fused import mla_q_absorb_cache_append as m
    H, Dh, rope, q_lora, kv_lora, page = _dims(cfg, T)
    gemm = m.one_launch_config(1, H, Dh, rope, q_lora, kv_lora)
    return dtype, H * (Dh + rope), q_lora, gemm, kv_lora, rope, page, index, index


@pytest.mark.parametrize("index", ["int32", "int64"])
@pytest.mark.parametrize("cfg,T", SHAPES, ids=SHAPE_IDS)
def test_the_shared_grid_compiles_at_every_shape(cfg, T, index):
    for dtype in ("bfloat16", "float16"):
        assert runtime.compile_for_cpu_check(OP, *_static(cfg, T, dtype, index)) is not None


@pytest.mark.parametrize("cfg,T", SHAPES, ids=SHAPE_IDS)
def test_the_grid_is_the_q_b_gemv_s_and_one_append_cta(cfg, T):
    """Blocks 0..n-1 are skinny_gemm's one-token pick for the q_b GEMM (128 threads, its column blocks
    covering N), block n the append, whose chunks fit its threads."""
    from fused import mla_q_absorb_cache_append as m
    from fused import skinny_gemm as sg
    H, Dh, rope, q_lora, kv_lora, page = _dims(cfg, T)
    N = H * (Dh + rope)
    op = m.QbAppend(*_static(cfg, T)[:7])
    assert op.gemm.cfg == sg.default_config(1, N, q_lora) and op.n * op.gemm.nt == N
    assert op.gemm.threads == 128 and op.ckv + op.crot <= 128
    assert (op.ckv + op.crot) * op.vec == kv_lora + rope


def test_the_rule_takes_one_token_only():
    from fused import mla_q_absorb_cache_append as m
    for T in (1, 8, 16):
        H, Dh, rope, q_lora, kv_lora, _ = _dims(K3, T)
        assert m.one_launch_config(1, H, Dh, rope, q_lora, kv_lora) is not None, T
        assert m.one_launch_config(2, H, Dh, rope, q_lora, kv_lora) is None
        assert m.one_launch_config(0, H, Dh, rope, q_lora, kv_lora) is None
    H, Dh, rope, q_lora, kv_lora, _ = _dims(K3, 8)
    assert m.one_launch_config(1, H, Dh, rope, q_lora, 8 * 128 + 8) is None        # 129 chunks: no fit


def test_ptx_reads_the_length_once_and_stores_after_a_barrier_without_spills(ptx_of, ptxas_regs):
    """K3 T = 8 bf16, int32 table, int64 lengths: the length is one 64-bit load and the advanced length
    one 64-bit store, after the append CTA's barrier; the cache row goes as 16-byte chunks."""
    ptx = ptx_of("from fused import mla_q_absorb_cache_append as m, skinny_gemm as sg; "
                 "m._compile('bfloat16', 2304, 1536, sg.SkinnyGemmConfig(1, 4), 512, 64, 64, 'int32', 'int64')")
    body = ptx[ptx.index(".entry"):]
    assert body.count("ld.global.b64") == 1 and body.count("st.global.b64") == 1, body
    assert body.index("bar.sync") < body.index("st.global.b64")
    assert body.count("st.global.v4") == 2
    regs, spills = ptxas_regs(ptx)
    assert spills == 0 and regs <= 255, (regs, spills)


def test_the_append_is_mla_cache_append_s_arithmetic():
    """The slot, the barrier, the chunk copies and the length store are mla_cache_append's kernel lines,
    term for term, with its sequence b as 0 (a change to one that the other lacks would break the equal
    bits the GPU test checks)."""
    import inspect

    from fused import mla_cache_append as ca
    from fused import mla_q_absorb_cache_append as m
    keys = ("col =", "pg =", "slot =", "if pos >=", "if col <", "if pg >=", "if pg <", "cute.arch.sync_threads",
            "if slot >=", "if tidx <", "elif tidx <", "gC[None", "if tidx == 0", "mL[")
    norm = lambda ln: ln.split("#")[0].strip().replace("(b, ", "(0, ").replace("[b, ", "[0, ").replace("[b]", "[0]")
    lines = lambda src: [norm(ln) for ln in src.splitlines() if norm(ln).startswith(keys)]
    ours = lines(inspect.getsource(m.QbAppend.jit_host))
    theirs = lines(inspect.getsource(ca.MlaCacheAppend.device_kernel))
    assert ours == theirs, (ours, theirs)
    assert len(ours) == 16


def test_elsewhere_the_calls_are_the_two_ops_own(monkeypatch):
    """B > 1: mla_q_absorb (out handed on) and mla_cache_append (validate handed on), in that order."""
    from fused import mla_cache_append as ca
    from fused import mla_q_absorb as mq
    from fused import mla_q_absorb_cache_append as m
    seen = []
    monkeypatch.setattr(mq, "_check", lambda *a: None)
    monkeypatch.setattr(ca, "_check", lambda *a: None)
    monkeypatch.setattr(mq, "mla_q_absorb", lambda *a, **kw: seen.append(("absorb", a, kw)) or "q_abs")
    monkeypatch.setattr(ca, "mla_cache_append", lambda *a: seen.append(("append", a)))
    H, Dh, rope, q_lora, kv_lora, page = _dims(SMALL, 1)
    q_c, w_q_b, w_uk = torch.empty(2, q_lora), torch.empty(H * (Dh + rope), q_lora), torch.empty(H, Dh, kv_lora)
    kv_c, k_rot, cache = torch.empty(2, kv_lora), torch.empty(2, rope), torch.empty(4, page, kv_lora + rope)
    table, lens, out = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), object()
    assert m.mla_q_absorb_cache_append(q_c, w_q_b, w_uk, kv_c, k_rot, cache, table, lens, False, out=out) == "q_abs"
    (_, aa, akw), (_, pa) = seen
    assert aa == (q_c, w_q_b, w_uk) and akw == {"out": out}
    assert pa == (kv_c, k_rot, cache, table, lens, False)


def test_custom_op_registers_under_project_namespace():
    from fused import mla_q_absorb_cache_append as m
    m._custom_op()
    assert hasattr(torch.ops.verify_kernels, OP)


def _bad_cases():
    H, Dh, rope, q_lora, kv_lora, page = _dims(TINY, 1)
    bf = torch.bfloat16
    good = dict(q_c=torch.empty(1, q_lora, dtype=bf), w_q_b=torch.empty(H * (Dh + rope), q_lora, dtype=bf),
                w_uk=torch.empty(H, Dh, kv_lora, dtype=bf), kv_c=torch.empty(1, kv_lora, dtype=bf),
                k_rot=torch.empty(1, rope, dtype=bf), cache=torch.empty(4, page, kv_lora + rope, dtype=bf),
                block_table=torch.zeros(1, 2, dtype=torch.int32), seq_lens=torch.zeros(1, dtype=torch.int32))
    yield "cpu", good, ValueError, "q_c: the fused kernel needs a CUDA tensor"
    yield "q_c dtype", dict(good, q_c=good["q_c"].float()), TypeError, "q_c: dtype torch.float32"
    yield "q_lora", dict(good, w_q_b=good["w_q_b"][:, :16]), ValueError, "w_q_b: q_lora=16 does not match"
    yield "kv_c dtype", dict(good, kv_c=good["kv_c"].half()), TypeError, "k_rot"
    yield "cache width", dict(good, cache=torch.empty(4, page, 8, dtype=bf)), ValueError, "cache"
    yield "table dtype", dict(good, block_table=good["block_table"].float()), TypeError, "block_table"


@pytest.mark.parametrize("name,kw,exc,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_are_refused_in_one_line(monkeypatch, name, kw, exc, msg):
    """Each op's checks name the argument (the CPU tensors stand for CUDA ones past the "cpu" case: each
    op's device check comes last in its checks)."""
    from fused.mla_q_absorb_cache_append import mla_q_absorb_cache_append
    if name != "cpu":
        monkeypatch.setattr(runtime, "require_cuda", lambda *a: None)
    with pytest.raises(exc) as info:
        mla_q_absorb_cache_append(**kw)
    assert msg in str(info.value) and "\n" not in str(info.value)


def test_rows_of_another_count_than_q_c_s_are_refused(monkeypatch):
    from fused import mla_cache_append as ca
    from fused import mla_q_absorb as mq
    from fused.mla_q_absorb_cache_append import mla_q_absorb_cache_append
    monkeypatch.setattr(mq, "_check", lambda *a: None)
    monkeypatch.setattr(ca, "_check", lambda *a: None)
    H, Dh, rope, q_lora, kv_lora, page = _dims(TINY, 1)
    args = (torch.empty(1, q_lora), torch.empty(H * (Dh + rope), q_lora), torch.empty(H, Dh, kv_lora),
            torch.empty(2, kv_lora), torch.empty(2, rope), torch.empty(4, page, kv_lora + rope),
            torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_c: 2 rows; q_c has 1"):
        mla_q_absorb_cache_append(*args)


# ---------------------------------------------------------------------------------------- GPU only

def _inputs(cfg, T: int, seed: int = 0, dtype=torch.bfloat16, index=torch.int32, pages: int = 3):
    """One token's q_c, the weights, kv_c and k_rot as column slices of one merged row (as mla_qkv_a
    leaves them), a paged cache of `pages` pages with a shuffled table, and a length inside page 1."""
    H, Dh, rope, q_lora, kv_lora, page = _dims(cfg, T)
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(dtype)
    merged = r(1, q_lora + kv_lora + rope)
    return dict(q_c=merged[:, :q_lora], w_q_b=r(H * (Dh + rope), q_lora, scale=q_lora ** -0.5),
                w_uk=r(H, Dh, kv_lora, scale=Dh ** -0.5), kv_c=merged[:, q_lora:q_lora + kv_lora],
                k_rot=merged[:, q_lora + kv_lora:], cache=r(pages + 1, page, kv_lora + rope),
                block_table=torch.randperm(pages, generator=g, device="cuda")[None].to(index),
                seq_lens=torch.tensor([page + 3], dtype=index, device="cuda"))


def _three_launches(t, validate=False):
    from fused.mla_cache_append import mla_cache_append
    from fused.mla_q_absorb import mla_q_absorb
    q_abs = mla_q_absorb(t["q_c"], t["w_q_b"], t["w_uk"])
    mla_cache_append(t["kv_c"], t["k_rot"], t["cache"], t["block_table"], t["seq_lens"], validate)
    return q_abs


def _two_launches(t, validate=False):
    from fused.mla_q_absorb_cache_append import mla_q_absorb_cache_append
    return mla_q_absorb_cache_append(**t, validate=validate)


def _clone(t):
    return {k: v.clone() for k, v in t.items()}


def _same(a, b, qa, qb) -> bool:
    return (torch.equal(qa.view(torch.int16), qb.view(torch.int16)) and torch.equal(a["seq_lens"], b["seq_lens"])
            and torch.equal(a["cache"].view(torch.int16), b["cache"].view(torch.int16)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("index", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg,T", SHAPES, ids=SHAPE_IDS)
def test_the_three_launches_bits(cfg, T, dtype, index):
    """q_abs, the cache and the lengths bit for bit those of mla_q_absorb's and mla_cache_append's
    launches, two steps in a row (the second at the next position), with validate on."""
    t = _inputs(cfg, T, dtype=dtype, index=index)
    ours, theirs = _clone(t), _clone(t)
    for _ in range(2):
        qa, qb = _two_launches(ours, validate=True), _three_launches(theirs, validate=True)
        assert _same(ours, theirs, qa, qb)
    assert int(ours["seq_lens"][0]) == int(t["seq_lens"][0]) + 2


@pytest.mark.gpu
@needs_gpu
def test_a_position_with_no_page_writes_nothing_and_keeps_its_length():
    """validate=False (the layer's call) at a length past the table's pages: nothing written, the
    length kept, q_abs still computed; as mla_cache_append."""
    H, Dh, rope, q_lora, kv_lora, page = _dims(SMALL, 1)
    t = _inputs(SMALL, 1, pages=2)
    t["seq_lens"].fill_(2 * page)
    ours, theirs = _clone(t), _clone(t)
    qa, qb = _two_launches(ours), _three_launches(theirs)
    assert _same(ours, theirs, qa, qb)
    assert int(ours["seq_lens"][0]) == 2 * page and torch.equal(ours["cache"], t["cache"])


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replays_step_after_step():
    """Captured once, replayed over a page boundary: after every replay q_abs, the cache and the length
    equal the three launches' run step by step."""
    t = _inputs(K3, 8)
    t["seq_lens"].fill_(K3.page_size - 2)
    theirs = _clone(t)
    _two_launches(t)                                      # warm-up = step 1
    _three_launches(theirs)
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        q_abs = _two_launches(t)
    torch.cuda.current_stream().wait_stream(s)
    for step in range(4):
        graph.replay()
        want = _three_launches(theirs)
        torch.cuda.synchronize()
        assert _same(t, theirs, q_abs, want), step


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [8, 16])
def test_k3_time_beside_the_three_launches(T):
    """us per call at K3 per-rank shapes (CUDA-graph replays, weights not rotated: printed, not asserted);
    the lengths are put back before each timing so the appends stay inside the table."""
    from property_tests.gpu_timing import graph_us
    t = _inputs(K3, T, pages=64)
    start = t["seq_lens"].clone()
    times = {}
    for name, fn in (("two", _two_launches), ("three", _three_launches)):
        t["seq_lens"].copy_(start)
        fn(t)
        times[name] = graph_us(lambda: fn(t))
    print(f"\nmla_q_absorb + mla_cache_append K3 T={T} B=1: two launches {times['two']:.1f} us, "
          f"three launches {times['three']:.1f} us")
    assert times["two"] > 0 and times["three"] > 0
