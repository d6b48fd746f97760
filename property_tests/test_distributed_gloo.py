"""Real multi-process rank splits over gloo (T = 2 and 4): the declared rank-ordered fold certifies; a
reduction in another order fails on an order-sensitive input wherever the order actually differs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from verify.run.distributed import certify_distributed  # noqa: E402
from verify.ops.registry import get_op  # noqa: E402

OP = "allreduce_attn_res_rmsnorm"


@pytest.fixture(scope="module")
def outcomes():
    """(mode, T, dist) -> case status, from one rank group per T serving every mode."""
    verdicts = certify_distributed([get_op(OP)], "reference", "gloo", [2, 4],
                                   reduces=("fold", "allreduce", "reverse", "residual_first"), cases_per_op=2)
    out = {}
    for v in verdicts:
        mode = v.candidate.split("/")[2] if v.candidate.count("/") == 2 else "fold"
        for d in v.details:              # "T=2 order_sensitive: pass"
            t, rest = d.split(" ", 1)
            dist, status = rest.split(": ")
            out[(mode, int(t[2:]), dist)] = status
    out["verdicts"] = {v.candidate: v for v in verdicts}
    return out


@pytest.mark.parametrize("T", [2, 4])
def test_declared_fold_over_real_collectives_certifies(outcomes, T):
    assert outcomes[("fold", T, "order_sensitive")] == "pass"
    assert outcomes[("fold", T, "normal")] == "pass"
    assert outcomes["verdicts"]["reference/gloo"].status == "pass"


def test_wrong_order_fails_on_order_sensitive_input(outcomes):
    # T=4: a reversed fold and gloo's own all_reduce order both differ from rank 0..3
    assert outcomes[("reverse", 4, "order_sensitive")] == "fail"
    assert outcomes[("allreduce", 4, "order_sensitive")] == "fail"
    # T=2: two terms commute, so reversed/all_reduce give the same bits (not a bug); adding the residual
    # inside the fold is a different order and is caught (at T=2 by the O(1) case: next to 2^24 partials
    # the bf16 prefix is below the rounding of either order)
    assert outcomes[("reverse", 2, "order_sensitive")] == "pass"
    assert outcomes[("residual_first", 2, "normal")] == "fail"
    assert outcomes[("residual_first", 4, "order_sensitive")] == "fail"
    v = outcomes["verdicts"]["reference/gloo/reverse"]
    assert v.status == "fail" and "T=4" in v.reason


def test_nccl_without_gpus_is_a_skip_with_the_limit():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the skip path is for CPU hosts")
    (v,) = certify_distributed([get_op(OP)], "reference", "nccl", [2])
    assert v.status == "skip" and "needs 2 CUDA devices" in v.reason
