"""What is special to the KDA family (references/kda.py); generic properties run over the registry."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from references.kda import (gated_delta_step, kda_attention_step, kda_decode, kda_gate, kda_in_proj,
                            short_conv_update)
from references.primitives import l2_normalize
from verify.model.case import Case
from verify.ops.kda import make_kda_attention_step_inputs, make_kda_decode_inputs
from verify.model.values import draw, generator

FAST = settings(max_examples=8, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def _step_inputs(gen, B, H, K, V):
    """Normalised keys/queries, decays in (e^-5, 1), betas in (0, 1): what kda_decode feeds the step."""
    q = l2_normalize(torch.randn(B, H, K, generator=gen, dtype=torch.float64)) * K ** -0.5
    k = l2_normalize(torch.randn(B, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(B, H, V, generator=gen, dtype=torch.float64)
    alpha = torch.exp(-5 * torch.rand(B, H, K, generator=gen, dtype=torch.float64))
    beta = torch.rand(B, H, generator=gen, dtype=torch.float64)
    return q, k, v, alpha, beta


@FAST
@given(seed=seeds)
def test_recurrence_matches_closed_form_over_64_steps(seed):
    """S_t = (I - b k k^T) Diag(a) S_{t-1} + b k v^T, o_t = S_t^T q (math layout K x V; stored V-first)."""
    gen = generator(seed)
    B, H, K, V = 2, 3, 8, 6
    state = torch.randn(B, H, V, K, generator=gen, dtype=torch.float64) * 0.3
    closed = state.transpose(-1, -2).clone()                    # [B, H, K, V]
    eye = torch.eye(K, dtype=torch.float64)
    for _ in range(64):
        q, k, v, alpha, beta = _step_inputs(gen, B, H, K, V)
        o, state = gated_delta_step(state, q, k, v, alpha, beta)
        b = beta[..., None, None]
        closed = ((eye - b * k[..., :, None] * k[..., None, :]) @ (alpha[..., :, None] * closed)
                  + b * k[..., :, None] * v[..., None, :])
        o_closed = (closed * q[..., :, None]).sum(-2)
        torch.testing.assert_close(o, o_closed, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.transpose(-1, -2), closed, rtol=1e-12, atol=1e-12)


@FAST
@given(seed=seeds)
def test_single_pass_readout_matches_two_pass(seed):
    """Kernels read out before writing: o = S'^T q + b (q.k) u_raw, u_raw = v - S'^T k, S' = Diag(a) S."""
    gen = generator(seed)
    B, H, K, V = 3, 4, 16, 16
    state = torch.randn(B, H, V, K, generator=gen, dtype=torch.float64)
    q, k, v, alpha, beta = _step_inputs(gen, B, H, K, V)
    o, _ = gated_delta_step(state, q, k, v, alpha, beta)
    decayed = state * alpha[..., None, :]
    u_raw = v - (decayed * k[..., None, :]).sum(-1)
    o_single = (decayed * q[..., None, :]).sum(-1) + beta[..., None] * (q * k).sum(-1, keepdim=True) * u_raw
    torch.testing.assert_close(o, o_single, rtol=1e-12, atol=1e-12)


@FAST
@given(seed=seeds, steps=st.integers(1, 8), width=st.sampled_from([2, 3, 4]),
       dtype=st.sampled_from([torch.float64, torch.bfloat16]))
def test_conv_update_matches_full_history_convolution(seed, steps, width, dtype):
    """Token-by-token conv with a W-1 state == causal depthwise conv1d over the whole history."""
    gen = generator(seed)
    B, C = 2, 24
    history = draw(gen, (B, C, width - 1 + steps), "normal", dtype=dtype)   # first W-1 = initial state
    conv_w = torch.randn(C, width, generator=gen, dtype=torch.float32)
    conv_state = history[..., : width - 1].clone()
    ys = [short_conv_update(history[..., width - 1 + t], conv_w, conv_state) for t in range(steps)]
    full = F.conv1d(history.to(torch.float64), conv_w.to(torch.float64)[:, None, :], groups=C)
    want = F.silu(full)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(torch.stack(ys, -1).to(torch.float64), want, **tol)
    assert torch.equal(conv_state, history[..., -(width - 1):])       # the state is a bitwise copy


@settings(max_examples=40, deadline=None)
@given(g=st.floats(-1e4, 1e4), a_log=st.floats(-3, 3), dt=st.floats(-10, 10),
       lb=st.sampled_from([-5.0, -1.0, -0.25]))
