"""What is special to skinny_gemm: one rounding of an fp32-accumulated product, every registered shape."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.gemm import skinny_gemm
from verify.model.case import Case
from verify.model.profile import PROFILES, Profile, drawn_dtypes
from verify.plan.draw import knob_sweep_cases
from verify.ops.gemm import KNOB_PROJECTIONS, OPS, off_tile, projection_shape

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


@pytest.mark.parametrize("proj", KNOB_PROJECTIONS)
def test_each_projection_shape(proj):
    case = Case("skinny_gemm", 0, 2, "small", "bfloat16", extra=(("proj", proj),))
    N, K = projection_shape(case)
    inputs = GEMM.make_inputs(case)
    assert inputs.tensors["w"].shape == (N, K) and inputs.tensors["x"].shape == (2, K)


@pytest.mark.parametrize("config", ["tiny", "small", "k3"])
def test_off_tile_shape_is_off_every_power_of_two_tile_but_splits(config):
    """The off-tile projection: N and K odd multiples of 16 (no 32 / 64 / 128 tile divides them, 16-byte
    rows still do), every T of the column split divides N, and it is o_proj's shape rounded up."""
    N, K = projection_shape(Case("skinny_gemm", 0, 1, config, extra=(("proj", "off_tile"),)))
    o_N, o_K = projection_shape(Case("skinny_gemm", 0, 1, config, extra=(("proj", "o_proj"),)))
    for d, o in ((N, o_N), (K, o_K)):
        assert d % 16 == 0 and (d // 16) % 2 == 1 and o <= d < o + 32
    assert all(N % t == 0 for t in GEMM.split.tp_values)
    assert [off_tile(d) for d in (1, 16, 32, 64, 80, 7168)] == [16, 16, 48, 80, 80, 7184]


def test_knob_sweep_runs_the_off_tile_shape_in_every_profile():
    """skinny_gemm's knob sweep: an unsplit off-tile case per profile config, and one split at the
    profile's largest T; seeds apart from the T and dist sweeps'; none where the profile turns it off
    or the op has no knob sweep."""
    for name, profile in PROFILES.items():
        cases = knob_sweep_cases(GEMM, profile, 0, None)
        dtypes = drawn_dtypes(GEMM, profile)
        assert all(c.extra == (("proj", "off_tile"),) for c in cases)
        assert [c.config for c in cases if c.tp == 1 and c.dtype == dtypes[0]] == list(profile.configs), name
        others = [c for c in cases if c.dtype != dtypes[0]]          # each other dtype once, first config
        assert sorted(c.dtype for c in others) == sorted(dtypes[1:]), name
        assert all(c.config == profile.configs[0] and c.tp == 1 for c in others), name
        split = [c for c in cases if c.tp > 1]
        assert len(split) == 1 and split[0].tp == max(profile.sweep_tps or GEMM.split.tp_values), name
        assert all(200 <= c.seed < 300 for c in cases) and len({c.seed for c in cases}) == len(cases)
    off = Profile("x", 4, ("tiny",), 16, False, False, True, knob_sweep=False)
    assert knob_sweep_cases(GEMM, off, 0, None) == []
    from verify.ops.registry import get_op
    assert knob_sweep_cases(get_op("mla_qkv_a"), PROFILES["release"], 0, None) == []


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
    from verify.judge.compare import compare_derived
    from verify.model.specs import load_spec

    case = Case("skinny_gemm", seed, 1 + (seed * 7) % 64, config, "float32", dist)
    t = OPS[0].make_inputs(case).tensors
    x, w = t["x"], t["w"]
    oracle, base = x.double() @ w.double().T, x @ w.T
    k, floor = load_spec("skinny_gemm").output("y").bounds(torch.float32)
    for name, y in _fp32_orders(x, w).items():
        assert compare_derived("y", y, oracle, base, k, floor).ok, name
    bf16_partials = sum((x[:, i::4] @ w[:, i::4].T).bfloat16().float() for i in range(4))
    assert not compare_derived("y", bf16_partials, oracle, base, k, floor).ok
