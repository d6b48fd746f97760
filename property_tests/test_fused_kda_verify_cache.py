"""fused/kda_verify_cache.py (the input-cache rollback design, fused) and its kernel
fused/kda_verify_cache_step.py. CPU: every static configuration of the kernel compiles for sm_90a (mode
x dtype x head dim x count dtype x chunks x variant; batch, heads, n_q and window are dynamic); the
verify PTX loads the base state once (16-byte rows, before the first barrier) and stores no state,
the write-back and commit PTX store it once after the last token; no local memory, no spills; the
design rejects bad arguments by name in one line. GPU (`gpu`-marked, skipped here, never counted as
passed): the design driven step by step beside references.kda_spec_cache.KdaInputCache; the
spec-decode contract (verify/spec_decode/contract.py: prefix bitwise against its own fork, accept-zero,
growth against the float64 oracle, poison) at small and k3 over 64 steps; a CUDA graph of a step
gives the eager bits; new batch sizes, n_q and windows do not recompile; and a timing table of a step
(verify + accept) against the fused checkpoint design at the K3 per-rank shapes (run with -s).
The CPU contract cannot run this design: every method launches a kernel, which needs CUDA.
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before any cutlass import

import pytest
import torch

from fused import runtime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

KDA_DH = (128, 64, 32, 16)
MODES = ("verify", "writeback", "commit")
TOKEN = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
LAYER = ("conv_w", "A_log", "dt_bias", "o_norm_w")


def _step():
    from fused import kda_verify_cache_step
    return kda_verify_cache_step


def _compile(mode, dtype="bfloat16", Dh=128, count="int32", n_chunks=2, cfg=None):
    k = _step()
    cfg = cfg or k.KdaVerifyConfig.for_shape(Dh)
    return runtime.compile_for_cpu_check("kda_verify_cache_step", mode, dtype, Dh, 4, count, n_chunks, cfg)


def _code(mode: str, cfg: str, Dh: int = 128, n_chunks: int = 2, dtype: str = "bfloat16") -> str:
    return (f"from fused import kda_verify_cache_step as m; "
            f"m._compile('{mode}', '{dtype}', {Dh}, 4, 'int32', {n_chunks}, m.KdaVerifyConfig{cfg})")


# ------------------------------------------------------------------------------------------ CPU

@pytest.mark.parametrize("mode", MODES)
def test_every_variant_and_chunk_count_compiles_at_k3(mode):
    """bf16, Dh = 128, W = 4, int32 counts: every variant at 2 chunks (window 6, n_q 6: 11 slots), the
    dispatcher's picks (w16r8, w8) at every chunk count 1..MAX_CHUNKS."""
    k = _step()
    for cfg in k.KdaVerifyConfig.all_configs():
        assert _compile(mode, cfg=cfg) is not None
    for n_chunks in range(1, k.MAX_CHUNKS + 1):
        for cfg in (k.KdaVerifyConfig(16, 8), k.KdaVerifyConfig(8)):
            assert _compile(mode, n_chunks=n_chunks, cfg=cfg) is not None


@pytest.mark.parametrize("Dh", KDA_DH)
@pytest.mark.parametrize("mode", MODES)
def test_every_head_dim_dtype_and_count_dtype_compiles(mode, Dh):
    """Every head dim: fp16 and bf16, int32 and int64 counts with the dispatcher's pick; at Dh < 128
    every variant (the row_chunk variants fall back to per-row reductions there)."""
    k = _step()
    for dtype in ("bfloat16", "float16"):
        for count in ("int32", "int64"):
            assert _compile(mode, dtype, Dh, count) is not None
    if Dh < 128:
        for cfg in k.KdaVerifyConfig.all_configs():
            assert _compile(mode, "bfloat16", Dh, cfg=cfg, n_chunks=1) is not None


