"""fused/kda_verify.py and its accept (fused/kda_verify_accept.py): every static configuration compiles
for sm_90a on a machine without a GPU; the verify PTX reads the state once and keeps it on chip across
the tokens, the accept copies 16-byte vectors; the wrappers reject bad arguments by name before any
launch. GPU numerics (`gpu`-marked, skipped here, never counted as passed): against
references.kda_spec.kda_verify and its fp64 oracle at tiny, small and k3 with ragged counts; against
fused kda_decode run token by token (the conv windows bitwise), then the accept bitwise on the
verify's own checkpoints; slots past n_tokens and the committed
state untouched; counts clamped on the device; the accept bitwise with poisoned slots; and a timing
table of the n_q = 6 verify step against 6 kda_decode launches (run with -s).
"""
from __future__ import annotations

import os
import re
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before any cutlass import

import pytest
import torch

from fused import runtime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

KDA_DH = (128, 64, 32, 16)
TOKEN = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
LAYER = ("conv_w", "A_log", "dt_bias", "o_norm_w")


def _kv():
    from fused import kda_verify
    return kda_verify


def _kv_code(cfg: str, n_q: int = 8, count: str = "int32", Dh: int = 128) -> str:
    return f"from fused import kda_verify as m; m._compile('bfloat16', {Dh}, 4, {n_q}, '{count}', m.{cfg})"


# ------------------------------------------------------------------------------------------ CPU

@pytest.mark.parametrize("n_q", range(1, 9))
def test_kda_verify_compiles_every_variant_at_every_draft_length(n_q):
    """The K3 statics (bf16, Dh = 128, W = 4, int32 counts): every variant at every n_q."""
    m = _kv()
    for cfg in m.KdaVerifyConfig.all_configs():
        assert runtime.compile_for_cpu_check("kda_verify", "bfloat16", 128, 4, n_q, "int32", cfg) is not None


@pytest.mark.parametrize("Dh", KDA_DH)
def test_kda_verify_compiles_every_head_dim_dtype_and_count_dtype(Dh):
    """Every head dim: every variant at n_q = 1 and 8 (n_q only sets the static trip counts of the
    per-slot loops); fp16 and int64 counts with the dispatcher's pick."""
    m = _kv()
    for n_q in (1, 8):
        for cfg in m.KdaVerifyConfig.all_configs():
            assert runtime.compile_for_cpu_check("kda_verify", "bfloat16", Dh, 4, n_q, "int32", cfg) is not None
    for dtype, count in (("float16", "int32"), ("bfloat16", "int64"), ("float16", "int64")):
        assert runtime.compile_for_cpu_check("kda_verify", dtype, Dh, 4, 8, count,
                                             m.KdaVerifyConfig.for_shape(Dh)) is not None


@pytest.mark.parametrize("cfg", ["KdaVerifyConfig(4)", "KdaVerifyConfig(8)", "KdaVerifyConfig(16)",
                                 "KdaVerifyConfig(8, 8)", "KdaVerifyConfig(16, 8)"])
def test_kda_verify_reads_the_state_once_and_keeps_it_on_chip(ptx_of, ptxas_regs, cfg):
    """Two barriers: every global load (the state's 16-byte rows once, every slot's operands) before
    the first; between them the token loop stores one state checkpoint row per pass (16-byte stores of
    registers) and loads nothing from global memory; no register spills."""
    m = _kv()
    k = m.KdaVerify(None, 128, 4, 8, None, eval(f"m.{cfg}"))
    ptx = ptx_of(_kv_code(cfg))
    body = ptx[ptx.index(".entry"):]
    bars = [mt.start() for mt in re.finditer(r"\bbar(rier)?\.sync", body)]
    assert len(bars) == 2, len(bars)
    entry, loop, norm = body[:bars[0]], body[bars[0]:bars[1]], body[bars[1]:]
    conv_w_v4 = sum(it * k.num_threads < 3 * 128 for it in range(k.n_it))   # one 16-byte load per conv item
    assert entry.count("ld.global.v4") == k.n_pass + conv_w_v4
    assert "ld.global" not in loop and "ld.global" not in norm
    assert loop.count("st.global.v4") == k.n_pass           # one token's rows: the loop is not unrolled
    assert re.search(r"@%p\d+ bra|bra(\.uni)? ", loop)       # ... but a device loop over the live tokens
    assert ".local" not in ptx
    assert ptxas_regs(ptx)[1] == 0


