"""Self-tests of the comparison classes: each can fail, and each accepts what it should."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verify.judge.compare import (compare_bitwise, compare_derived, compare_tie_aware_ids, malformed_ids, ulp,
                                  vacuous_reason)

DT = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])


def _draw(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(shape, generator=g, dtype=torch.float64)
    return o, o.to(dtype)


@given(st.integers(0, 10**6), DT)
def test_baseline_itself_is_accepted(seed, dtype):
    o, b = _draw(seed, (4, 33), dtype)
    assert compare_derived("y", b, o, b, k=1.0, floor_ulps=0.0).ok


@given(st.integers(0, 10**6), DT, st.integers(0, 3), st.integers(0, 32))
def test_a_few_ulps_beyond_the_tolerance_fail(seed, dtype, row, col):
    o, b = _draw(seed, (4, 33), dtype)
    c = b.clone()
    c[row, col] = (o[row, col] + 8 * ulp(o[row].abs().max(), dtype) + 4 * (b - o).abs().max()).to(dtype)
    chk = compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0)
    assert not chk.ok and chk.worst[0][0] == (row, col)


def test_exact_baseline_does_not_make_the_rule_fail():
    o = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    b = o.to(torch.bfloat16)
    c = b.clone()
    c[0, 2] = torch.nextafter(c[0, 2].float(), torch.tensor(10.0)).to(torch.bfloat16)   # 1 ulp at scale 4
    assert compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0).ok
    c[0, 2] = 4.0625                                 # 2 ulps at scale 4: beyond the floor
    assert not compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0).ok


def test_nan_in_candidate_fails_and_rows_are_judged_separately():
    o, b = _draw(3, (3, 8), torch.bfloat16)
    c = b.clone()
    c[1, 4] = float("nan")
    chk = compare_derived("y", c, o, b, k=4.0, floor_ulps=4.0)
    assert not chk.ok and "non-finite" in chk.detail


def test_bitwise_nan_payloads_and_signed_zero():
    a = torch.tensor([float("nan"), 0.0, 1.0])
    b = a.clone()
    b.view(torch.int32)[0] |= 1                     # another NaN payload: still NaN == NaN
    assert compare_bitwise("y", a, b).ok
    b[1] = -0.0
    chk = compare_bitwise("y", a, b)
    assert not chk.ok and chk.metrics["mismatches"] == 1


def test_vacuous_oracles():
    assert vacuous_reason(torch.zeros(3, 3, dtype=torch.float64)) == "oracle output is all zeros"
    assert "no finite" in vacuous_reason(torch.full((2, 2), float("nan"), dtype=torch.float64))
    assert "zero wherever" in vacuous_reason(torch.tensor([0.0, float("inf")], dtype=torch.float64))
    assert vacuous_reason(torch.tensor([1.0, float("inf")], dtype=torch.float64)) is None   # judged where finite
    assert vacuous_reason(torch.ones(2, dtype=torch.float64)) is None


def test_non_finite_oracle_values_must_be_reproduced():
    """A NaN (or infinite) oracle element, e.g. an MXFP4 block under scale byte 0xFF, is judged, not a
    reason to skip the case: the candidate gives the same NaN / infinity there, and the finite rest
    of the row is judged as usual."""
    o, b = _draw(5, (3, 8), torch.bfloat16)
    o[1, 2], o[2, 5] = float("nan"), float("-inf")
    b = b.clone()
    b[1, 2], b[2, 5] = float("nan"), float("-inf")
    assert compare_derived("y", b, o, b, k=2.0, floor_ulps=1.0).ok
    for bad in (1.0, float("inf")):                  # a number, or another non-finite, where the oracle is NaN
        c = b.clone()
        c[1, 2] = bad
        chk = compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0)
        assert not chk.ok and "oracle is NaN or infinite" in chk.detail
    c = b.clone()
    c[2, 5] = float("inf")                           # the wrong infinity
    assert not compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0).ok
    c = b.clone()
    c[1, 3] = c[1, 3] + 1.0                          # a finite element of the NaN row is still judged
    assert not compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0).ok


def test_overflowing_baseline_gives_no_infinite_tolerance():
    """The reference overflowing the working dtype where the oracle is finite (fp16 past 65504) is no
    witness of its rounding noise: its row is judged with the median rule, so a wrong element of that
    row still fails; the fp16 infinity the oracle rounds to is accepted."""
    o = torch.tensor([[70000.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    b = o.to(torch.float16)                          # 70000 -> inf
    assert torch.isinf(b[0, 0])
    assert compare_derived("y", b, o, b, k=2.0, floor_ulps=1.0).ok
    c = b.clone()
    c[0, 1] = 100.0
    chk = compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0)
    assert not chk.ok and chk.worst[0][0] == (0, 1)
    c = b.clone()
    c[0, 0] = float("-inf")
    assert not compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0).ok


@given(st.integers(0, 10**6), st.sampled_from([torch.bfloat16, torch.float16]))
def test_element_floor_catches_what_the_row_rule_admits(seed, dtype):
    """An element an eighth of an ulp of its row's maximum, negated or zeroed, is within the row rule
    (2 ulps of the row maximum) but not within the element rule; the baseline itself passes both."""
    o, b = _draw(seed, (4, 64), dtype)
    o[:, 0] = o.abs().amax(-1) * torch.finfo(dtype).eps / 8
    b = o.to(dtype)
    for c in (torch.where(torch.arange(64) == 0, -b, b), torch.where(torch.arange(64) == 0, 0 * b, b)):
        assert compare_derived("y", c, o, b, k=2.0, floor_ulps=2.0).ok
        chk = compare_derived("y", c, o, b, k=2.0, floor_ulps=2.0, element_floor=2.0 ** -9)
        assert not chk.ok and "per element" in chk.detail and chk.worst[0][0][1] == 0
    assert compare_derived("y", b, o, b, k=2.0, floor_ulps=1.0, element_floor=2.0 ** -9).ok


def test_element_floor_and_magnitude_set_an_elements_scale():
    """Below element_floor x the row's scale, or below the element's running-error magnitude, an
    element errs on that scale: 2 ulps of its own value fail at its own scale and pass at 2^-9 x the
    row's (1 ulp there is 8 of its own); 4 ulps at 2^-9 fail there."""
    o = torch.tensor([[1.0, 2.0 ** -12, 0.5]], dtype=torch.float64)
    b = o.to(torch.bfloat16)
    c = b.clone()
    c[0, 1] = c[0, 1] + 2.0 ** -18                    # 2 bf16 ulps of 2^-12 (ulp 2^-19)
    assert not compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0, element_floor=2.0 ** -20).ok
    assert compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0, element_floor=2.0 ** -9).ok
    mag = torch.tensor([[1.0, 2.0 ** -9, 0.5]], dtype=torch.float64)
    assert compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0, element_floor=2.0 ** -20, magnitude=mag).ok
    c[0, 1] = b[0, 1] + 2.0 ** -14                    # 4 ulps at 2^-9 (ulp 2^-16)
    assert not compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0, element_floor=2.0 ** -9).ok


