"""One case of an op through the whole harness pipeline (oracle, guards, every declared variant) for a
candidate named as the CLI names it: the shared body of the fused kernels' GPU harness tests; and
`on_one_thread`, for CPU candidates built on torch's GEMM."""
from __future__ import annotations

import functools


def judge_case(case, candidate: str = "fused", device: str = "cuda"):
    """The verdict of `candidate` ("fused", "compiled", or "module:attr") on `case` (verify.model.case.Case)."""
    from verify.judge.candidates import Candidate
    from verify.judge.pipeline import evaluate_case
    from verify.ops.registry import get_op

    op = get_op(case.op)
    return evaluate_case(op, case, Candidate(candidate).resolve(op, device), candidate, device)


def on_one_thread(fn):
    """fn run on one intra-op thread. MKL's CPU GEMM splits its reduction by thread count on some machines
    (AMD EPYC, AVX2: a score's bits move), which the harness's thread_count guard rightly rejects; a test
    candidate built on torch's GEMM that stands for a kernel (whose bits do not depend on a CPU thread
    count) pins it."""
    import torch

    @functools.wraps(fn)
    def pinned(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return pinned
