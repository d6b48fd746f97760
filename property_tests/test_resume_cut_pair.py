"""`run --resume` continues a cut op/candidate pair case by case: the cases a killed run logged replay
from certify_op's memo (hypothesis draws the same cases for the same seed, in another process too),
only the rest are evaluated, and the certificate equals a run done in one go. CPU only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from verify.record import certificate  # noqa: E402
from verify.run import runner as certify  # noqa: E402
from verify.cli import EXIT_USAGE, main  # noqa: E402

OP = "attn_res_rmsnorm"      # fast on a CPU, compared by tolerance (ratios), one vacuous draw at seed 4 (seed 3 had one before small_rows joined the dists)
BUG = "property_tests.planted.attn_res:attn_res_rmsnorm_keys_unnormalised"     # fails the first drawn case
LATE_BUG = "property_tests.test_resume_cut_pair:attn_res_rmsnorm_wrong_past_batch_4"   # fails later, shrinks


def attn_res_rmsnorm_wrong_past_batch_4(**kw):
    """Right for batches up to 4, 1% off beyond (a bug past a tile boundary): a failure that shrinks."""
    from references.attn_res import attn_res_rmsnorm

    out = attn_res_rmsnorm(**kw)
    return out * 1.01 if out.shape[0] > 4 else out
def _run_args(seed: int) -> list[str]:
    return ["run", "--ops", OP, "--device", "cpu", "--profile", "ci", "--examples", "12", "--seed", str(seed),
            "--no-isolate"]


RUN = _run_args(4)

# The cut: the process dies right after the k-th case line, as when a device call's time limit kills it.
CUT = """import os, sys
from verify.run import runlog
k, written, write_case = int(sys.argv[1]), [0], runlog.RunLog.case
def case_then_cut(self, v):
    write_case(self, v)
    written[0] += 1
    if written[0] == k:
        os._exit(137)
runlog.RunLog.case = case_then_cut
from verify.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]


