"""The bias test (verify/judge/bias.py): correct kernels of every summation order and rounding point pass it
on each case and over many cases together; biased kernels inside the element tolerance fail it."""
from __future__ import annotations

import pytest

from property_tests.legit import LEGIT, legit_row_signs
from verify.judge.bias import verdict_of
from verify.model.case import Case
from verify.ops.registry import get_op

SEEDS = 12


@pytest.mark.parametrize("op_name", sorted(LEGIT))
def test_legitimate_evaluations_show_no_bias(op_name):
    """Each legitimate evaluation's row signs, per case and summed over SEEDS cases x 3 dtypes x the op's
    dists (the pair-level statistic of a ci run)."""
    op = get_op(op_name)
    totals: dict[str, list[int]] = {}
    for dtype in ("bfloat16", "float16", "float32"):
        for i in range(SEEDS):
            case = Case(op_name, 1000 + i, 1 + (7 * i) % op.max_batch, ("tiny", "small")[i % 2], dtype,
                        op.dists[i % len(op.dists)])
            for name, (pos, neg, ulps, rows) in legit_row_signs(op_name, case).items():
                assert verdict_of(pos, neg, ulps / rows)[0], (case.to_json(), name, pos, neg, ulps / rows)
                t = totals.setdefault(name, [0, 0, 0.0, 0])
                for j, x in enumerate((pos, neg, ulps, rows)):
                    t[j] += x
    for name, (pos, neg, ulps, rows) in totals.items():
        assert verdict_of(pos, neg, ulps / rows)[0], (name, pos, neg, ulps / rows)
    assert sum(t[0] + t[1] for t in totals.values()) > 100      # the test saw rows that differ


def test_a_bias_inside_the_tolerance_is_found_at_the_stated_significance():
    from verify.judge.bias import ALPHA, MIN_EFFECT_ULPS

    assert verdict_of(25, 0, 0.5)[0] is False and verdict_of(24, 0, 0.5)[0] is True   # 2 x 2^-25 < 1e-7 < 2 x 2^-24
    assert verdict_of(6000, 4000, 0.11)[0] is True          # significant, but a legitimate design's size (P in bf16)
    assert verdict_of(6000, 4000, -0.3)[0] is False
    assert ALPHA == 1e-7 and MIN_EFFECT_ULPS == 0.25
