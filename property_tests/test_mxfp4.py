"""What is special to MXFP4: nibble order, exact dequant, and both published quantisation rules
(RNE at every E2M1 midpoint, scale choice, where the two rules differ)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.mxfp4 import (E2M1_LUT, E2M1_MAGNITUDES, GROUP, MIDPOINTS, mxfp4_dequant, pack_fp4,
                              quantize_mxfp4_ct, quantize_mxfp4_ocp, unpack_fp4)

RULES = {"ocp": quantize_mxfp4_ocp, "ct": quantize_mxfp4_ct}



def test_low_nibble_is_the_even_column():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), groups=st.integers(1, 4))
def test_pack_unpack_roundtrip(seed, rows, groups):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, groups * GROUP), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(["bfloat16", "float16", "float32", "float64"]))
def test_dequant_is_the_exact_product_rounded_once(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (3, 2 * GROUP), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (3, 2), generator=g, dtype=torch.uint8)
    got = mxfp4_dequant(pack_fp4(codes), scale, dtype)
    for o in range(3):
        for i in range(2 * GROUP):
            s = int(scale[o, i // GROUP])
            exact = math.nan if s == 0xFF else math.ldexp(float(E2M1_LUT[int(codes[o, i])]), s - 127)
            want = torch.tensor(exact, dtype=torch.float64).to(getattr(torch, dtype))
            a, b = got[o, i], want
            assert (torch.isnan(a) and torch.isnan(b)) or (a == b and torch.signbit(a) == torch.signbit(b)), (o, i)


def test_dequant_special_bytes():
    packed = torch.tensor([[0x71] * 16], dtype=torch.uint8)            # codes 1 (0.5), 7 (6.0)
    assert torch.isnan(mxfp4_dequant(packed, torch.tensor([[0xFF]], dtype=torch.uint8))).all()
    tiny = mxfp4_dequant(packed, torch.tensor([[0]], dtype=torch.uint8), "float32")
    assert tiny[0, 0].item() == 2.0 ** -128 and tiny[0, 1].item() == 6 * 2.0 ** -127
    neg_zero = mxfp4_dequant(torch.full((1, 16), 0x88, dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
    assert bool(torch.signbit(neg_zero).all()) and not bool(neg_zero.any())


def _grid_codes(seed, rows, groups):
    """Random codes where every group's largest magnitude is 4 or 6: the scale that made them is
    the one both rules choose again, so quantise(dequant) must return the same bytes."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, groups * GROUP), generator=g, dtype=torch.uint8)
    top = torch.randint(6, 8, (rows, groups), generator=g, dtype=torch.uint8)        # code 6 = 4.0, 7 = 6.0
    sign = torch.randint(0, 2, (rows, groups), generator=g, dtype=torch.uint8) * 8
    pos = torch.randint(0, GROUP, (rows, groups), generator=g) + torch.arange(groups) * GROUP
    codes.scatter_(1, pos, top + sign)
    mags = (codes & 7).reshape(rows, groups, GROUP)
    codes = codes.reshape(rows, groups, GROUP)
    codes = torch.where(mags > top.unsqueeze(-1), top.unsqueeze(-1) + (codes & 8), codes)  # keep the max
    scale = torch.randint(100, 150, (rows, groups), generator=g, dtype=torch.uint8)
    return codes.reshape(rows, -1), scale


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(sorted(RULES)))
def test_quantise_dequantise_is_bitwise_on_grid_values(seed, rule):
    codes, scale = _grid_codes(seed, 4, 3)
    w = mxfp4_dequant(pack_fp4(codes), scale, "float64")
    packed, got_scale = RULES[rule](w)
    want = codes if rule == "ocp" else torch.where(codes == 8, torch.zeros_like(codes), codes)  # ct: -0 -> 0
    assert torch.equal(got_scale, scale)
    assert torch.equal(unpack_fp4(packed), want)
    assert torch.equal(mxfp4_dequant(packed, got_scale, "float64"), w)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(sorted(RULES)))
