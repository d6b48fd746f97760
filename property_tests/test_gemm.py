"""What is special to skinny_gemm: one rounding of an fp32-accumulated product, every registered shape."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.gemm import skinny_gemm
from verify.case import Case
from verify.ops.gemm import OPS, PROJECTIONS, projection_shape

GEMM = OPS[0]



@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), M=st.integers(1, 64), dtype=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_is_the_fp32_product_rounded_once(seed, M, dtype):
    inputs = GEMM.make_inputs(Case("skinny_gemm", seed, M, "tiny", dtype))
    x, w = inputs.tensors["x"], inputs.tensors["w"]
    y = skinny_gemm(x, w)
    assert y.dtype == x.dtype and y.shape == (M, w.shape[0])
    assert torch.equal(y, (x.float() @ w.float().T).to(x.dtype))
    exact = (x.double() @ w.double().T)
    assert bool(((y.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-6).all())


@pytest.mark.parametrize("proj", PROJECTIONS)
def test_each_projection_shape(proj):
    case = Case("skinny_gemm", 0, 2, "small", "bfloat16", extra=(("proj", proj),))
    N, K = projection_shape(case)
    inputs = GEMM.make_inputs(case)
    assert inputs.tensors["w"].shape == (N, K) and inputs.tensors["x"].shape == (2, K)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="^w"):
        skinny_gemm(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(TypeError, match="^w"):
        skinny_gemm(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="^x"):
        skinny_gemm(torch.zeros(8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="^proj"):
        projection_shape(Case("skinny_gemm", 0, 1, "tiny", extra=(("proj", "q_b"),)))


def _fp32_orders(x, w):
    """Other legitimate fp32 evaluations of x @ w.T: CPU BLAS on strided operands (another blocking),
    the K axis reversed, a 4-way split-K folded in fp32, the fp64 product rounded once."""
    xs, ws = x.repeat_interleave(2, dim=1)[:, ::2], w.repeat_interleave(2, dim=1)[:, ::2]
    return {"strided": xs @ ws.T, "reversed_k": x.flip(1) @ w.flip(1).T,
            "split4": sum(x[:, i::4] @ w[:, i::4].T for i in range(4)),
            "fp64_round": (x.double() @ w.double().T).float()}


@pytest.mark.parametrize("config,seed,dist", [("k3", 0, "wide_range"), ("small", 10, "normal"),
                                              ("small", 21, "heavy_tailed"), ("tiny", 8, "outliers")])
def test_fp32_spec_accepts_other_summation_orders_and_rejects_bf16_partials(config, seed, dist):
    """The float32 bounds of tolerance_specs/skinny_gemm.toml, at the draws that needed the most
    floor (measured: up to 23 fp32 ulps of the row maximum for strided BLAS at K = 12288): every
    legitimate fp32 order passes, while partial sums rounded to bf16 (a kernel that keeps its
    split-K partials in the activation dtype) fail."""
    from verify.compare import compare_derived
    from verify.specs import load_spec

    case = Case("skinny_gemm", seed, 1 + (seed * 7) % 64, config, "float32", dist)
    t = OPS[0].make_inputs(case).tensors
    x, w = t["x"], t["w"]
    oracle, base = x.double() @ w.double().T, x @ w.T
    k, floor = load_spec("skinny_gemm").output("y").bounds(torch.float32)
    for name, y in _fp32_orders(x, w).items():
        assert compare_derived("y", y, oracle, base, k, floor).ok, name
    bf16_partials = sum((x[:, i::4] @ w[:, i::4].T).bfloat16().float() for i in range(4))
    assert not compare_derived("y", bf16_partials, oracle, base, k, floor).ok
