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
from property_tests.test_fused_kda_verify import _graph_us  # CUDA-graph replay timing, one copy

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
    the 8- and 16-warp layouts too (the row_chunk variants are those there: per-row reductions)."""
    k = _step()
    for dtype in ("bfloat16", "float16"):
        for count in ("int32", "int64"):
            assert _compile(mode, dtype, Dh, count) is not None
    if Dh < 128:
        for cfg in (k.KdaVerifyConfig(8), k.KdaVerifyConfig(16)):
            assert _compile(mode, "bfloat16", Dh, cfg=cfg, n_chunks=1) is not None


def test_the_compile_key_holds_no_batch_heads_draft_slots_or_window():
    """n_q and window only set S = window - 1 + n_q, and S only the chunk count: the K3 default (window
    6, n_q 6) and (window 3, n_q 8) share one kernel per mode."""
    import inspect
    k = _step()
    assert list(inspect.signature(k._compile.__wrapped__).parameters) == [
        "mode", "dtype", "Dh", "W", "count_dtype", "n_chunks", "cfg"]
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


@pytest.mark.parametrize("mode", MODES)
def test_the_dispatchers_picks_fit_the_ctas_per_sm_they_are_picked_for(ptx_of, ptxas_regs, ctas_per_sm, mode):
    """KdaVerifyConfig.for_shape's picks at K3 (window 6, n_q 6: 2 chunks): up to one CTA per SM, w16r8
    fits one; beyond, w8 fits two, as in kda_verify; nothing spills."""
    for cfg, warps, ctas in (("(16, 8)", 16, 1), ("(8)", 8, 2)):
        regs, spills = ptxas_regs(ptx_of(_code(mode, cfg)))
        assert spills == 0 and ctas_per_sm(regs, warps) >= ctas, (cfg, regs)


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




class _Emulated:
    """Mixin: KdaInputCacheFused with its launches replaced by a torch model of KdaCacheStep's modes
    (property_tests.kda_cache_emulation: references.kda.kda_decode per token over the batch, the
    kernel's clamps and slot mapping), so the design's own logic (the packed cache and its views, fill
    and fill_next, fork, what rollback_buffers declares) and the kernel's index logic run on the CPU.
    Not the CuTe code."""

    def _require_device(self, state) -> None:
        pass

    def _launch(self, mode, draft, count, y, conv_out, state_out) -> None:
        from property_tests.kda_cache_emulation import launch
        if draft is None:
            draft = [self.cache[n] for n in TOKEN]
        lay = self.layer
        launch(mode, *draft, count, self.cache_buf, self.fill, self.fill_next, lay["conv_w"], lay["A_log"],
               lay["dt_bias"], lay["o_norm_w"], self.base_conv, self.base_state, conv_out, state_out, y,
               *self.params, self.window)


def _emulated(window: int = 6):
    from fused.kda_verify_cache import KdaInputCacheFused
    return type("EmulatedKdaInputCacheFused", (_Emulated, KdaInputCacheFused), {})(window)


@pytest.mark.parametrize("window", [6, 1, 3])
def test_the_designs_logic_meets_the_contract_on_cpu_with_the_kernel_emulated(window):
    """The spec-decode contract on the CPU over the design's Python logic and an emulation of the
    kernel's index logic (_Emulated): the CuTe kernels themselves need CUDA (the gpu test runs them)."""
    from verify.spec_decode.contract import Drive, check_contract
    report = check_contract(lambda: _emulated(window), Drive(config="tiny", batch=3, steps=64 if window == 6 else 24,
                                                             seed=1))
    assert report.ok, "\n".join(map(str, report.violations)) + f"\nunjudged: {report.unjudged}"
    for p in ("prefix", "accept-zero", "growth", "poison"):
        assert report.tally[p].checks > 0, p


def test_the_emulated_design_is_the_reference_design_bit_for_bit_on_cpu():
    """With the kernel emulated by the reference's own kda_decode, the design's bookkeeping gives the
    reference design's bits: y, fill, the committed state and every committed cache slot, 40 steps."""
    from references.kda_spec_cache import KdaInputCache
    from verify.spec_decode.drive import Drive, as_drafted, draft_tokens, draw_counts, start_inputs
    drive = Drive(config="tiny", batch=4, n_q=5, steps=40, seed=3)
    start = start_inputs(drive)
    d, ref = _emulated(4), KdaInputCache(4)
    for x in (d, ref):
        x.begin(conv_state=start.tensors["conv_state"], state=start.tensors["state"],
                **{k: start.tensors[k] for k in LAYER}, **start.params, n_q=drive.n_q)
    for step in range(drive.steps):
        n, a = draw_counts(drive, step)
        draft = as_drafted(draft_tokens(drive, step), n)
        assert torch.equal(d.verify(**draft, n_tokens=n), ref.verify(**draft, n_tokens=n)), step
        d.accept(a)
        ref.accept(a)
        assert torch.equal(d.fill.long(), ref.fill), step
        for x, r in zip(d.committed(), ref.committed()):
            assert torch.equal(x, r), step
        kept = torch.arange(d.cache_buf.shape[1]).view(1, -1) < d.fill.view(-1, 1)
        for name in TOKEN:
            assert torch.equal(d.cache[name][kept], ref.cache[name][kept]), (step, name)


# ------------------------------------------------------------------------------------------ GPU

def _drive(config: str, batch: int, n_q: int, steps: int, seed: int = 5):
    from verify.spec_decode.drive import Drive
    return Drive(config=config, batch=batch, n_q=n_q, steps=steps, seed=seed, device="cuda")


def _begin(design, drive) -> dict:
    """begin() on the drive's first committed state and layer (verify.spec_decode.drive)."""
    from verify.spec_decode.drive import start_inputs
    start = start_inputs(drive)
    t = {k: v.cuda() for k, v in start.tensors.items()}
    design.begin(conv_state=t["conv_state"], state=t["state"], **{k: t[k] for k in LAYER}, **start.params,
                 n_q=drive.n_q)
    return t


def _step_inputs(drive, step: int):
    """Step `step`'s draft (slots past n_tokens NaN, as the harness drafts) and (n_tokens, accepted)."""
    from verify.spec_decode.drive import as_drafted, draft_tokens, draw_counts
    n, a = (x.cuda() for x in draw_counts(drive, step))
    tokens = {k: v.cuda() for k, v in draft_tokens(drive, step).items()}
    return as_drafted(tokens, n), n, a


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config,batch,n_q,window,steps", [
    ("tiny", 5, 8, 6, 40), ("small", 4, 6, 6, 40), ("small", 3, 3, 1, 24), ("small", 3, 8, 3, 24),
    ("tiny", 2, 1, 8, 24), ("small", 3, 8, 25, 12), ("k3", 2, 6, 6, 16)])
