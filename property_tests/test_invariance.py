"""Invariance claims judged apart from values (verify/judge/invariance.py): right values with a broken
bitwise claim get the stage invariance:<guard>; wrong values keep the guard's own stage."""
from __future__ import annotations

from verify.judge.candidates import Candidate
from verify.model.profile import get_profile
from verify.run.runner import RunOptions, certify_op
from verify.ops.registry import get_op
from verify.model.verdict import FAIL

PROFILE = get_profile("quick")
UK = "property_tests.user_kernels.gemm_ok"


def test_a_batch_variant_kernel_within_tolerance_is_not_invariant_rather_than_wrong():
    v = certify_op(get_op("skinny_gemm"), Candidate(f"{UK}:skinny_gemm_batch_variant"), RunOptions(profile=PROFILE))
    assert v.status == FAIL and v.failure.stage == "invariance:batch_position", v.reason
    assert "within tolerance, but the spec claims batch invariance" in v.reason


def test_a_kernel_wrong_at_another_batch_position_is_not_called_variant():
    v = certify_op(get_op("skinny_gemm"), Candidate(f"{UK}:skinny_gemm_row_parity_wrong"), RunOptions(profile=PROFILE))
    assert v.status == FAIL and not v.failure.stage.startswith("invariance:"), v.reason