def _float_ops(ptx: str) -> dict:
    """Count of each rounding float instruction of the kernel (fma/mul/add/sub/rcp/ex2/rsqrt/cvt ...);
    moves, loads, stores, shuffles, compares, selects and the exact neg/abs left out."""
    import collections
    body, ops = ptx[ptx.index(".entry"):], collections.Counter()
    for line in body.splitlines():
        tok = line.split()
        op = tok[1] if tok and tok[0].startswith("@") and len(tok) > 1 else (tok[0] if tok else "")
        if re.search(r"\.(f32|bf16|f16)\b", op) and not op.startswith(("ld", "st", "mov", "shfl", "neg", "abs",
                                                                           "setp", "selp")):
            ops[op] += 1
    return dict(ops)


@pytest.mark.parametrize("verify_cfg,decode_cfg", [("KdaVerifyConfig(4)", "KdaConfig(4, True)"),
                                                   ("KdaVerifyConfig(8, 8)", "KdaConfig(8, True, row_chunk=8)")])
def test_kda_verify_one_token_issues_kda_decodes_float_operations(ptx_of, verify_cfg, decode_cfg):
    """At n_q = 1 the verify kernel issues exactly the rounding float instructions of the kda_decode
    variant with the same thread layout, each kind the same number of times: the same arithmetic, no
    operation added or dropped (their operand order may still differ: the GPU test compares values)."""
    verify = _float_ops(ptx_of(_kv_code(verify_cfg, n_q=1)))
    decode = _float_ops(ptx_of(f"from fused import kda_decode as m; m._compile('bfloat16', 128, 4, m.{decode_cfg})"))
    assert verify == decode and verify.get("fma.rn.f32", 0) > 100


def test_kda_verify_picks_fit_the_ctas_per_sm_they_are_picked_for(ptx_of, ptxas_regs, ctas_per_sm):
    """for_shape's register facts at n_q = 8: up to one CTA per SM (132 heads) its pick fits one CTA
    per SM, beyond it fits two; nothing spills."""
    m = _kv()
    for heads, ctas in ((132, 1), (133, 2)):
        cfg = m.KdaVerifyConfig.for_shape(128, heads)
        regs, spills = ptxas_regs(ptx_of(_kv_code(repr(cfg))))
        assert ctas_per_sm(regs, cfg.num_warps) >= ctas and spills == 0, (heads, cfg.name, regs, spills)


def test_kda_verify_configs_are_frozen_and_cover_the_dispatch():
    m = _kv()
    for Dh in KDA_DH:
        for sms in (132, 114, 78):
            picks = {m.KdaVerifyConfig.for_shape(Dh, n, sms) for n in range(1, 6145)}
            assert picks <= set(m.KdaVerifyConfig.all_configs()), (Dh, sms)
    with pytest.raises(Exception):
        m.KdaVerifyConfig(4).num_warps = 8
    names = [c.name for c in m.KdaVerifyConfig.all_configs()]
    assert len(set(names)) == len(names)
    assert m.variants({}, {}) == m.KdaVerifyConfig.all_configs()
    with pytest.raises(ValueError, match="n_q"):
        m.KdaVerify(None, 128, 4, 9, None)


def _cpu_args(B=2, H=2, Dh=16, n_q=3, W=4) -> dict:
    C = H * Dh
    bf = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)
    f32 = lambda *s: torch.zeros(*s)
    return dict(q_raw=bf(B, n_q, C), k_raw=bf(B, n_q, C), v_raw=bf(B, n_q, C), g_raw=bf(B, n_q, C),
                beta_raw=bf(B, n_q, H), z=bf(B, n_q, C), n_tokens=torch.full((B,), n_q, dtype=torch.int32),
                conv_w=f32(3, C, W), conv_state=bf(B, 3, C, W - 1), A_log=f32(H), dt_bias=f32(C),
                o_norm_w=f32(Dh), state=f32(B, H, Dh, Dh), conv_ckpt=bf(B, n_q, 3, C, W - 1),
                state_ckpt=f32(B, n_q, H, Dh, Dh), lower_bound=-5.0, l2_eps=1e-6, norm_eps=1e-5)


