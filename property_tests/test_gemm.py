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
