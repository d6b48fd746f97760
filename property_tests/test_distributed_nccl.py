"""Real multi-process rank splits over NCCL on 2 GPUs (marked multi_gpu: skipped, with the limit,
on hosts with fewer devices). The same contract as the gloo tests: every collective op certifies
with the declared rank-ordered fold; a reduction in another order fails on an order-sensitive
input; the fused kernels certify inside real ranks."""
from __future__ import annotations

import pytest

from verify.ops.registry import all_ops, get_op
from verify.run.distributed import certify_distributed, collective_ops

COLLECTIVE_OPS = [op.name for op in collective_ops(list(all_ops().values()))]

pytestmark = pytest.mark.multi_gpu(2)


@pytest.fixture(scope="module")
def reference_verdicts():
    ops = [get_op(n) for n in COLLECTIVE_OPS]
    return {(v.op, v.candidate): v for v in certify_distributed(
        ops, "reference", "nccl", [2], reduces=("fold", "residual_first"), cases_per_op=2)}


@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_declared_fold_over_nccl_certifies(reference_verdicts, op):
    v = reference_verdicts[(op, "reference/nccl")]
    assert v.status == "pass", v.reason
    assert v.cases_run >= 2


def test_residual_inside_the_fold_fails_over_nccl(reference_verdicts):
    v = reference_verdicts[("allreduce_attn_res_rmsnorm", "reference/nccl/residual_first")]
    assert v.status == "fail" and "T=2" in v.reason


def test_fused_kernels_certify_inside_nccl_ranks():
    ops = [get_op(n) for n in ("allreduce_attn_res_rmsnorm", "router_topk")]
    verdicts = certify_distributed(ops, "fused", "nccl", [2], cases_per_op=2)
    for v in verdicts:
        assert v.status in ("pass", "skip"), (v.op, v.reason)
    assert any(v.status == "pass" for v in verdicts)