def _scores(seed, B=6, E=40):
    g = torch.Generator().manual_seed(seed)
    s64 = torch.rand(B, E, generator=g, dtype=torch.float64)
    return s64, s64.float()


@given(st.integers(0, 10**6))
def test_tie_aware_accepts_exact_topk_and_rejects_a_swap(seed):
    s64, s32 = _scores(seed)
    ids = s64.topk(8, -1).indices
    assert compare_tie_aware_ids("ids", ids, s64, s32, 8).ok
    bad = ids.clone()
    order = s64.sort(-1, descending=True).indices
    bad[0, 0] = order[0, -1]                       # the clear loser instead of the clear winner
    assert not compare_tie_aware_ids("ids", bad, s64, s32, 8).ok


def test_tie_aware_accepts_either_side_of_a_near_tie():
    s64 = torch.tensor([[0.9, 0.5, 0.5 + 1e-9, 0.1]], dtype=torch.float64)
    for ids in ([[0, 1]], [[0, 2]]):
        assert compare_tie_aware_ids("ids", torch.tensor(ids), s64, s64.float(), 2).ok
    assert not compare_tie_aware_ids("ids", torch.tensor([[0, 3]]), s64, s64.float(), 2).ok
    assert not compare_tie_aware_ids("ids", torch.tensor([[1, 1]]), s64, s64.float(), 2).ok