def _cut_run(out: Path, k: int, *args: str, run: list[str] = RUN) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}     # another process, another hash order
    got = subprocess.run([sys.executable, "-c", CUT, str(k), *run, *args, "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 137, got.stderr[-2000:]
    lines = _log(out)
    assert sum(r["kind"] == "case" for r in lines) == k and not any(r["kind"] == "op" for r in lines)


def _counting_evaluator(monkeypatch) -> list[str]:
    evaluated = []
    real = certify.safe_evaluate

    def counted(op, case, *a, **kw):
        evaluated.append(case.to_json())
        return real(op, case, *a, **kw)

    monkeypatch.setattr(certify, "safe_evaluate", counted)
    return evaluated


def _entry(out: Path, candidate: str) -> tuple[dict, list[dict]]:
    """The certificate's verdict and case records for the pair, without wall times."""
    entry = certificate.load(out / "certificate.json")["ops"][OP]
    verdict = {k: v for k, v in entry["verdicts"][candidate].items() if k != "seconds"}
    if verdict["failure"]:
        verdict["failure"] = {k: v for k, v in verdict["failure"].items() if k != "seconds"}
    cases = [{k: v for k, v in c.items() if k != "seconds"} for c in entry["cases"][candidate]]
    return verdict, cases


def _resume_and_compare(tmp_path, monkeypatch, candidate: str, k: int | None, rc: int, run: list[str] = RUN) -> list[str]:
    """Cut a run after k cases (None: one case after its first failure), resume it, and check it
    against a run done in one go. Returns the cases the resumed run evaluated."""
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    assert main(run + ["--candidate", candidate, "--out", str(whole)]) == rc
    if k is None:
        statuses = [r["record"]["status"] for r in _log(whole) if r["kind"] == "case"]
        k = statuses.index("fail") + 2
        assert k < len(statuses), "the one-go run must shrink its failure"
    _cut_run(cut, k, "--candidate", candidate, run=run)
    before = _log(cut)
    counted = _counting_evaluator(monkeypatch)
    assert main(run + ["--candidate", candidate, "--resume", "--out", str(cut)]) == rc
    evaluated = list(counted)
    after = _log(cut)
    assert after[:len(before)] == before                                   # appended, nothing lost
    logged_before = [r["case"] for r in before if r["kind"] == "case"]
    logged_now = [r["case"] for r in after[len(before):] if r["kind"] == "case"]
    assert logged_now == evaluated                 # every evaluation logged once, nothing replayed is logged
    assert not set(evaluated) & set(logged_before), "a case judged before the cut was evaluated again"
    resumed_verdict, resumed_cases = _entry(cut, candidate)
    whole_verdict, whole_cases = _entry(whole, candidate)
    assert resumed_cases == whole_cases                                    # same cases, same order
    assert resumed_verdict == whole_verdict                                # same counts, ratios, verdict
    assert resumed_verdict["cases_run"] == len(logged_before) + len(evaluated)
    return evaluated


def test_a_cut_pair_resumes_case_by_case(tmp_path, monkeypatch):
    # seed 7: a draw with a vacuous case among its first 12 (replayed as vacuous, not as judged)
    evaluated = _resume_and_compare(tmp_path, monkeypatch, "reference", k=5, rc=0, run=_run_args(7))
    verdict, cases = _entry(tmp_path / "cut", "reference")
    assert verdict["status"] == "pass" and verdict["worst_ratio"]
    assert len(evaluated) == verdict["cases_run"] - 5 > 0
    assert any(c["status"] == "vacuous" for c in cases)


def test_a_failed_case_before_the_cut_still_fails_the_pair(tmp_path, monkeypatch):
    # the cut lands in the shrink phase, one case after the first failure; the resumed run finishes it
    evaluated = _resume_and_compare(tmp_path, monkeypatch, LATE_BUG, k=None, rc=1)
    verdict, _ = _entry(tmp_path / "cut", LATE_BUG)
    assert verdict["status"] == "fail" and verdict["failure"]["stage"] == "compare:out"
    assert json.loads(verdict["failure"]["case"])["batch"] == 5          # shrunk to the boundary
    assert evaluated, "shrinking went on past the cut: shrunk cases not in the log are evaluated"


def test_a_failed_case_before_the_cut_fails_without_evaluating_again(tmp_path, monkeypatch):
    from verify.judge.candidates import Candidate
    from verify.model.profile import PROFILES
    from verify.ops.registry import get_op
    from verify.run.runlog import read

    _cut_run(tmp_path, 1, "--candidate", BUG, "--profile", "quick")   # no shrinking: the failure is final
    judged = read(tmp_path / "run.jsonl").partial[(OP, BUG)]
    assert [v.status for v in judged] == ["fail"]
    evaluated = _counting_evaluator(monkeypatch)
    v = certify.certify_op(get_op(OP), Candidate(BUG),
                           certify.RunOptions(profile=PROFILES["quick"], seed=3, examples=12), judged)
    assert evaluated == []
    assert v.status == "fail" and v.failure == judged[0] and v.cases_run == 1 and v.cases_passed == 0


@pytest.mark.parametrize("flag, value, words", [
    ("--seed", "5", "seed 4 -> 5"),
    ("--examples", "13", "examples 12 -> 13"),
    ("--profile", "release", "profile ci -> release"),
    ("--dtypes", "bfloat16", "dtypes default -> bfloat16"),
])
def test_resume_refuses_a_log_written_with_other_settings(tmp_path, capsys, flag, value, words):
    _cut_run(tmp_path, 2, "--candidate", "reference")
    before = (tmp_path / "run.jsonl").read_text()
    argv = RUN + ["--candidate", "reference", "--resume", "--out", str(tmp_path)]
    argv = argv[:argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2:] if flag in argv else argv + [flag, value]
    assert main(argv) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--resume:" in lines[0] and words in lines[0] and "without --resume" in lines[0]
    assert (tmp_path / "run.jsonl").read_text() == before                 # the log is left as it was


def test_resume_refuses_a_log_judged_by_another_harness(tmp_path, capsys, monkeypatch):
    """Cases judged by another version of the guards and comparison are not mixed into one
    certificate with cases judged by this one."""
    from verify.record import certificate

    _cut_run(tmp_path, 2, "--candidate", "reference")
    monkeypatch.setattr(certificate, "harness_hash", lambda: "1" * 64)
    assert main(RUN + ["--candidate", "reference", "--resume", "--out", str(tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--resume:" in err and "harness" in err
