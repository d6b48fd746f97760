"""A candidate that changes the torch the reference runs on, in a way no guard can put back (a kernel
registered over aten::mm's CPU kernel, as vendor extension packages install theirs), must fail with
that named, and must not reach the verdicts of the candidates judged after it in the same run: each
candidate has a worker of its own, and a tainted worker is replaced. Runs the CLI in a subprocess
(the registrations would outlive the test otherwise)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# a GEMM whose 32-wide K chunks are summed in bf16: rejected by compare:y when judged honestly
BF16_PARTIALS = textwrap.dedent('''
    import torch

    def _bf16_partials_mm(a, b):
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        for k0 in range(0, a.shape[1], 32):
            part = torch.bmm(a[None, :, k0:k0 + 32], b[None, k0:k0 + 32])[0]
            acc = (acc.float() + part).to(torch.bfloat16)
        return acc.float()

    def _mm_cpu(a, b):
        if a.dtype == torch.float32:
            return _bf16_partials_mm(a, b)
        return torch.bmm(a[None], b[None])[0]

    def install():
        global _LIB
        _LIB = torch.library.Library("aten", "IMPL")
        _LIB.impl("mm", _mm_cpu, "CPU")

    def gemm(x, w):     # no aten::mm: its own result stays right, only the process is changed
        return (x.double()[:, None, :] * w.double()[None]).sum(-1).to(x.dtype)
''')

MODULES = {
    "taint_at_import": BF16_PARTIALS + "\ninstall()\n\ndef skinny_gemm(x, w):\n    return gemm(x, w)\n",
    "taint_in_call": BF16_PARTIALS + textwrap.dedent('''
        _DONE = []

        def skinny_gemm(x, w):
            if not _DONE:
                install()
                _DONE.append(1)
            return gemm(x, w)
    '''),
    "exits_at_import": "import sys\nsys.exit(0)\n\ndef skinny_gemm(x, w):\n    return x @ w.T\n",
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    d = tmp_path_factory.mktemp("taint")
    for name, text in MODULES.items():
        (d / f"{name}.py").write_text(text)
    return d


def _run(modules: Path, out: Path, candidates: str):
    env = {**os.environ, "PYTHONPATH": f"{modules}{os.pathsep}{ROOT}", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "verify.cli", "run", "--ops", "skinny_gemm", "--candidate", candidates,
                           "--device", "cpu", "--profile", "quick", "--examples", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("module, words", [
    ("taint_at_import", "changed the process the reference runs in"),
    ("taint_in_call", "cannot be undone in this process"),
])
def test_a_tainting_candidate_fails_and_the_next_one_is_judged_clean(modules, tmp_path, module, words):
    got = _run(modules, tmp_path / "out", f"{module}:skinny_gemm,reference")
    text = " ".join((got.stdout + got.stderr).split())
    assert got.returncode == 1, text[-2000:]
    assert words in text, text[-2000:]
    assert "aten::mm" in text or "torch.library kernels" in text, text[-2000:]
    import json
    cert = json.loads((tmp_path / "out" / "certificate.json").read_text())
    verdicts = {c: v["status"] for c, v in cert["ops"]["skinny_gemm"]["verdicts"].items()}
    assert verdicts[f"{module}:skinny_gemm"] == "fail", verdicts
    assert verdicts["reference"] == "pass", verdicts


def test_sys_exit_at_import_is_a_usage_error(modules, tmp_path):
    got = _run(modules, tmp_path / "out", "exits_at_import:skinny_gemm")
    assert got.returncode == 2, got.stdout + got.stderr
    assert "SystemExit" in got.stderr + got.stdout


def test_new_operators_defined_at_import_are_no_override(tmp_path):
    """torch._inductor defines new prims operators (and their kernels) as it loads, which a module-level
    torch.compile triggers (fla-core's modules do): no existing kernel is replaced, so the candidate is
    judged, and certifies (it computes the reference's arithmetic)."""
    got = _run(ROOT, tmp_path / "out", "property_tests.user_kernels.gemm_compiled_wrapper:skinny_gemm")
    text = " ".join((got.stdout + got.stderr).split())
    assert got.returncode == 0, text[-2000:]
    assert "changed the process" not in text


def test_an_override_is_found_among_new_definitions(modules):
    """Kernels over operators that existed before are still found when new operators come in the same
    import (the reading is per operator, not per namespace)."""
    import torch
    import torch.library

    from verify.judge import process_state as ps

    before = ps._Overrides()
    lib = torch.library.Library("prims", "FRAGMENT")
    lib.define("vk_test_new_op(Tensor x) -> Tensor")
    lib.impl("vk_test_new_op", lambda x: x.clone(), "CPU")
    mid = ps._Overrides()
    assert mid == before                                 # a new operator and its kernel: no override
    lib2 = torch.library.Library("aten", "IMPL")
    lib2.impl("sinh", lambda x: x, "CPU")
    after = ps._Overrides()
    try:
        assert after != before and "aten/sinh/CPU" in before.describe(after)
    finally:
        lib2._destroy()
        lib._destroy()