def test_exact_ties_follow_the_declared_lower_id_rule():
    s64 = torch.tensor([[0.9, 0.5, 0.5, 0.1]], dtype=torch.float64)
    assert compare_tie_aware_ids("ids", torch.tensor([[0, 1]]), s64, s64.float(), 2).ok
    chk = compare_tie_aware_ids("ids", torch.tensor([[0, 2]]), s64, s64.float(), 2)
    assert not chk.ok and "lower-id" in chk.detail


@pytest.mark.parametrize("dtype,subnormal", [(torch.bfloat16, 2.0 ** -130), (torch.float16, 2.0 ** -20),
                                              (torch.float32, 2.0 ** -140)])
def test_ulp_matches_nextafter(dtype, subnormal):
    """ulp(|x|) is the gap from x to the next value up in dtype (torch.nextafter, independent of the
    formula), at normal magnitudes, a power of two, and a subnormal (the exponent clamp)."""
    x = torch.tensor([1.0, 3.0, 1000.0, 2.0 ** -20, 0.75, subnormal], dtype=torch.float64).to(dtype)
    gap = torch.nextafter(x, torch.full_like(x, float("inf"))).double() - x.double()
    assert (gap > 0).all()
    assert torch.equal(ulp(x.double(), dtype), gap)


def test_tie_band_widens_with_the_scores_running_error_magnitude():
    """Two scores 3e-6 apart at the k-th place: a different pick is a wrong set while the band is the
    baseline's rounding, and allowed once the scores' terms are large enough (4 ulps of m >= 3e-6)."""
    scores64 = torch.tensor([[0.9, 0.5 + 3e-6, 0.5, 0.1]], dtype=torch.float64)
    scores_wd = scores64.to(torch.float32)
    swapped = torch.tensor([[0, 2]])
    assert not compare_tie_aware_ids("ids", swapped, scores64, scores_wd, 2).ok
    assert not compare_tie_aware_ids("ids", swapped, scores64, scores_wd, 2, torch.full((1, 4), 1.0)).ok
    assert compare_tie_aware_ids("ids", swapped, scores64, scores_wd, 2, torch.full((1, 4), 8.0)).ok


@given(st.integers(0, 10**6))
def test_tie_aware_ids_with_leading_dims_name_the_row_by_its_index(seed):
    """A layer's ids [steps, batch, k] against scores [steps, batch, E]: each (step, sequence) is one
    selection; the same clear-loser swap is caught wherever it is, and named by its index."""
    g = torch.Generator().manual_seed(seed)
    s64 = torch.rand(3, 4, 40, generator=g, dtype=torch.float64)
    ids = s64.topk(8, -1).indices
    assert compare_tie_aware_ids("router_ids", ids, s64, s64.float(), 8).ok
    t, b = int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
    bad = ids.clone()
    bad[t, b, 0] = s64[t, b].argmin()
    chk = compare_tie_aware_ids("router_ids", bad, s64, s64.float(), 8)
    assert not chk.ok and f"row ({t}, {b})" in chk.detail and chk.worst[0] == (t, b), chk.detail
    assert not compare_tie_aware_ids("router_ids", ids[:, :3], s64, s64.float(), 8).ok     # a sequence short
    assert not compare_tie_aware_ids("router_ids", ids.float(), s64, s64.float(), 8).ok    # not integer ids


def test_no_choice_is_judged_where_the_layer_routes_nothing():
    """The dense layer: ids [N, B, 0] against scores [N, B, 0]; ids of any other width fail."""
    none = torch.empty(2, 3, 0, dtype=torch.float64)
    assert compare_tie_aware_ids("router_ids", torch.empty(2, 3, 0, dtype=torch.int64), none, none.float(), 0).ok
    assert not compare_tie_aware_ids("router_ids", torch.zeros(2, 3, 1, dtype=torch.int64), none, none.float(), 0).ok
    assert malformed_ids(torch.empty(2, 3, 0, dtype=torch.int64), (2, 3, 0), 0) is None