def test_any_grid_value_survives_requantisation(seed, rule):
    """Even when the group max is small the rule picks a scale under which every value is on the grid."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (3, 2 * GROUP), generator=g, dtype=torch.uint8)
    codes[:, :GROUP] &= 0b1011                                           # group 0: magnitudes <= 1.5
    w = mxfp4_dequant(pack_fp4(codes), torch.full((3, 2), 120, dtype=torch.uint8), "float64")
    assert torch.equal(mxfp4_dequant(*RULES[rule](w), "float64"), w)


def _expected_rne(v: float) -> float:
    """Nearest E2M1 magnitude; at a midpoint the even mantissa (index even) wins; above 6 saturate."""
    best = min(E2M1_MAGNITUDES, key=lambda m: (abs(m - v), E2M1_MAGNITUDES.index(m) % 2))
    return 6.0 if v > 6 else best


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_round_to_nearest_even_at_every_threshold(rule, sign):
    probes = []
    for t in MIDPOINTS.tolist() + [6.0]:        # amax stays ~6: scale 2^0 under both rules
        probes += [t, math.nextafter(t, 0), math.nextafter(t, 8)]
    row = torch.zeros(1, GROUP * -(-len(probes) // (GROUP - 1)), dtype=torch.float64)
    values = iter(probes)
    for gstart in range(0, row.shape[1], GROUP):                      # each group: 6.0 sets scale 2^0
        row[0, gstart] = 6.0
        for j in range(1, GROUP):
            row[0, gstart + j] = next(values, 0.0) * sign
    packed, scale = RULES[rule](row)
    assert bool((scale == 127).all())
    got = mxfp4_dequant(packed, scale, "float64")[0]
    for x, q in zip(row[0].tolist(), got.tolist()):
        assert q == math.copysign(_expected_rne(abs(x)), x), (rule, x, q)


def test_the_rules_differ_where_the_amax_mantissa_is_at_least_1_75():
    w = torch.zeros(1, GROUP, dtype=torch.float64)
    w[0, 0], w[0, 1] = 7.0, -0.1
    p_ocp, s_ocp = quantize_mxfp4_ocp(w)
    p_ct, s_ct = quantize_mxfp4_ct(w)
    assert s_ocp.item() == 127 and s_ct.item() == 128                 # floor(log2 7) vs 7 -> 8
    assert mxfp4_dequant(p_ocp, s_ocp, "float64")[0, 0].item() == 6.0  # saturated
    assert mxfp4_dequant(p_ct, s_ct, "float64")[0, 0].item() == 8.0   # 3.5 -> 4 (tie to even) x 2
    assert unpack_fp4(p_ocp)[0, 1].item() == 0x8 and unpack_fp4(p_ct)[0, 1].item() == 0x0  # -0 kept / not


def test_zero_and_nan_groups():
    w = torch.zeros(2, GROUP, dtype=torch.float64)
    w[1, 3] = float("nan")
    for quant in RULES.values():
        packed, scale = quant(w)
        assert scale.tolist() == [[0], [0xFF]]
        assert not bool(mxfp4_dequant(packed, scale, "float64")[0].any())


@pytest.mark.parametrize("call, error, arg", [
    (lambda: mxfp4_dequant(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)), ValueError, "scale"),
    (lambda: mxfp4_dequant(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.int32)), TypeError, "scale"),
    (lambda: mxfp4_dequant(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8)), TypeError, "packed"),
    (lambda: mxfp4_dequant(torch.zeros(2, 10, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)), ValueError, "packed"),
    (lambda: mxfp4_dequant(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "int8"), ValueError, "out_dtype"),
    (lambda: quantize_mxfp4_ocp(torch.zeros(2, 33)), ValueError, "w"),
    (lambda: pack_fp4(torch.full((1, 2), 16, dtype=torch.uint8)), ValueError, "codes"),
])
def test_bad_input_names_the_argument(call, error, arg):
    with pytest.raises(error, match=f"^{arg}"):
        call()


@pytest.mark.parametrize("config,want", [("tiny", 96), ("small", 160), ("k3", 3616)])
def test_off_tile_in_dim_is_an_odd_number_of_groups(config, want):
    """mxfp4_dequant's knob-sweep shape: I an odd multiple of the 32-wide group (no 64-column tile
    divides it) at or above the config's latent; an int knob still sets I; the sweep runs it."""
    from verify.model.case import Case
    from verify.model.profile import PROFILES
    from verify.plan.draw import knob_sweep_cases
    from verify.ops.mxfp4 import in_dim
    from verify.ops.registry import get_op
    case = Case("mxfp4_dequant", 0, 3, config, "bfloat16", extra=(("in_dim", "off_tile"),))
    I = in_dim(case)
    assert I == want and I % GROUP == 0 and (I // GROUP) % 2 == 1
    op = get_op("mxfp4_dequant")
    assert op.make_inputs(case).tensors["packed"].shape == (3, I // 2)
    assert in_dim(Case("mxfp4_dequant", 0, 3, config, extra=(("in_dim", 64),))) == 64
    cases = [c for c in knob_sweep_cases(op, PROFILES["release"], 0, None) if c.extra == (("in_dim", "off_tile"),)]
    assert {c.config for c in cases} == {"tiny", "small", "k3"}


def test_exhaustive_codes_pair_every_scale_byte_with_every_code():
    """The knob-sweep case codes='exhaustive': each row holds all 256 scale bytes, each group the 16
    codes twice, so fp16 output reaches subnormals, overflow and NaN; it runs in every output dtype."""
    from verify.model.case import Case
    from verify.model.profile import PROFILES, drawn_dtypes
    from verify.plan.draw import knob_sweep_cases
    from verify.ops.registry import get_op
    from references.mxfp4 import mxfp4_dequant
    op = get_op("mxfp4_dequant")
    t = op.make_inputs(Case("mxfp4_dequant", 4, 3, "tiny", "float16", extra=(("codes", "exhaustive"),))).tensors
    assert t["scale"].shape == (3, 256) and all(sorted(r.tolist()) == list(range(256)) for r in t["scale"])
    codes = torch.stack([t["packed"] & 0xF, t["packed"] >> 4], -1).reshape(3, -1, GROUP)
    assert (torch.stack([(codes == c).sum(-1) for c in range(16)]) == 2).all()
    w = mxfp4_dequant(t["packed"], t["scale"], "float16")
    sub = (w != 0) & (w.abs() < 2.0 ** -14)
    assert sub.any() and torch.isinf(w).any() and torch.isnan(w).any()
    cases = [c for c in knob_sweep_cases(op, PROFILES["ci"], 0, None) if c.extra == (("codes", "exhaustive"),)]
    assert {c.dtype for c in cases} == set(drawn_dtypes(op, PROFILES["ci"]))