def test_kda_verify_rejects_bad_arguments_by_name():
    m = _kv()
    good = _cpu_args()
    B, n_q, C = good["q_raw"].shape
    bad_cases = (
        ("k_raw", good["k_raw"][:, :, 1:], "k_raw"),
        ("beta_raw", good["beta_raw"][:, :2], "beta_raw"),
        ("n_tokens", good["n_tokens"].float(), "n_tokens"),
        ("n_tokens", good["n_tokens"][:1], "n_tokens"),
        ("state", good["state"].double(), "state"),
        ("conv_ckpt", good["conv_ckpt"][:, :2], "conv_ckpt"),
        ("state_ckpt", good["state_ckpt"].transpose(-1, -2), "state_ckpt"),     # right shape, not contiguous
        ("state_ckpt", good["state_ckpt"].bfloat16(), "state_ckpt"),
        ("lower_bound", 0.5, "lower_bound"),
    )
    for key, bad, word in bad_cases:
        with pytest.raises((ValueError, TypeError), match=f"^{word}"):
            m.kda_verify(**{**good, key: bad})
    nine = _cpu_args(n_q=9)
    with pytest.raises(ValueError, match="^q_raw: 9 draft slots"):
        m.kda_verify(**nine)
    for n in (0, n_q + 1):         # the counts are checked on the host by default, before the device check
        with pytest.raises(ValueError, match="^n_tokens: sequence 1"):
            m.kda_verify(**{**good, "n_tokens": torch.tensor([1, n], dtype=torch.int32)})
    with pytest.raises(ValueError, match="^state: the fused kernel needs a CUDA tensor"):
        m.kda_verify(**good)
    with pytest.raises(ValueError, match="^state: the fused kernel needs a CUDA tensor"):
        m.kda_verify(**{**good, "n_tokens": torch.tensor([0, 9], dtype=torch.int32)}, validate=False)


@pytest.mark.parametrize("Dh", KDA_DH)
def test_kda_accept_compiles_every_static_configuration(Dh):
    for dtype in ("bfloat16", "float16"):
        for count in ("int32", "int64"):
            assert runtime.compile_for_cpu_check("kda_verify_accept", dtype, Dh, 4, count) is not None


def test_kda_accept_copies_the_state_in_16_byte_vectors(ptx_of):
    """Dh = 128: 128 x 128 fp32 per head over 128 threads, 32 16-byte loads and stores per thread, the
    3 x 128 x 3 conv values by 2-byte copies; nothing else touches global memory but the count."""
    ptx = ptx_of("from fused import kda_verify_accept as m; m._compile('bfloat16', 128, 4, 'int32')")
    body = ptx[ptx.index(".entry"):]
    assert body.count("ld.global.v4") == 32 and body.count("st.global.v4") == 32
    assert body.count("ld.global.b16") == body.count("st.global.b16") == 9
    assert ".local" not in ptx


def test_kda_accept_rejects_bad_arguments_by_name():
    m = _kv()
    a = _cpu_args()
    B = a["state"].shape[0]
    good = dict(accepted=torch.ones(B, dtype=torch.int32), n_tokens=a["n_tokens"], conv_state=a["conv_state"],
                state=a["state"], conv_ckpt=a["conv_ckpt"], state_ckpt=a["state_ckpt"])
    for key, bad, word in (("accepted", good["accepted"].float(), "accepted"),
                           ("n_tokens", good["n_tokens"][:1], "n_tokens"),
                           ("state", good["state"].double(), "state"),
                           ("state", good["state"].transpose(-1, -2), "state"),
                           ("conv_ckpt", good["conv_ckpt"][:, :2], "conv_ckpt"),
                           ("state_ckpt", good["state_ckpt"][:, :, :1], "state_ckpt")):
        with pytest.raises((ValueError, TypeError), match=f"^{word}"):
            m.kda_accept(**{**good, key: bad})
    with pytest.raises(ValueError, match="^accepted: sequence 1 accepts 4"):
        m.kda_accept(**{**good, "accepted": torch.tensor([0, 4], dtype=torch.int32)})
    with pytest.raises(ValueError, match="^state: the fused kernel needs a CUDA tensor"):
        m.kda_accept(**good)


