"""One case of an op through the whole harness pipeline (oracle, guards, every declared variant) for a
candidate named as the CLI names it: the shared body of the fused kernels' GPU harness tests."""
from __future__ import annotations


def judge_case(case, candidate: str = "fused", device: str = "cuda"):
    """The verdict of `candidate` ("fused", "compiled", or "module:attr") on `case` (verify.model.case.Case)."""
    from verify.judge.candidates import Candidate
    from verify.judge.pipeline import evaluate_case
    from verify.ops.registry import get_op

    op = get_op(case.op)
    return evaluate_case(op, case, Candidate(candidate).resolve(op, device), candidate, device)