def test_the_design_follows_the_reference_input_cache_on_gpu(config, batch, n_q, window, steps):
    """Step by step beside references.kda_spec_cache.KdaInputCache on the same draft and counts: fill
    equal; the committed conv window and every committed cache slot bitwise (copies of raw inputs); y
    exactly 0 past n_tokens; y and the committed state close (2^-5 of the row maximum for y, 2^-7 for
    the state: the two sum in other orders and a conv output rounding the other way moves a token's
    k, v by a working-dtype ulp; a token skipped, doubled or replayed from the wrong slot moves them by
    O(1)). The float64 oracle's tolerances are the contract test's."""
    from fused.kda_verify_cache import KdaInputCacheFused
    from references.kda_spec_cache import KdaInputCache
    drive = _drive(config, batch, n_q, steps)
    fused, ref = KdaInputCacheFused(window), KdaInputCache(window)
    _begin(fused, drive)
    _begin(ref, drive)
    near = lambda x, r, tol: bool(((x.double() - r.double()).abs()
                                   <= tol * r.double().abs().amax(-1, keepdim=True) + 1e-30).all())
    wrote_back = 0
    for step in range(steps):
        draft, n, a = _step_inputs(drive, step)
        y, y_r = fused.verify(**draft, n_tokens=n), ref.verify(**draft, n_tokens=n)
        live = torch.arange(n_q, device="cuda").view(1, -1) < n.view(-1, 1)
        assert bool((y[~live] == 0).all()), step
        assert near(y[live], y_r[live], 2.0 ** -5), (step, (y[live].float() - y_r[live].float()).abs().max().item())
        full = (fused.fill.long() + a.long()) >= window
        fused.accept(a)
        ref.accept(a)
        wrote_back += int(full.sum())
        assert torch.equal(fused.fill.long(), ref.fill), step
        conv, st = fused.committed()
        conv_r, st_r = ref.committed()
        assert torch.equal(conv, conv_r), step
        assert near(st, st_r, 2.0 ** -7), (step, (st - st_r).abs().max().item())
        kept = torch.arange(fused.cache_buf.shape[1], device="cuda").view(1, -1) < fused.fill.view(-1, 1)
        for name in TOKEN:
            assert torch.equal(fused.cache[name][kept], ref.cache[name][kept]), (step, name)
    assert wrote_back > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config,window", [("small", 6), ("k3", 6), ("small", 1), ("small", 3)])