# ------------------------------------------------------------------------------------------ GPU

def _draft(config: str, batch: int, n_q: int, seed: int, dtype: str = "bfloat16") -> dict:
    """A verify step's tensors on the GPU, as property_tests/test_kda_spec_decode.py draws them: the
    committed state and layer weights of `seed`'s kda_decode case, token t of every sequence from
    the kda_decode case of seed + 1 + t (the harness's input builder for k3 shapes and values)."""
    from verify.model.case import Case
    from verify.ops.kda import make_kda_decode_inputs
    base = Case(op="kda_decode", seed=seed, batch=batch, config=config, dtype=dtype)
    first = make_kda_decode_inputs(base)
    steps = [make_kda_decode_inputs(replace(base, seed=seed + 1 + t)).tensors for t in range(n_q)]
    t = {k: torch.stack([s[k] for s in steps], dim=1) for k in TOKEN}
    t.update({k: first.tensors[k] for k in LAYER + ("conv_state", "state")})
    return {"tensors": {k: v.cuda() for k, v in t.items()}, "params": dict(first.params)}


def _run(verify, d: dict, n_tokens, cast=None, fill: float | None = None, **kw):
    """verify(...) on clones of d's tensors (cast by `cast`), into checkpoints filled with `fill`
    (random values where None). Returns y, the tensors it ran on, conv_ckpt, state_ckpt and the
    checkpoints' starting values."""
    t = {k: (cast(v) if cast is not None and v.is_floating_point() else v.clone()) for k, v in d["tensors"].items()}
    B, n_q = t["q_raw"].shape[:2]
    g = torch.Generator(device="cuda").manual_seed(7)
    conv_ckpt = torch.empty((B, n_q) + tuple(t["conv_state"].shape[1:]), dtype=t["conv_state"].dtype, device="cuda")
    state_ckpt = torch.empty((B, n_q) + tuple(t["state"].shape[1:]), dtype=t["state"].dtype, device="cuda")
    for c in (conv_ckpt, state_ckpt):
        c.copy_(torch.randn(c.shape, generator=g, device="cuda") if fill is None else torch.full_like(c, fill))
    start = (conv_ckpt.clone(), state_ckpt.clone())
    y = verify(**{k: t[k] for k in TOKEN}, n_tokens=n_tokens, **{k: t[k] for k in LAYER}, conv_state=t["conv_state"],
               state=t["state"], conv_ckpt=conv_ckpt, state_ckpt=state_ckpt, **d["params"], **kw)
    return y, t, conv_ckpt, state_ckpt, start


def _counts(B: int, n_q: int, dtype=torch.int32) -> torch.Tensor:
    """Ragged counts with 1 and n_q both present: 1, n_q, then a cycle through the middle."""
    vals = [1, n_q] + [2 + (3 * i) % max(n_q - 1, 1) for i in range(B - 2)]
    return torch.tensor([min(max(v, 1), n_q) for v in vals[:B]], dtype=dtype, device="cuda")


def _live(n_tokens: torch.Tensor, n_q: int) -> torch.Tensor:
    return torch.arange(n_q, device=n_tokens.device).view(1, n_q) < n_tokens.view(-1, 1).long()


def _variant_ids():
    return [c.name for c in _kv().KdaVerifyConfig.all_configs()]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config,B,n_q,variants", [
    ("tiny", 5, 8, "pick"), ("small", 5, 8, "pick"), ("small", 4, 3, "pick"), ("k3", 3, 8, "all")])
