"""The suite's own setup (property_tests/conftest.py) in the two ways it is run: with pytest-xdist
(`-n auto`, the README's command) and without it (the GPU image's pytest has no xdist)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "property_tests/test_values.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_conftest_loads_without_xdist():
    r = _pytest("--collect-only", "-q", "-p", "no:xdist")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_n_auto_runs_a_worker_per_core_without_a_gpu():
    import os

    r = _pytest("-n", "auto", "-k", "no_test_has_this_name")
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]     # 5: every test deselected
    if torch.cuda.is_available():
        assert "workers" not in r.stdout, r.stdout[-2000:]      # in-process beside a GPU
    else:
        n = len(os.sched_getaffinity(0))
        assert f"created: {n}/{n} workers" in r.stdout, r.stdout[-2000:]