def test_the_design_meets_the_spec_decode_contract_on_gpu(config, window):
    """verify/spec_decode/contract.py over 64 steps (k3: 3 sequences x 96 heads): prefix (bitwise
    against its own fork verifying only the accepted tokens; against the float64 oracle by kda_decode's
    classes), accept-zero, growth (kda_layer's recurrent-state bound after every step) and poison (the
    cache slots past fill and the rejected drafts overwritten with NaN between steps). Window 6 through
    --design's own path (resolve_design imports MODULE:ATTR as the CLI does)."""
    from verify.spec_decode.contract import Drive, check_contract
    from verify.spec_decode.design import resolve_design
    from fused.kda_verify_cache import input_cache_fused
    factory = (resolve_design("fused.kda_verify_cache:KdaInputCacheFused", "cuda") if window == 6
               else (lambda: input_cache_fused(window)))
    report = check_contract(factory, Drive(config=config, batch=3, steps=64 if window == 6 else 24, device="cuda"))
    assert report.ok, "\n".join(map(str, report.violations)) + f"\nunjudged: {report.unjudged}"
    for p in ("prefix", "accept-zero", "growth", "poison"):
        assert report.tally[p].checks > 0, p
    print(f"\n{config} window {window}: growth worst err/tol {report.tally['growth'].worst_ratio:.3g}, "
          f"prefix worst {report.tally['prefix'].worst_ratio:.3g}")


@pytest.mark.gpu
@needs_cuda
def test_counts_out_of_range_are_clamped_on_the_device_on_gpu():
    """No count is read on the host: n_tokens clamps to 0..n_q (0: y all zeros and nothing cached;
    n_q + 3: n_q tokens) and accepted to 0..n_q, as the emulated kernel (_Emulated, on the same CUDA
    tensors) does: fill equal, conv windows and cache bitwise, y and states close."""
    from verify.spec_decode.drive import draft_tokens
    drive = _drive("small", 4, 4, 6)
    fused, emu = _emulated_on(drive, 3)
    for step in range(6):
        draft = {k: v.cuda() for k, v in draft_tokens(drive, step).items()}       # every slot a token
        n = torch.tensor([0, 7, -2, 2], dtype=torch.int64, device="cuda")
        a = torch.tensor([[0, 9, 1, -4], [3, 1, 0, 2]][step % 2], dtype=torch.int64, device="cuda")
        y, y_e = fused.verify(**draft, n_tokens=n), emu.verify(**draft, n_tokens=n)
        assert bool((y[0] == 0).all()) and bool((y[2] == 0).all()) and bool((y[3, 2:] == 0).all()), step
        assert torch.allclose(y.float(), y_e.float(), rtol=2e-2, atol=2e-2), step
        fused.accept(a)
        emu.accept(a)
        assert torch.equal(fused.fill, emu.fill) and torch.equal(fused.cache_buf, emu.cache_buf), step
        (conv, st), (conv_e, st_e) = fused.committed(), emu.committed()
        assert torch.equal(conv, conv_e) and torch.allclose(st, st_e, rtol=1e-3, atol=1e-4), step