def test_kda_verify_matches_reference_on_gpu(config, B, n_q, variants):
    """Against the fp64 oracle, with kda_decode's GPU test rule: the fused error at most 2x the working-
    dtype reference's plus a floor (y: per (sequence, slot) row, 2^-7 of the row's max; the state
    checkpoints: per head, 2^-23 of its max; per head rather than per state row, since at k3 the
    per-row rule also fails for the certified kda_decode kernels). Conv checkpoints are copies: bitwise
    the reference's. Dead slots: y exactly 0, checkpoints bitwise their starting values."""
    from references.kda_spec import kda_verify as ref
    m = _kv()
    d = _draft(config, B, n_q, seed=11 * B + n_q)
    n_tokens = _counts(B, n_q)
    live = _live(n_tokens, n_q)
    oracle = _run(ref, d, n_tokens, cast=torch.Tensor.double, fill=0.0)
    base = _run(ref, d, n_tokens, fill=0.0)
    cfgs = [None] + (m.KdaVerifyConfig.all_configs() if variants == "all" else [])
    for cfg in cfgs:
        y, t, conv_ckpt, state_ckpt, (conv0, state0) = _run(m.kda_verify, d, n_tokens, variant=cfg)
        name = cfg.name if cfg else "pick"
        ec = (y.double() - oracle[0]).abs().amax(-1)
        eb = (base[0].double() - oracle[0]).abs().amax(-1)
        ok = ec <= 2 * eb + oracle[0].abs().amax(-1) * 2.0 ** -7
        assert bool(ok[live].all()), (name, (ec - 2 * eb)[live].max().item())
        assert bool((y[~live] == 0).all()), name
        assert torch.equal(conv_ckpt[live], base[2][live]), name
        assert torch.equal(conv_ckpt[~live], conv0[~live]), name
        assert torch.equal(state_ckpt[~live].view(torch.int32), state0[~live].view(torch.int32)), name
        es = (state_ckpt[live].double() - oracle[3][live]).abs().amax((-1, -2))
        esb = (base[3][live].double() - oracle[3][live]).abs().amax((-1, -2))
        assert bool((es <= 2 * esb + oracle[3][live].abs().amax((-1, -2)) * 2.0 ** -23).all()), name
        assert torch.equal(t["state"], d["tensors"]["state"]) and torch.equal(t["conv_state"], d["tensors"]["conv_state"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config,B,n_q,variant,count", [("k3", 3, 8, v, torch.int32) for v in _variant_ids()] + [
    ("k3", 2, 1, None, torch.int64), ("k3", 3, 1, "w16", torch.int32), ("small", 6, 8, None, torch.int64),
    ("small", 5, 7, "w8r8", torch.int64), ("tiny", 3, 2, None, torch.int64)])
def test_kda_verify_conv_windows_are_kda_decodes_and_accept_commits_its_checkpoints_on_gpu(config, B, n_q, variant,
                                                                                          count):
    """Per token the conv window is a copy of raw inputs: conv_ckpt[b, t] is, bit for bit, fused
    kda_decode's window after t + 1 launches from the committed state. (y and the state checkpoints
    are judged against the float64 oracle by test_kda_verify_matches_reference_on_gpu and the
    release profile: their fp32 sums may run in another order than kda_decode's, and the H200 shows
    the last bits differ.) Then kda_accept of a random accepted length commits, bit for bit, the
    verify's own checkpoint of that many tokens."""
    from fused import kda_decode as dec
    m = _kv()
    cfg = {c.name: c for c in m.KdaVerifyConfig.all_configs()}.get(variant)
    d = _draft(config, B, n_q, seed=5 * B + n_q)
    n_tokens = _counts(B, n_q, count)
    live = _live(n_tokens, n_q)
    y, t, conv_ckpt, state_ckpt, _ = _run(m.kda_verify, d, n_tokens, variant=cfg)
    src = d["tensors"]
    cs, st = src["conv_state"].clone(), src["state"].clone()
    for i in range(n_q):
        dec.kda_decode(*(src[k][:, i] for k in TOKEN), src["conv_w"], cs, src["A_log"], src["dt_bias"],
                       src["o_norm_w"], st, **d["params"], variant=dec.KdaConfig(4, True))
        keep = live[:, i]
        assert torch.equal(conv_ckpt[keep, i], cs[keep]), (variant, i)
    g = torch.Generator(device="cpu").manual_seed(B)
    accepted = torch.stack([torch.randint(0, int(n) + 1, (1,), generator=g)[0] for n in n_tokens.cpu()]).cuda()
    m.kda_accept(accepted, n_tokens, t["conv_state"], t["state"], conv_ckpt, state_ckpt)
    for b in range(B):
        a = int(accepted[b])
        want_s = src["state"][b] if a == 0 else state_ckpt[b, a - 1]
        want_c = src["conv_state"][b] if a == 0 else conv_ckpt[b, a - 1]
        assert torch.equal(t["state"][b], want_s) and torch.equal(t["conv_state"][b], want_c), (variant, b, a)