def test_the_compile_key_holds_no_batch_heads_draft_slots_or_window():
    """n_q and window only set S = window - 1 + n_q, and S only the chunk count: the K3 default (window
    6, n_q 6) and (window 3, n_q 8) share one kernel per mode."""
    k = _step()
    chunks = lambda window, n_q: -(-(window - 1 + n_q) // k.CHUNK)
    assert chunks(6, 6) == chunks(3, 8) == chunks(9, 8) == 2 and chunks(1, 8) == chunks(2, 7) == 1


def _split(ptx: str):
    body = ptx[ptx.index(".entry"):]
    bars = [mt.start() for mt in re.finditer(r"\bbar(rier)?\.sync", body)]
    return body, bars


@pytest.mark.parametrize("cfg", ["(4)", "(8)", "(16)", "(8, 8)", "(16, 8)"])
def test_verify_loads_the_base_state_once_and_stores_no_state(ptx_of, ptxas_regs, cfg):
    """Verify, 2 chunks: two barriers per chunk; every 16-byte load (the state rows, once, and the conv
    weights) before the first; no 16-byte or 32-bit store anywhere: the only global stores are the
    working dtype's (cache slots and y). No local memory, no spills, at most 255 registers."""
    k = _step()
    op = k.KdaCacheStep(None, 128, 4, "verify", None, 2, eval(f"k.KdaVerifyConfig{cfg}"))
    ptx = ptx_of(_code("verify", cfg))
    body, bars = _split(ptx)
    assert len(bars) == 4, len(bars)
    conv_w_v4 = sum(it * op.num_threads < 3 * 128 for it in range(op.n_it))
    assert body[:bars[0]].count("ld.global.v4") == body.count("ld.global.v4") == op.n_pass + conv_w_v4
    stores = set(re.findall(r"\bst\.global(?:\.\w+)+", body))
    assert stores == {"st.global.b16"}, stores
    assert ".local" not in ptx
    regs, spills = ptxas_regs(ptx)
    assert spills == 0 and regs <= 255


@pytest.mark.parametrize("mode", ["writeback", "commit"])
@pytest.mark.parametrize("cfg", ["(4)", "(16, 8)"])
def test_writeback_and_commit_store_the_state_once_after_the_tokens(ptx_of, ptxas_regs, mode, cfg):
    """The state rows are loaded once before the first barrier and stored once (16-byte rows) after the
    last; nothing else is loaded or stored 16 bytes wide. No local memory, no spills."""
    k = _step()
    op = k.KdaCacheStep(None, 128, 4, mode, None, 2, eval(f"k.KdaVerifyConfig{cfg}"))
    ptx = ptx_of(_code(mode, cfg))
    body, bars = _split(ptx)
    assert len(bars) == 4, len(bars)
    conv_w_v4 = sum(it * op.num_threads < 3 * 128 for it in range(op.n_it))
    assert body[:bars[0]].count("ld.global.v4") == body.count("ld.global.v4") == op.n_pass + conv_w_v4
    assert body[bars[-1]:].count("st.global.v4") == body.count("st.global.v4") == op.n_pass
    assert ".local" not in ptx
    regs, spills = ptxas_regs(ptx)
    assert spills == 0 and regs <= 255


def _cpu_design(B=2, H=2, Dh=16, W=4, n_q=3, window=4):
    """A design holding CPU tensors as if begun (begin itself refuses CPU tensors): verify's and
    accept's argument checks run before any launch."""
    from fused.kda_verify_cache import KdaInputCacheFused
    d = KdaInputCacheFused(window)
    C = H * Dh
    d.base_state, d.base_conv = torch.zeros(B, H, Dh, Dh), torch.zeros(B, 3, C, W - 1, dtype=torch.bfloat16)
    d.layer = {"conv_w": torch.zeros(3, C, W)}
    d.n_q = n_q
    d._buffers(torch.zeros(B, window - 1 + n_q, 5 * C + H, dtype=torch.bfloat16), torch.zeros(B, dtype=torch.int32))
    d.fill_next = torch.zeros(B, dtype=torch.int32)
    draft = {n: torch.zeros(B, n_q, H if n == "beta_raw" else C, dtype=torch.bfloat16) for n in TOKEN}
    return d, draft


def _begin_args(B=2, H=2, Dh=16, W=4, n_q=3):
    C = H * Dh
    return dict(conv_state=torch.zeros(B, 3, C, W - 1, dtype=torch.bfloat16), state=torch.zeros(B, H, Dh, Dh),
                conv_w=torch.zeros(3, C, W), A_log=torch.zeros(H), dt_bias=torch.zeros(C), o_norm_w=torch.ones(Dh),
                lower_bound=-5.0, l2_eps=1e-6, norm_eps=1e-5, n_q=n_q)


def test_bad_arguments_are_rejected_by_name_in_one_line():
    from fused.kda_verify_cache import KdaInputCacheFused
    for window in (0, -1, 2.0, True, "6"):
        with pytest.raises(ValueError, match=r"^window: expected an int >= 1") as e:
            KdaInputCacheFused(window)
        assert "\n" not in str(e.value)
    good = _begin_args()
    bad_begin = (("state", good["state"].double(), "state"), ("state", good["state"][..., :8], "state"),
                 ("conv_state", good["conv_state"].float(), "conv_state"), ("conv_w", good["conv_w"][:2], "conv_w"),
                 ("A_log", good["A_log"][:1], "A_log"), ("o_norm_w", good["o_norm_w"].half(), "o_norm_w"),
                 ("n_q", 0, "n_q"), ("n_q", 30, "n_q: 30 with window 6 needs 35 cache slots"),
                 ("lower_bound", 0.5, "lower_bound"))
    for key, bad, words in bad_begin:
        with pytest.raises((ValueError, TypeError), match=f"^{re.escape(words)}") as e:
            KdaInputCacheFused(6).begin(**{**good, key: bad})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^state: the fused kernel needs a CUDA tensor"):
        KdaInputCacheFused(6).begin(**good)
    d, draft = _cpu_design()
    n = torch.ones(2, dtype=torch.int32)
    for key, bad in (("k_raw", draft["k_raw"][:, :2]), ("beta_raw", draft["beta_raw"][..., :1]),
                     ("z", draft["z"].half()), ("q_raw", draft["q_raw"].float())):
        with pytest.raises((ValueError, TypeError), match=f"^{key}") as e:
            d.verify(**{**draft, key: bad}, n_tokens=n)
        assert "\n" not in str(e.value)
    for bad in (n.float(), n[:1]):
        with pytest.raises((ValueError, TypeError), match="^n_tokens"):
            d.verify(**draft, n_tokens=bad)
        with pytest.raises((ValueError, TypeError), match="^accepted"):
            d.accept(bad)


def test_rollback_buffers_are_views_of_the_one_cache_buffer():
    """The harness poisons what rollback_buffers returns: each cache.<name> must be the design's own
    storage (a view of the packed cache), [B, S, ...] with fill as kept."""
    d, _ = _cpu_design()
    bufs = d.rollback_buffers()
    assert [n for n, _, _ in bufs] == [f"cache.{n}" for n in TOKEN]
    for name, t, kept in bufs:
        assert t.shape[:2] == (2, 6) and kept is d.fill
        assert t.untyped_storage().data_ptr() == d.cache_buf.untyped_storage().data_ptr()
        t.fill_(1.0)
    assert bool((d.cache_buf == 1.0).all())        # the six views tile the buffer
    f = d.fork()
    f.cache["z"].fill_(2.0)
    assert bool((d.cache["z"] == 1.0).all()) and bool((f.cache_buf[..., 4 * 32:5 * 32] == 2.0).all())