def _emulated_on(drive, window: int):
    """A fused design and the emulated one (the kernel's index logic in torch), begun alike on the GPU."""
    from fused.kda_verify_cache import KdaInputCacheFused
    fused, emu = KdaInputCacheFused(window), _emulated(window)
    _begin(fused, drive)
    _begin(emu, drive)
    return fused, emu


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_graph_of_a_step_gives_the_eager_bits_on_gpu():
    """verify + accept captured once and replayed over 12 steps (the draft and counts copied into the
    graph's input buffers between replays) against a fork run eagerly on the same inputs: y, fill, the
    committed state and the cache bitwise. No host read inside the step, so capture succeeds."""
    from fused.kda_verify_cache import KdaInputCacheFused
    drive = _drive("small", 4, 6, 12)
    design = KdaInputCacheFused(4)
    _begin(design, drive)
    eager = design.fork()
    draft, n, a = _step_inputs(drive, 0)
    inp = {k: v.clone() for k, v in draft.items()}
    n_buf, a_buf, out = n.clone(), a.clone(), {}

    def step():
        out["y"] = design.verify(**inp, n_tokens=n_buf)
        design.accept(a_buf)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                          # compiles and warms up (its own step 0)
    torch.cuda.current_stream().wait_stream(s)
    y0 = eager.verify(**draft, n_tokens=n)
    eager.accept(a)
    assert torch.equal(out["y"], y0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    assert torch.equal(design.fill, eager.fill)       # capture records the step, it does not run it
    for i in range(1, 12):
        draft, n, a = _step_inputs(drive, i)
        for k, v in draft.items():
            inp[k].copy_(v)
        n_buf.copy_(n), a_buf.copy_(a)
        g.replay()
        y = eager.verify(**draft, n_tokens=n)
        eager.accept(a)
        assert torch.equal(out["y"], y), i
        assert torch.equal(design.fill, eager.fill) and torch.equal(design.cache_buf, eager.cache_buf), i
        for x, r in zip(design.committed(), eager.committed()):
            assert torch.equal(x, r), i


@pytest.mark.gpu
@needs_cuda
def test_new_batch_sizes_draft_lengths_and_windows_do_not_recompile_on_gpu():
    """One compile per (mode, dtype, Dh, W, count dtype, chunks, variant): a second batch size, n_q and
    window with the same chunk count are cache hits."""
    from fused.kda_verify_cache import KdaInputCacheFused
    cfg = _step().KdaVerifyConfig(4)
    for i, (B, n_q, window) in enumerate(((2, 3, 2), (5, 4, 3), (3, 8, 1))):
        drive = _drive("small", B, n_q, 3)
        d = KdaInputCacheFused(window, variant=cfg)
        _begin(d, drive)
        for step in range(3):
            draft, n, a = _step_inputs(drive, step)
            d.verify(**draft, n_tokens=n)
            d.accept(a)
            d.committed()
        if i == 0:
            before = runtime.cache_info()
    after = runtime.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


@pytest.mark.gpu
@needs_cuda
def test_step_timing_against_the_checkpoint_design_on_gpu():
    """Prints (run with -s) a speculative-decoding step, verify + accept, of the fused input cache
    (window 6) against the fused checkpoint design (fused.kda_verify's kda_verify + kda_accept,
    validate=False) at the K3 per-rank shapes: heads = 96 / T for T = 1, 8, 16, B = 1, 8, 64, bf16,
    n_q = 6 drafted. One CUDA graph holds 16 consecutive steps whose accepted lengths are drawn
    uniformly in 0..6 per sequence (so the input cache writes back at its own pace), replayed and
    timed with CUDA events; us per step."""
    from fused import kda_verify as kv
    from fused.kda_verify_cache import KdaInputCacheFused
    from references.config import K3
    n_q, Dh, W, steps, window = 6, K3.head_dim, K3.conv_kernel, 16, 6
    par = dict(lower_bound=K3.gate_lower_bound, l2_eps=K3.l2_eps, norm_eps=K3.rms_eps)
    rows = []
    for T in (1, 8, 16):
        H = K3.heads_per_rank(T)
        C = H * Dh
        for B in (1, 8, 64):
            g = torch.Generator(device="cuda").manual_seed(T * 100 + B)
            rn = lambda *s: torch.randn(*s, generator=g, device="cuda")
            tok = dict(q_raw=rn(B, n_q, C).bfloat16(), k_raw=rn(B, n_q, C).bfloat16(), v_raw=rn(B, n_q, C).bfloat16(),
                       g_raw=rn(B, n_q, C).bfloat16(), beta_raw=rn(B, n_q, H).bfloat16(), z=rn(B, n_q, C).bfloat16())
            lay = dict(conv_w=rn(3, C, W) / 2, A_log=rn(H) / 2, dt_bias=rn(C) / 3, o_norm_w=1 + rn(Dh) / 5)
            conv_state, state = rn(B, 3, C, W - 1).bfloat16(), rn(B, H, Dh, Dh) / 3
            n_tokens = torch.full((B,), n_q, dtype=torch.int32, device="cuda")
            accepted = torch.randint(0, n_q + 1, (steps, B), generator=g, device="cuda", dtype=torch.int32)
            times = {}
            cache = KdaInputCacheFused(window)
            cache.begin(conv_state=conv_state, state=state, **lay, **par, n_q=n_q)

            def cache_steps():
                for i in range(steps):
                    cache.verify(**tok, n_tokens=n_tokens)
                    cache.accept(accepted[i])
            times["cache"] = _graph_us(cache_steps, reps=10) / steps
            del cache
            cs, st = conv_state.clone(), state.clone()
            conv_ckpt = torch.zeros((B, n_q, 3, C, W - 1), dtype=torch.bfloat16, device="cuda")
            state_ckpt = torch.zeros((B, n_q, H, Dh, Dh), device="cuda")

            def ckpt_steps():
                for i in range(steps):
                    kv.kda_verify(**tok, n_tokens=n_tokens, **lay, conv_state=cs, state=st, conv_ckpt=conv_ckpt,
                                  state_ckpt=state_ckpt, **par, validate=False)
                    kv.kda_accept(accepted[i], n_tokens, cs, st, conv_ckpt, state_ckpt, validate=False)
            times["ckpt"] = _graph_us(ckpt_steps, reps=10) / steps
            del conv_ckpt, state_ckpt
            pick = kv.KdaVerifyConfig.for_shape(Dh, B * H, runtime.sm_count(state.device)).name
            rows.append((T, H, B, pick, times))
            torch.cuda.empty_cache()
    print(f"\nspec-decode step (verify + accept), n_q = {n_q} drafted, accepted uniform 0..{n_q}, bf16, K3 per rank, "
          f"CUDA graphs of {steps} steps, us per step; speedup = checkpoints / input cache (window {window})")
    print(f"{'T':>3} {'H':>3} {'B':>3} {'cache':>8} {'ckpt':>8} {'speedup':>8}  pick")
    for T, H, B, pick, t in rows:
        print(f"{T:>3} {H:>3} {B:>3} {t['cache']:>8.1f} {t['ckpt']:>8.1f} {t['ckpt'] / t['cache']:>8.2f}  {pick}")
    assert all(v > 0 for *_, t in rows for v in t.values())