def test_gate_stays_within_lower_bound_and_zero(g, a_log, dt, lb):
    g_t, a_t, dt_t = (torch.tensor(v, dtype=torch.float64) for v in (g, a_log, dt))
    gate, alpha = kda_gate(g_t.view(1, 1, 1), a_t.view(1), dt_t.view(1), lb)
    arg = math.exp(a_log) * (g + dt)
    assert lb <= gate.item() <= 0.0
    if abs(arg) <= 30:    # sigmoid is strictly inside (0, 1) in float64 there
        assert lb < gate.item() < 0.0
    assert alpha.item() == pytest.approx(math.exp(gate.item()), rel=1e-15)


def _oracle_internals(t64: dict, params: dict):
    """v and o of the float64 step, recomputed from the primitives (for the error bound only)."""
    B, C = t64["q_raw"].shape
    H, Dh = t64["state"].shape[1], t64["state"].shape[-1]
    cs = t64["conv_state"].clone()
    q, k, v = (short_conv_update(t64[n], t64["conv_w"][i], cs[:, i]).view(B, H, Dh)
               for i, n in enumerate(("q_raw", "k_raw", "v_raw")))
    q = l2_normalize(q, params["l2_eps"]) * Dh ** -0.5
    k = l2_normalize(k, params["l2_eps"])
    _, alpha = kda_gate(t64["g_raw"].view(B, H, Dh), t64["A_log"], t64["dt_bias"], params["lower_bound"])
    o, _ = gated_delta_step(t64["state"], q, k, v, alpha, torch.sigmoid(t64["beta_raw"]))
    return v, o


@settings(max_examples=4, deadline=None)
@given(seed=seeds, dist=st.sampled_from(["normal", "heavy_tailed", "zero_rows"]))
def test_bf16_tracks_float64_over_32_steps_within_derived_bound(seed, dist):
    """Derivation (u = 2^-8, bf16 unit roundoff). Both runs see the same bf16 raw inputs, so the
    only difference is rounding the three conv outputs to bf16 (plus fp32 arithmetic, ~2^-24).
    After l2 normalisation |dk| <= 2u and |dv| <= u|v|. The step S -> (I - b k k^T) Diag(a) S is a
    contraction (b in (0,1), |k| <= 1, a <= 1), so a carried state error never grows, and step t adds
    at most b(2|dk| |S_{t-1}| + |dk||v| + |dv|) <= 4u|S_{t-1}|_F + 3u|v_t|. Hence per (b, h):
      |dS_t|_F <= E_t = sum_{s<=t} (4u |S_{s-1}|_F + 3u |v_s|).
    Read-out: |do| <= E_t |q| + |S_t|_F |dq| + u|o| with |q| <= Dh^-1/2, |dq| <= 2u Dh^-1/2 (the u|o|
    is o's bf16 rounding). RMSNorm n(o) = o / r(o) has |n(a) - n(b)| <= 2|a - b| / r(a), so
      |dy|_inf <= max|w sigmoid(z)| * 2 |do| / r(o) + u |y|_inf   (the last term: y's rounding).
    Both bounds get a factor 1.25 for the fp32 arithmetic and second-order (u^2) terms."""
    u = 2.0 ** -8
    case = Case("kda_decode", seed, 2, "tiny", "bfloat16", dist)
    bf = make_kda_decode_inputs(case)
    params = bf.params
    f64 = {n: t.to(torch.float64) for n, t in bf.tensors.items()}
    B, C = bf.tensors["q_raw"].shape
    H, Dh = bf.tensors["state"].shape[1], bf.tensors["state"].shape[-1]
    gen = generator(seed, 77)
    bound = torch.zeros(B, H, dtype=torch.float64)
    for step in range(32):
        for n in ("q_raw", "k_raw", "v_raw", "g_raw", "z"):
            bf.tensors[n] = draw(gen, (B, C), dist, dtype=torch.bfloat16)
        bf.tensors["beta_raw"] = draw(gen, (B, H), dist, dtype=torch.bfloat16)
        for n in ("q_raw", "k_raw", "v_raw", "g_raw", "z", "beta_raw"):
            f64[n] = bf.tensors[n].to(torch.float64)
        v64, o64 = _oracle_internals(f64, params)
        bound = bound + 4 * u * f64["state"].flatten(2).norm(dim=-1) + 3 * u * v64.norm(dim=-1)
        y_bf = kda_decode(**bf.tensors, **params).to(torch.float64).view(B, H, Dh)
        y64 = kda_decode(**f64, **params).view(B, H, Dh)
        state_err = (bf.tensors["state"].to(torch.float64) - f64["state"]).flatten(2).norm(dim=-1)
        assert (state_err <= 1.25 * bound).all(), f"step {step}: state error {state_err.max():.3g} > bound"
        do = bound * Dh ** -0.5 + f64["state"].flatten(2).norm(dim=-1) * 2 * u * Dh ** -0.5 + u * o64.norm(dim=-1)
        r = torch.sqrt(o64.pow(2).mean(-1) + params["norm_eps"])
        gate = (f64["o_norm_w"] * torch.sigmoid(f64["z"].view(B, H, Dh))).abs().amax(-1)
        y_bound = gate * 2 * do / r + u * y64.abs().amax(-1)
        y_err = (y_bf - y64).abs().amax(-1)
        assert (y_err <= 1.25 * y_bound).all(), f"step {step}: y error {y_err.max():.3g} > bound"
        assert torch.equal(bf.tensors["conv_state"].to(torch.float64), f64["conv_state"])