def test_score_k_widens_the_band_by_the_candidates_allowed_score_error():
    """The k-th and (k+1)-th scores 3e-3 apart, the baseline's scores off by 5e-4: a swap lies outside
    the op's own band (2 x 5e-4) and inside a layer's (2 x 4 x 5e-4)."""
    s64 = torch.tensor([[0.9, 0.5 + 3e-3, 0.5, 0.1]], dtype=torch.float64)
    swd = (s64 + torch.tensor([[0.0, 5e-4, 0.0, 0.0]], dtype=torch.float64)).float()
    swapped = torch.tensor([[0, 2]])
    assert not compare_tie_aware_ids("ids", swapped, s64, swd, 2).ok
    assert compare_tie_aware_ids("ids", swapped, s64, swd, 2, score_k=4.0).ok
    assert not compare_tie_aware_ids("ids", torch.tensor([[0, 3]]), s64, swd, 2, score_k=4.0).ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_judging_on_the_gpu_gives_the_cpu_verdict(dtype):
    """Comparisons run where the oracle is (the GPU on a device run): same verdict, ratio and worst
    elements as on the CPU, for a passing and a failing candidate, bitwise and derived."""
    o, b = _draw(7, (64, 257), dtype)
    bad = b.clone()
    bad[5, 17] = (o[5, 17] + 64 * (b - o).abs().max() + 1e-3).to(dtype)
    for c in (b, bad):
        for rho in (None, 2.0 ** -9):
            cpu = compare_derived("y", c, o, b, k=2.0, floor_ulps=1.0, magnitude=o.abs() * 1.5, element_floor=rho)
            gpu = compare_derived("y", c.cuda(), o.cuda(), b.cuda(), k=2.0, floor_ulps=1.0,
                                  magnitude=(o.abs() * 1.5).cuda(), element_floor=rho)
            assert (cpu.ok, cpu.worst) == (gpu.ok, gpu.worst)
            assert cpu.metrics["ratio"] == pytest.approx(gpu.metrics["ratio"], rel=1e-12)
        cb, gb = compare_bitwise("y", c, b), compare_bitwise("y", c.cuda(), b.cuda())
        assert (cb.ok, cb.metrics, cb.worst) == (gb.ok, gb.metrics, gb.worst)


def test_worst_elements_break_ties_by_position():
    """Equal errors (every mismatch of a bitwise compare weighs 1) are reported lowest index first,
    largest error first overall: the report does not depend on topk's order among ties."""
    b = torch.zeros(4, 8)
    c = b.clone()
    for r, col in ((3, 7), (0, 5), (2, 1), (0, 2), (1, 0), (3, 3)):
        c[r, col] = 1.0
    chk = compare_bitwise("y", c, b)
    assert [w[0] for w in chk.worst] == [(0, 2), (0, 5), (1, 0), (2, 1), (3, 3)]
    c[3, 7] = float("nan")
    assert compare_bitwise("y", c, b).worst[0][0] == (0, 2)         # NaN vs 0 is a mismatch like the others
    o = torch.zeros(2, 4, dtype=torch.float64)
    d = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 0.0, float("nan"), 1.0]])
    got = compare_derived("y", d, o, o.float(), k=1.0, floor_ulps=1.0)
    assert [w[0] for w in got.worst][:4] == [(1, 2), (1, 0), (0, 1), (0, 3)]


def test_tie_aware_ids_judge_the_slot_order():
    """The ids of a row are listed by descending score; a swap is allowed only within the tie band,
    and equal scores list the lower id first."""
    s = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.2, 0.7]], dtype=torch.float64)
    swd = s.float()
    ok = compare_tie_aware_ids("ids", torch.tensor([[1, 3, 5, 2]]), s, swd, 4)
    assert ok.ok, ok.detail
    by_id = compare_tie_aware_ids("ids", torch.tensor([[1, 2, 3, 5]]), s, swd, 4)
    assert not by_id.ok and "order" in by_id.detail
    higher_first = compare_tie_aware_ids("ids", torch.tensor([[1, 5, 3, 2]]), s, swd, 4)
    assert not higher_first.ok and "lower id first" in higher_first.detail
    near = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.2, 0.7 + 1e-12]], dtype=torch.float64)
    swapped = compare_tie_aware_ids("ids", torch.tensor([[1, 3, 5, 2]]), near, near.float(), 4)
    assert swapped.ok, swapped.detail        # 1e-12 apart: within the band, either order
