"""The GPU-only guards against planted stream bugs (run on the device: `pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

from verify.case import Case
from verify.evaluate import evaluate_case
from verify.registry import get_op

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASE = Case("skinny_gemm", 7, 5, "small", "bfloat16", "normal", 1)


def _own_stream(x, w):
    """Does its work on a stream of its own that never waits for the caller's stream."""
    from references.gemm import skinny_gemm
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = skinny_gemm(x, w)
    return y


def _legacy_stream(x, w):
    """Launches on the legacy default stream whatever the caller's current stream is."""
    from references.gemm import skinny_gemm
    with torch.cuda.stream(torch.cuda.default_stream()):
        y = skinny_gemm(x, w)
    return y


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fn", [_own_stream, _legacy_stream], ids=["own_stream", "legacy_stream"])
def test_work_off_the_callers_stream_is_rejected(fn):
    v = evaluate_case(get_op("skinny_gemm"), CASE, fn, "mymod:bad", "cuda")
    assert v.status == "fail", v.reason
    assert v.stage in ("guard:stream_order", "guard:side_stream", "guard:cuda_graph") or v.stage.startswith(
        "compare:"), (v.stage, v.reason)


@pytest.mark.gpu
@needs_gpu
def test_stream_ordered_candidates_pass_the_stream_guard():
    from fused.skinny_gemm import skinny_gemm as fused
    from references.gemm import skinny_gemm as ref
    for fn, label in ((ref, "mymod:ref"), (fused, "fused")):
        v = evaluate_case(get_op("skinny_gemm"), CASE, fn, label, "cuda")
        checks = {c.name: c for c in v.checks}
        assert checks["guard:stream_order"].ok, checks["guard:stream_order"].detail
        assert v.status == "pass", (label, v.stage, v.reason)