def _tiny_decode():
    inp = make_kda_decode_inputs(Case("kda_decode", 5, 2, "tiny", "bfloat16"))
    return dict(inp.tensors), dict(inp.params)


_BAD_DECODE = [
    ("state", lambda t: t["state"].to(torch.bfloat16), TypeError),
    ("state", lambda t: t["state"][:, :8].contiguous(), ValueError),
    ("q_raw", lambda t: t["q_raw"].tolist(), TypeError),
    ("k_raw", lambda t: t["k_raw"].to(torch.float16), TypeError),
    ("beta_raw", lambda t: t["beta_raw"][:, :3], ValueError),
    ("A_log", lambda t: torch.zeros(12), ValueError),
    ("dt_bias", lambda t: t["dt_bias"][:-1], ValueError),
    ("o_norm_w", lambda t: torch.ones(7), ValueError),
    ("conv_w", lambda t: t["conv_w"][:2], ValueError),
    ("conv_state", lambda t: t["conv_state"].float(), TypeError),
    ("z", lambda t: t["z"][:1], ValueError),
]


@pytest.mark.parametrize("name,bad,exc", _BAD_DECODE, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(_BAD_DECODE)])
def test_kda_decode_bad_input_names_the_argument_and_leaves_state(name, bad, exc):
    t, p = _tiny_decode()
    t[name] = bad(t)
    before = {n: t[n].clone() for n in ("state", "conv_state") if isinstance(t[n], torch.Tensor)}
    with pytest.raises(exc, match=f"^{name}:"):
        kda_decode(**t, **p)
    for n, old in before.items():
        assert torch.equal(t[n], old), f"{n} was modified by a call that raised"


def test_kda_decode_bad_lower_bound():
    t, p = _tiny_decode()
    with pytest.raises(ValueError, match="^lower_bound:"):
        kda_decode(**t, **{**p, "lower_bound": 1.0})


def test_in_proj_and_attention_step_bad_inputs():
    inp = make_kda_attention_step_inputs(Case("kda_attention_step", 1, 2, "tiny", "bfloat16"))
    t, p = dict(inp.tensors), dict(inp.params)
    with pytest.raises(ValueError, match="^w_in:"):
        kda_in_proj(t["x"], t["w_in"][:-1], t["w_fb"], p["n_heads"])
    with pytest.raises(ValueError, match="^n_heads:"):
        kda_in_proj(t["x"], t["w_in"], t["w_fb"], 0)
    with pytest.raises(TypeError, match="^w_fb:"):
        kda_in_proj(t["x"], t["w_in"], t["w_fb"].float(), p["n_heads"])
    state = t["state"].clone()
    with pytest.raises(ValueError, match="^w_o:"):
        kda_attention_step(**{**t, "w_o": t["w_o"][:, :-1]}, **p)
    assert torch.equal(t["state"], state)


def test_decode_updates_only_its_state():
    t, p = _tiny_decode()
    before = {n: v.clone() for n, v in t.items()}
    y = kda_decode(**t, **p)
    assert y.dtype == torch.bfloat16 and y.shape == t["q_raw"].shape and torch.isfinite(y).all()
    for n, old in before.items():
        changed = not torch.equal(t[n], old)
        assert changed == (n in ("state", "conv_state")), n


# ----------------------------------------------------------------------------------------------
# the state's running-error magnitude (verify.ops.kda.decode_state_magnitude)


def _run_decode(inputs, dtype=None):
    t = {n: v.clone() if dtype is None or not v.is_floating_point() else v.to(dtype) for n, v in inputs.tensors.items()}
    kda_decode(**t, **inputs.params)
    return t["state"]


