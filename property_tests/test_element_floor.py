"""The element rule of the derived specs (element_floor, OpDef.magnitudes) accepts every legitimate
evaluation of an op (other fp32 orders, fewer roundings: property_tests/legit.py) on drawn cases, and
the row rule alone is what admitted the planted small-element bugs (property_tests/planted)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from property_tests.legit import LEGIT, judge_legit
from verify.model.case import Case
from verify.ops.registry import get_op
from verify.model.values import EDGE_DISTS, GENERIC_DISTS

SHARP_SCORES = (("n_blocks", 7), ("score_scale", 64.0))       # attn_res's knob-sweep case


@pytest.mark.parametrize("op_name", sorted(LEGIT))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), config=st.sampled_from(["tiny", "small"]),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), batch=st.integers(1, 64),
       dist=st.sampled_from(sorted(set(GENERIC_DISTS + EDGE_DISTS))), sharp=st.booleans())
# drawn in CI (2026-12-03): torch's CPU SDPA, then a "legitimate" mla_decode_attn order, returned 0
# where the oracle is NaN (a length-3 sequence, one head); checked on every run since
@example(seed=0, config="small", dtype="bfloat16", batch=36, dist="nonfinite", sharp=False)
def test_legitimate_evaluations_pass_the_element_rule(op_name, seed, config, dtype, batch, dist, sharp):
    op = get_op(op_name)
    dist = dist if dist in op.dists else op.dists[0]
    extra = SHARP_SCORES if sharp and "attn_res" in op_name else ()
    case = Case(op_name, seed, min(batch, op.max_batch), config, dtype, dist, extra=extra)
    worst = judge_legit(op_name, case)
    assert max(worst.values()) <= 1.0, (case.to_json(), worst)


@pytest.mark.parametrize("op_name,dtype", [("skinny_gemm", "bfloat16"), ("attn_res_rmsnorm", "float16")])
def test_the_element_rule_is_what_rejects_a_per_row_fixed_point_store(op_name, dtype):
    """A store with one exponent per row (every element a multiple of 2^-p x its row's maximum) passes
    the row rule and fails the element rule: the test can fail, and the rule is the reason."""
    from verify.judge.candidates import reference_fn
    from verify.judge.compare import compare_derived
    from verify.judge.calls import run_plain, to_oracle
    from verify.model.specs import load_spec
    op, spec = get_op(op_name), load_spec(op_name)
    out = op.outputs[0]
    case = Case(op_name, 3, 16, "small", dtype, "normal")
    inputs = op.make_inputs(case)
    inputs64 = to_oracle(inputs)
    oracle = run_plain(reference_fn(op), op, inputs64, "cpu")[out]
    base = run_plain(reference_fn(op), op, inputs, "cpu")[out]
    step = base.float().abs().amax(-1, keepdim=True) / (1 / torch.finfo(base.dtype).eps - 1)
    fixed = (torch.round(base.float() / step) * step).to(base.dtype)
    k, floor = spec.output(out).bounds(base.dtype)
    mag = op.magnitudes(inputs64, {out: base}).get(out) if op.magnitudes else None
    assert compare_derived(out, fixed, oracle, base, k, floor, magnitude=mag).ok
    rho = spec.output(out).element_floor_for(base.dtype)
    chk = compare_derived(out, fixed, oracle, base, k, floor, magnitude=mag, element_floor=rho)
    assert not chk.ok and "per element" in chk.detail



def test_fp32_attn_res_covers_the_scores_rounding_at_sharp_scores():
    """Found while measuring the element rule (2026-12-01): in fp32 at score_scale = 64 (|score| ~ 300),
    the scores' fp32 rounding moves every softmax weight by ~2^-15 relative, and the online softmax (a
    fused kernel's formulation) reached 1.17x the old row tolerance (16 ulps of the row's largest
    |out|). out's magnitude now carries that term (verify.ops.attn_res.attn_res_out_magnitude)."""
    case = Case("attn_res_rmsnorm", 2, 12, "small", "float32", "normal", extra=SHARP_SCORES)
    assert max(judge_legit("attn_res_rmsnorm", case).values()) <= 1.0
