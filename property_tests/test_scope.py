"""A candidate's declared scope (verify/plan/scope.py): a module's PARAMS pins the op's parameters it
supports, the verdict names the scope, and the gate can demand the whole contract."""
from __future__ import annotations

import json
import os
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest

from verify.judge.candidates import Candidate
from verify.model.case import Case
from verify.model.profile import get_profile
from verify.run.runner import RunOptions, certify_op, replay
from verify.ops.registry import get_op
from verify.plan.scope import ScopeError, declared_params
from verify.model.verdict import FAIL, PASS

ROOT = Path(__file__).resolve().parent.parent
UK = "property_tests.user_kernels"
DECLARED = f"{UK}.kda_fixed_eps:kda_decode"
UNDECLARED = f"{UK}.kda_fixed_eps_undeclared:kda_decode"


def test_a_declared_parameter_is_pinned_and_named_in_the_verdict():
    seen = []
    v = certify_op(get_op("kda_decode"), Candidate(DECLARED),
                   RunOptions(profile=get_profile("quick"), on_case=lambda c: seen.append(c.case)))
    assert v.status == PASS, v.reason
    assert v.scope == (f"scope: l2_eps = 1e-06 only ({UK}.kda_fixed_eps declares PARAMS)",)
    assert "scope: l2_eps = 1e-06 only" in v.reason
    assert seen and all(("l2_eps", 1e-6) in Case.from_json(c).extra for c in seen)


def test_without_the_declaration_the_same_kernel_fails_where_l2_eps_matters():
    """Rows of tiny k (small_rows) at l2_eps = 1e-5: the eps is a visible part of the norm."""
    case = Case("kda_decode", 0, 4, "tiny", "bfloat16", "small_rows", extra=(("l2_eps", 1e-5),))
    v = replay(get_op("kda_decode"), case, Candidate(UNDECLARED), "cpu")
    assert v.status == FAIL and v.stage == "compare:y", v.reason
    ok = replay(get_op("kda_decode"), Case(**{**case.__dict__, "extra": (("l2_eps", 1e-6),)}), Candidate(UNDECLARED), "cpu")
    assert ok.status == PASS, ok.reason


def test_a_declaration_the_op_cannot_honour_is_refused(tmp_path, monkeypatch):
    mod = tmp_path / "bad_scope_mod.py"
    mod.write_text("PARAMS = {'l2_epsilon': (1e-6,)}\n\ndef kda_decode(**kw):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import bad_scope_mod

    with pytest.raises(ScopeError, match="names 'l2_epsilon', which op kda_decode does not take"):
        declared_params(get_op("kda_decode"), bad_scope_mod.kda_decode, get_profile("quick"))


def test_check_full_scope_refuses_a_scoped_verdict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}

    def cli(*a):
        return subprocess.run([sys.executable, "-m", "verify.cli", *a], cwd=ROOT, capture_output=True, text=True,
                              env=env, timeout=600)

    run = cli("run", "--ops", "kda_decode", "--candidate", DECLARED, "--no-isolate", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "1 certified (1 only in a declared scope)" in run.stdout
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert cert["ops"]["kda_decode"]["verdicts"][DECLARED]["scope"]
    path = str(tmp_path / "certificate.json")
    assert cli("check", path, "--ops", "kda_decode", "--candidate", DECLARED).returncode == 0
    full = cli("check", path, "--ops", "kda_decode", "--candidate", DECLARED, "--full-scope")
    assert full.returncode == 1 and "partial_scope" in full.stdout and "l2_eps = 1e-06 only" in full.stdout, full.stdout


def test_a_seed_drawn_parameter_is_named_with_the_failure():
    """l2_eps is drawn from the seed (the case's JSON does not show it): a kernel that bakes in the
    config's 1e-6 fails the case that draws 1e-5 even on normal rows (its state errs one way: the
    bias check), passes the same case pinned to 1e-6, and the report prints the value it ran with.
    fla-core's KDA kernel, which fixes its eps the same way, failed this case on the H200."""
    import io

    from rich.console import Console

    from verify.judge.pipeline import evaluate_case
    from verify.record.reporters.terminal import print_case

    fn = Candidate(DECLARED).resolve(get_op("kda_decode"), "cpu")
    drawn = Case.from_json('{"batch":1,"config":"tiny","dist":"normal","dtype":"bfloat16","extra":[],'
                           '"op":"kda_decode","seed":6802,"tp":1}')
    v = evaluate_case(get_op("kda_decode"), drawn, fn, "user.module:fn")
    assert v.status == FAIL and v.stage == "bias:state", (v.status, v.stage, v.reason)
    out = io.StringIO()
    print_case(Console(file=out, width=300), v)
    assert "params: lower_bound=-8, l2_eps=1e-05, norm_eps=1e-06" in out.getvalue(), out.getvalue()
    pinned = replace(drawn, extra=(("l2_eps", 1e-6),))
    assert evaluate_case(get_op("kda_decode"), pinned, fn, "user.module:fn").status == PASS