def _state_in_another_order(inputs):
    """The new state in fp32 with every sum in another order: the conv window folded newest first,
    the key norms and S'k over reversed channels. The same math as the reference."""
    from references.primitives import silu

    t, p = inputs.tensors, inputs.params
    B, H, V, K = t["state"].shape

    def conv(i, x):
        terms = torch.cat([t["conv_state"][:, i].float(), x.float().unsqueeze(-1)], -1) * t["conv_w"][i]
        acc = terms[..., -1]
        for w in range(terms.shape[-1] - 2, -1, -1):
            acc = acc + terms[..., w]
        return silu(acc).to(x.dtype).float().view(B, H, -1)

    ks, v = conv(1, t["k_raw"]), conv(2, t["v_raw"])
    k = ks / torch.sqrt((ks * ks).flip(-1).sum(-1, keepdim=True) + p["l2_eps"])
    _, alpha = kda_gate(t["g_raw"].view(B, H, K), t["A_log"], t["dt_bias"], p["lower_bound"])
    sd = t["state"] * alpha.unsqueeze(-2)
    u = torch.sigmoid(t["beta_raw"].float()).unsqueeze(-1) * (v - (sd * k.unsqueeze(-2)).flip(-1).sum(-1))
    return sd + u.unsqueeze(-1) * k.unsqueeze(-2)


def test_state_magnitude_covers_an_order_change_in_fp32():
    """An fp32 evaluation in another order stays within the state's derived fp32 bound once the floor
    is scaled by the running-error magnitude; without it, rows whose conv cancels fail (so the sweep
    does reach them); and the magnitude is never below the result itself."""
    from verify.judge.compare import compare_derived
    from verify.ops.kda import decode_state_magnitude

    without = []
    for seed in range(40):
        for dist in ("heavy_tailed", "zero_rows", "outliers"):
            case = Case(op="kda_decode", config="tiny", dtype="float32", batch=8, seed=seed, dist=dist, tp=1)
            inputs = make_kda_decode_inputs(case)
            inputs64 = type(inputs)({n: v.double() if v.is_floating_point() else v
                                     for n, v in inputs.tensors.items()}, inputs.params)
            oracle, base = _run_decode(inputs64), _run_decode(inputs)
            mag = decode_state_magnitude(inputs64)["state"]
            assert (mag >= oracle.abs()).all()
            other = _state_in_another_order(inputs)
            check = compare_derived("state", other, oracle, base, 4.0, 16.0, magnitude=mag)
            assert check.ok, (seed, dist, check.detail)
            without.append(compare_derived("state", other, oracle, base, 4.0, 16.0).ok)
    assert not all(without)


def test_compiled_kda_decode_cancelling_conv_row_is_accepted():
    """The 200-seed run's one rejection (`pytest -m slow property_tests/test_correct_candidates.py`): a v conv row of this case
    cancelled 54x, so torch.compile's order moved that state row by ~25 ulps of the result, ~1 ulp of
    the conv's terms. zero_rows now also zeroes elements inside the other rows, so the
    case's draw differs: the test takes the case's most cancelling state row (its magnitude over its
    max |oracle|, rows below 1e-3 of the tensor's maximum left out) and judges the same two moves."""
    from verify.judge.compare import compare_derived, ulp
    from verify.ops.kda import decode_state_magnitude

    case = Case.from_json('{"batch":14,"config":"tiny","dist":"zero_rows","dtype":"float32","extra":[],'
                          '"op":"kda_decode","seed":2810,"tp":1}')
    inputs = make_kda_decode_inputs(case)
    inputs64 = type(inputs)({n: v.double() if v.is_floating_point() else v for n, v in inputs.tensors.items()},
                            inputs.params)
    oracle, base = _run_decode(inputs64), _run_decode(inputs)
    mag = decode_state_magnitude(inputs64)["state"]
    row_max = oracle.abs().amax(-1)
    cancel = torch.where(row_max > 1e-3 * row_max.max(), mag.amax(-1) / row_max, torch.zeros_like(row_max))
    row = tuple(int(i) for i in torch.unravel_index(cancel.argmax(), cancel.shape))
    ratio = float(cancel.max())
    assert ratio > 40
    # the spec's judgement of that row: a move of 25 ulps of the row's result is accepted, and the
    # magnitude's floor still has a bound (4x its 16 ulps of m: rejected)
    row_ulp = float(ulp(oracle[row].abs().max().reshape(1), torch.float32)[0])
    j = int(oracle[row].abs().argmax())
    for moved_ulps, ok in ((25, True), (4 * 16 * ratio, False)):
        moved = base.clone()
        moved[row + (j,)] += moved_ulps * row_ulp
        assert compare_derived("state", moved, oracle, base, 4.0, 16.0, magnitude=mag).ok is ok, moved_ulps