@pytest.mark.gpu
@needs_cuda
def test_kda_verify_counts_out_of_range_are_clamped_on_the_device_on_gpu():
    """validate=False reads no count on the host: the kernel clamps each to 0..n_q, which is the
    reference's result for the same counts (0: y = 0 and no checkpoint written; n_q + 3: n_q tokens).
    Checkpoints not written keep their random starting bits; the committed state is unchanged."""
    from references.kda_spec import kda_verify as ref
    m = _kv()
    B, n_q = 4, 4
    d = _draft("small", B, n_q, seed=3)
    n_tokens = torch.tensor([0, n_q + 3, -2, 2], dtype=torch.int32, device="cuda")
    y, t, conv_ckpt, state_ckpt, (conv0, state0) = _run(m.kda_verify, d, n_tokens, validate=False)
    yr, _, conv_r, state_r, _ = _run(ref, d, n_tokens, validate=False)
    live = _live(n_tokens.clamp(0, n_q), n_q)
    assert live.sum().item() == n_q + 2
    assert bool((y[~live] == 0).all())
    assert torch.allclose(y[live].float(), yr[live].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(conv_ckpt[~live], conv0[~live]) and torch.equal(state_ckpt[~live], state0[~live])
    assert torch.equal(conv_ckpt[live], conv_r[live])
    assert torch.allclose(state_ckpt[live], state_r[live], rtol=1e-4, atol=1e-5)
    assert torch.equal(t["state"], d["tensors"]["state"]) and torch.equal(t["conv_state"], d["tensors"]["conv_state"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("count", [torch.int32, torch.int64])
def test_kda_accept_commits_the_accepted_checkpoint_bitwise_on_gpu(count):
    """accepted = a > 0: the committed state and conv window become bitwise checkpoint a-1, whose
    random bits include NaN payloads; slots at or past a are NaN-poisoned and must not reach the
    result; a = 0 leaves the sequence untouched. validate=False: counts past n_q clamp to n_q
    (the last slot), negative ones to 0. Against the reference's gather."""
    from references.kda_spec import kda_accept as ref
    m = _kv()
    B, H, Dh, n_q, W = 6, 4, 128, 5, 4
    C = H * Dh
    g = torch.Generator(device="cuda").manual_seed(1)
    bits = lambda *s: torch.randint(-2 ** 31, 2 ** 31 - 1, s, generator=g, device="cuda", dtype=torch.int32)
    state_ckpt = bits(B, n_q, H, Dh, Dh).view(torch.float32)
    conv_ckpt = bits(B, n_q, 3, C, W - 1).view(torch.bfloat16)[..., :W - 1].contiguous()
    state, conv_state = bits(B, H, Dh, Dh).view(torch.float32), bits(B, 3, C, W - 1).view(torch.bfloat16)[..., :W - 1].contiguous()
    n_tokens = torch.tensor([1, 5, 3, 5, 2, 4], dtype=count, device="cuda")
    accepted = torch.tensor([0, 5, 2, 1, 2, 0], dtype=count, device="cuda")
    for b, a in enumerate(accepted.tolist()):
        state_ckpt[b, a:] = float("nan")
        conv_ckpt[b, a:] = float("nan")
    want_s, want_c = state.clone(), conv_state.clone()
    for b, a in enumerate(accepted.tolist()):
        if a:
            want_s[b], want_c[b] = state_ckpt[b, a - 1], conv_ckpt[b, a - 1]
    s, c = state.clone(), conv_state.clone()
    m.kda_accept(accepted, n_tokens, c, s, conv_ckpt, state_ckpt)
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))
    assert torch.equal(c.view(torch.int16), want_c.view(torch.int16))
    s_ref, c_ref = state.clone(), conv_state.clone()
    ref(accepted, n_tokens, c_ref, s_ref, conv_ckpt, state_ckpt)
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
    over = torch.tensor([9, -3, 5, 0, 1, 2], dtype=count, device="cuda")      # clamped: 5, 0, 5, 0, 1, 2
    s, c = state.clone(), conv_state.clone()
    m.kda_accept(over, n_tokens, c, s, conv_ckpt, state_ckpt, validate=False)
    for b, a in enumerate([5, 0, 5, 0, 1, 2]):
        ws = state[b] if a == 0 else state_ckpt[b, a - 1]
        wc = conv_state[b] if a == 0 else conv_ckpt[b, a - 1]
        assert torch.equal(s[b].view(torch.int32), ws.view(torch.int32)), b
        assert torch.equal(c[b].view(torch.int16), wc.view(torch.int16)), b


@pytest.mark.gpu
@needs_cuda
def test_kda_verify_new_batch_size_does_not_recompile_on_gpu():
    """Batch and head count are dynamic: a second batch size at the same statics is a cache hit."""
    m = _kv()
    for B in (2, 7):
        d = _draft("small", B, 3, seed=B)
        _run(m.kda_verify, d, _counts(B, 3))
        if B == 2:
            before = runtime.cache_info()
    after = runtime.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def _graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of fn replayed from a CUDA graph (captured after one warm-up call)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


@pytest.mark.gpu
@needs_cuda
def test_kda_verify_timing_against_single_token_launches_on_gpu():
    """Prints (run with -s) the n_q = 6 verify step (the dispatcher's pick and every variant) against
    6 fused kda_decode launches (one token of every sequence each, the state updated in place) at the
    K3 per-rank shapes: heads = 96 / T for T = 1, 8, 16 and B = 1, 8, 64; every step a CUDA graph timed
    with CUDA events. Checks that each graph's verify output is the eager step's bits (the step reads
    its inputs only)."""
    from fused import kda_decode as dec
    from references.config import K3
    m = _kv()
    n_q, Dh, W = 6, K3.head_dim, K3.conv_kernel
    cfgs = m.KdaVerifyConfig.all_configs()
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
            conv_ckpt = torch.zeros((B, n_q, 3, C, W - 1), dtype=torch.bfloat16, device="cuda")
            state_ckpt = torch.zeros((B, n_q, H, Dh, Dh), device="cuda")
            n_tokens = torch.full((B,), n_q, dtype=torch.int32, device="cuda")
            out, times = {}, {}
            for cfg in [None] + cfgs:
                def verify(cfg=cfg):
                    out["y"] = m.kda_verify(**tok, n_tokens=n_tokens, **lay, conv_state=conv_state, state=state,
                                            conv_ckpt=conv_ckpt, state_ckpt=state_ckpt, **par, validate=False,
                                            variant=cfg)
                verify()
                y_eager = out["y"].clone()
                times[cfg.name if cfg else "pick"] = _graph_us(verify)
                assert torch.equal(out["y"], y_eager), (T, B, cfg)
            del conv_ckpt, state_ckpt, out
            cs, st = conv_state.clone(), state.clone()

            def decode6():
                for i in range(n_q):
                    dec.kda_decode(*(tok[k][:, i] for k in TOKEN), lay["conv_w"], cs, lay["A_log"], lay["dt_bias"],
                                   lay["o_norm_w"], st, **par)
            times["decode"] = _graph_us(decode6)
            pick = m.KdaVerifyConfig.for_shape(Dh, B * H, runtime.sm_count(state.device)).name
            rows.append((T, H, B, pick, times))
            torch.cuda.empty_cache()
    names = ["pick"] + [c.name for c in cfgs] + ["decode"]
    print(f"\nkda_verify n_q = {n_q} (pick and every variant) vs {n_q} x fused kda_decode, bf16, K3 per rank, "
          f"CUDA graphs, us per step; ratio = pick / decodes")
    print(f"{'T':>3} {'H':>3} {'B':>3} " + " ".join(f"{n:>8}" for n in names) + f" {'ratio':>6}  pick")
    for T, H, B, pick, times in rows:
        print(f"{T:>3} {H:>3} {B:>3} " + " ".join(f"{times[n]:>8.1f}" for n in names)
              + f" {times['pick'] / times['decode']:>6.2f}  {pick}")
    assert all(v > 0 for *_, times in rows for v in times.values())
