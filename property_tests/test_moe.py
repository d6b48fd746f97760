"""What is special to the MoE ops: the per-token expert loop equals the sorted/grouped form, the
working-precision run stays close to the float64 oracle, padding and the small dense ops."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.moe import (dense_mlp, l2_prefetch, latent_norm_up, moe_experts_mxfp4,
                            moe_experts_mxfp4_grouped, shared_experts)
from references.mxfp4 import mxfp4_dequant
from references.primitives import linear, rms_norm, situ_and_mul
from verify.model.case import Case
from verify.ops.moe import OPS

EXPERTS = next(op for op in OPS if op.name == "moe_experts_mxfp4")



def _inputs(seed, B, dtype="float64", dist="normal"):
    return EXPERTS.make_inputs(Case("moe_experts_mxfp4", seed, B, "tiny", dtype, dist))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), dist=st.sampled_from(["normal", "mxfp4_grid", "outliers"]))
def test_per_token_loop_equals_grouped_form_in_float64(seed, B, dist):
    i = _inputs(seed, B, "float64", dist)
    y = moe_experts_mxfp4(**i.tensors, **i.params)
    y_grouped = moe_experts_mxfp4_grouped(**i.tensors, **i.params)
    torch.testing.assert_close(y_grouped, y, rtol=1e-12, atol=1e-12 * float(y.abs().max()))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), dtype=st.sampled_from(["bfloat16", "float32"]))
def test_working_precision_agrees_with_float64(seed, B, dtype):
    low = _inputs(seed, B, dtype)
    oracle = {k: (v.double() if v.is_floating_point() else v) for k, v in low.tensors.items()}
    y64 = moe_experts_mxfp4(**oracle, **low.params)
    y = moe_experts_mxfp4(**low.tensors, **low.params).double()
    y_grouped = moe_experts_mxfp4_grouped(**low.tensors, **low.params).double()
    # a few roundings of O(1) intermediates per expert, averaged by the combine: 1e-2 relative for bf16
    tol = (2e-2 if dtype == "bfloat16" else 1e-5) * float(y64.abs().max())
    assert float((y - y64).abs().max()) <= tol
    assert float((y_grouped - y64).abs().max()) <= tol


def test_one_expert_by_hand():
    i = _inputs(3, 1)
    t = i.tensors
    e = int(t["ids"][0, 0])
    only = {**t, "ids": t["ids"][:, :1], "weights": torch.ones(1, 1)}
    w13 = mxfp4_dequant(t["w13_packed"][e], t["w13_scale"][e], "float64")
    w2 = mxfp4_dequant(t["w2_packed"][e], t["w2_scale"][e], "float64")
    want = situ_and_mul(t["z"] @ w13.T, i.params["situ_beta"], i.params["situ_linear_beta"]) @ w2.T
    torch.testing.assert_close(moe_experts_mxfp4(**only, **i.params), want, rtol=1e-13, atol=1e-13)


def test_padding_ids_and_zero_weights_contribute_nothing():
    i = _inputs(5, 3)
    t = i.tensors
    padded = {**t, "ids": torch.cat([t["ids"], torch.full((3, 2), -1)], 1),
              "weights": torch.cat([t["weights"], torch.ones(3, 2)], 1)}
    assert torch.equal(moe_experts_mxfp4(**padded, **i.params), moe_experts_mxfp4(**t, **i.params))


def test_latent_norm_up_and_shared_experts_compose_the_documented_steps():
    g = torch.Generator().manual_seed(0)
    x, y_lat = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 16, generator=g).bfloat16()
    w_up, norm_w = (torch.randn(32, 16, generator=g) / 4).bfloat16(), torch.ones(16).bfloat16()
    shared_out = torch.randn(3, 32, generator=g).bfloat16()
    want = linear(rms_norm(y_lat, norm_w, 1e-5), w_up) + shared_out
    assert torch.equal(latent_norm_up(y_lat, norm_w, w_up, shared_out, 1e-5), want)
    wgu, wd = (torch.randn(24, 32, generator=g) / 6).bfloat16(), (torch.randn(32, 12, generator=g) / 4).bfloat16()
    want = linear(situ_and_mul(linear(x, wgu), 4.0, 25.0), wd)
    assert torch.equal(shared_experts(x, wgu, wd), want) and torch.equal(dense_mlp(x, wgu, wd), want)


def test_l2_prefetch_has_no_effect():
    op = next(o for o in OPS if o.name == "l2_prefetch")
    inputs = op.make_inputs(Case("l2_prefetch", 1, 1, "tiny", "bfloat16", "normal"))
    before = {k: v.clone() for k, v in inputs.tensors.items()}
    assert l2_prefetch(**inputs.tensors, **inputs.params) is None
    assert all(torch.equal(before[k], inputs.tensors[k]) for k in before)


@pytest.mark.parametrize("name, bad, error", [
    ("ids", lambda t: t["ids"] + 100, ValueError),
    ("ids", lambda t: t["ids"].float(), TypeError),
    ("weights", lambda t: t["weights"][:, :1], ValueError),
    ("w2_scale", lambda t: t["w2_scale"][:, :, :1], ValueError),
    ("w13_packed", lambda t: t["w13_packed"].int(), TypeError),
    ("z", lambda t: t["z"].int(), TypeError),
])
def test_bad_input_names_the_argument(name, bad, error):
    i = _inputs(1, 2)
    with pytest.raises(error, match=f"^{name}"):
        moe_experts_mxfp4(**{**i.tensors, name: bad(i.tensors)}, **i.params)


def test_shared_experts_bad_input():
    with pytest.raises(ValueError, match="^w_down"):
        shared_experts(torch.zeros(2, 8), torch.zeros(6, 8), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="^shared_out"):
        latent_norm_up(torch.zeros(2, 4), torch.ones(4), torch.zeros(8, 4), torch.zeros(2, 7), 1e-5)


def test_situ_and_mul_matches_the_k3_formula_on_scalars():
    """SiTU(g, u) = 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25) (kimi-k3-math.md section 6), computed here with
    Python's math on a few points (the saturating tails, a sign change, zero), not with the reference's
    own torch expression; float64 in, so only the last bits may differ. Without linear_beta the up half
    passes through."""
    import math
    pts = [(1.5, 2.0), (-3.0, 40.0), (12.0, -80.0), (0.0, 5.0), (0.25, -0.5)]
    sig = lambda v: 1.0 / (1.0 + math.exp(-v))
    x = torch.tensor([[g for g, _ in pts] + [u for _, u in pts]], dtype=torch.float64)
    want = torch.tensor([[4 * math.tanh(g / 4) * sig(g) * 25 * math.tanh(u / 25) for g, u in pts]],
                        dtype=torch.float64)
    torch.testing.assert_close(situ_and_mul(x, 4.0, 25.0), want, rtol=1e-14, atol=1e-14)
    plain = torch.tensor([[4 * math.tanh(g / 4) * sig(g) * u for g, u in pts]], dtype=torch.float64)
    torch.testing.assert_close(situ_and_mul(x, 4.0, None), plain, rtol=1e-14, atol=1e-14)
