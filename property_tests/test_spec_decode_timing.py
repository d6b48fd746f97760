"""`verify-kernels bench --spec-decode`: usage errors are one line with exit 2 (on any machine), the
table's per-step numbers and ratios come from the rows it is given, and the design copies rotated
hold more than L2 together. The timing itself needs a GPU (`STEPS=spec_bench bash .ci/gpu-certify` on the H200)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from verify.spec_decode import timing


@pytest.mark.parametrize("argv,says", [
    (["--spec-decode", "nosuch"], "--spec-decode 'nosuch' is unknown"),
    (["--spec-decode", ","], "names no design"),
    (["--spec-decode", "checkpoints", "--n-q", "9"], "--n-q 9: must be in 1..8"),
    (["--spec-decode", "checkpoints", "--tp", "x"], "--tp 'x': not a comma-separated list"),
    (["--spec-decode", "input-cache:0"], "window after 'input-cache:' must be an int >= 1"),
])
def test_usage_errors_are_one_line(argv, says):
    r = subprocess.run([sys.executable, "-m", "verify.cli", "bench", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0], r.stderr


def _stats(us: float, method: str = "graph") -> dict:
    return {"median_us": us, "p10_us": us, "p90_us": us, "samples": 10, "sets": 1, "calls": 2, "method": method}


def test_table_reports_each_design_per_step_and_over_decode():
    rows = [timing.Row(1, 8, 96, {"decode": _stats(20.0), "a": _stats(30.0), "b": _stats(50.0, "stream")}),
            timing.Row(16, 1, 6, {"decode": _stats(4.0), "a": _stats(10.0)}, {"b": "RuntimeError: boom"})]
    text = timing.table(rows, ["a", "b"], 6)
    assert "| 1 | 96 | 8 | 20.0 | 120.0 | 30.0 | 50.0 (stream) | 1.50 | 2.50 |" in text
    assert "| 16 | 6 | 1 | 4.0 | 24.0 | 10.0 | refused | 2.50 | - |" in text
    assert "| 6 x decode |" in text
    assert "n_q = 6" in text


def test_design_copies_hold_more_than_l2_together():
    from verify.bench.timing import ROTATE_BYTES
    for B, H in ((1, 6), (8, 12), (64, 96)):
        s = {"state": torch.empty(B, H, 128, 128, device="meta"), "conv_state": torch.empty(B, 3, H * 128, 3,
                                                                                           device="meta")}
        n = timing._copies(s, 6)
        per = s["state"].numel() * 4 * 7 + s["conv_state"].numel() * 2 * 7
        assert 1 <= n <= 16 and (n * per >= ROTATE_BYTES or n == 16), (B, H, n)
