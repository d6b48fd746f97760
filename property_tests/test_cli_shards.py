"""run --jobs N --shards K: an op's drawn cases judged by K children at once, then replayed by the
op's own child; the same certificate as a serial run, failures still found, shrunk and reported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from verify.candidates import Candidate
from verify.case import Case
from verify.cases import get_profile
from verify.certify import RunOptions, certify_op, draw_cases
from verify.registry import get_op
from verify.verdict import FAIL, VACUOUS, CaseVerdict

ROOT = Path(__file__).resolve().parent.parent


def _cli(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "verify.cli", "run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)


def _cases(cert: dict, op: str, cand: str) -> list:
    return sorted((c["seed"], c["batch"], c["config"], c["dtype"], c["dist"], c["tp"], c["status"])
                  for c in cert["ops"][op]["cases"][cand])


def test_sharded_run_equals_a_serial_run(tmp_path):
    common = ["--ops", "skinny_gemm,mla_cache_write", "--candidate", "reference", "--profile", "ci",
              "--examples", "10", "--no-isolate"]
    serial = _cli(common + ["--out", "serial"], tmp_path)
    shard = _cli(common + ["--out", "sh", "--jobs", "2", "--shards", "3"], tmp_path)
    assert serial.returncode == 0 and shard.returncode == 0, shard.stdout + shard.stderr
    a = json.loads((tmp_path / "serial" / "certificate.json").read_text())
    b = json.loads((tmp_path / "sh" / "certificate.json").read_text())
    for op in ("skinny_gemm", "mla_cache_write"):
        assert _cases(a, op, "reference") == _cases(b, op, "reference")
        va, vb = a["ops"][op]["verdicts"]["reference"], b["ops"][op]["verdicts"]["reference"]
        assert (va["status"], va["cases_run"], va["worst_ratio"]) == (vb["status"], vb["cases_run"], vb["worst_ratio"])
    jobs = tmp_path / "sh" / "jobs"
    assert {p.name for p in jobs.iterdir() if p.is_dir()} >= {"skinny_gemm.shard0", "skinny_gemm.shard2", "skinny_gemm"}
    assert "judged" in (jobs / "skinny_gemm.shard1.log").read_text()
    assert b["options"]["shards"] == 3


def test_sharded_worst_ratio_is_the_worst_launch_variants(tmp_path):
    """A case judges every launch variant a candidate declares; the sharded run's certificate reports
    the worst variant's err / tol, as the serial run does (the case log line once kept only the last
    variant's ratio, so the sharded certificate under-reported)."""
    cand = "property_tests.planted_release.gemm_variants:skinny_gemm"
    common = ["--ops", "skinny_gemm", "--candidate", cand, "--profile", "ci", "--examples", "8", "--no-isolate"]
    serial = _cli(common + ["--out", "serial"], tmp_path)
    shard = _cli(common + ["--out", "sh", "--jobs", "2", "--shards", "2"], tmp_path)
    assert serial.returncode == 0 and shard.returncode == 0, shard.stdout + shard.stderr
    va = json.loads((tmp_path / "serial" / "certificate.json").read_text())["ops"]["skinny_gemm"]["verdicts"][cand]
    vb = json.loads((tmp_path / "sh" / "certificate.json").read_text())["ops"]["skinny_gemm"]["verdicts"][cand]
    assert va["status"] == vb["status"] == "pass"
    assert va["worst_ratio"] == vb["worst_ratio"] and va["worst_ratio"]["y"] > 0
    exact = _cli(["--ops", "skinny_gemm", "--candidate", cand.replace("skinny_gemm", "exact_only"), "--profile",
                  "ci", "--examples", "8", "--no-isolate", "--out", "ex"], tmp_path)
    assert exact.returncode == 0, exact.stdout + exact.stderr
    ve = json.loads((tmp_path / "ex" / "certificate.json").read_text())["ops"]["skinny_gemm"]["verdicts"]
    assert vb["worst_ratio"]["y"] > next(iter(ve.values()))["worst_ratio"]["y"]    # the "toward_zero" variant's


def test_sharded_run_finds_shrinks_and_reports_a_planted_bug(tmp_path):
    cand = "property_tests.planted.gemm:skinny_gemm_unwritten_tail"
    common = ["--ops", "skinny_gemm", "--candidate", cand, "--examples", "6", "--no-isolate"]
    serial = _cli(common + ["--out", "serial"], tmp_path)
    shard = _cli(common + ["--out", "sh", "--jobs", "2", "--shards", "2"], tmp_path)
    assert serial.returncode == 1 and shard.returncode == 1, shard.stdout + shard.stderr
    a = json.loads((tmp_path / "serial" / "certificate.json").read_text())["ops"]["skinny_gemm"]["verdicts"][cand]
    b = json.loads((tmp_path / "sh" / "certificate.json").read_text())["ops"]["skinny_gemm"]["verdicts"][cand]
    assert b["status"] == "fail" and b["reason"].startswith("guard:outputs_written")
    assert b["reason"] == a["reason"] and b["repro"] == a["repro"]         # the same shrunk case


def test_a_judged_failure_outside_the_draw_fails_the_op():
    """A case a shard judged that this draw sequence never reaches (the dry draw went another way
    after a vacuous case) is still a failure of the op."""
    op = get_op("skinny_gemm")
    opts = RunOptions(device="cpu", profile=get_profile("quick"), examples=3)
    drawn = draw_cases(op, Candidate("reference"), opts)
    stray = Case("skinny_gemm", 987654, 3, "tiny", "bfloat16", "normal").to_json()
    assert stray not in drawn
    bad = CaseVerdict("skinny_gemm", "reference", stray, FAIL, "compare:y", "planted: judged by a shard", (), 0.1)
    v = certify_op(op, Candidate("reference"), opts, judged=[bad])
    assert v.status == FAIL and "planted: judged by a shard" in v.reason


def test_the_dry_draw_deals_the_cases_a_real_run_judges():
    """A vacuous case is a draw like a pass, so the shards' dry deal foresees every case a real run
    judges (before this, each vacuous case sent hypothesis down another path and the op's own child
    judged the rest alone: on the H200 kda_decode's finishing child was cut after 450 s)."""
    op = get_op("attn_res_rmsnorm")
    opts = RunOptions(device="cpu", profile=get_profile("ci"), seed=7, examples=12)
    dealt = draw_cases(op, Candidate("reference"), opts)
    judged: list[CaseVerdict] = []
    certify_op(op, Candidate("reference"), replace(opts, on_case=judged.append))
    assert any(v.status == VACUOUS for v in judged[:-1])           # a vacuous case before the last one
    assert [v.case for v in judged] == dealt


def test_an_op_whose_every_case_is_vacuous_fails():
    op = get_op("skinny_gemm")
    opts = RunOptions(device="cpu", profile=get_profile("quick"), examples=3,
                      evaluator=lambda name, case, label, device, strided_run=True: CaseVerdict(
                          name, label, case.to_json(), VACUOUS, "inputs", "planted: oracle all zeros", (), 0.0))
    v = certify_op(op, Candidate("reference"), opts)
    assert v.status == FAIL and "every drawn case was vacuous" in v.reason


def test_shards_need_jobs(tmp_path):
    r = _cli(["--ops", "skinny_gemm", "--candidate", "reference", "--shards", "3", "--out", "x"], tmp_path)
    assert r.returncode == 2 and "--shards 3: needs" in r.stderr


def _cut_after_the_shards(tmp_path):
    """A 2-shard run of skinny_gemm, cut after the shards (the op's own child's log removed):
    (its arguments, its certificate, its jobs/ dir)."""
    common = ["--ops", "skinny_gemm", "--candidate", "reference", "--profile", "ci", "--examples", "8",
              "--no-isolate", "--jobs", "2", "--shards", "2", "--out", "sh"]
    assert _cli(common, tmp_path).returncode == 0
    first = json.loads((tmp_path / "sh" / "certificate.json").read_text())
    jobs = tmp_path / "sh" / "jobs"
    (jobs / "skinny_gemm" / "run.jsonl").unlink()
    return common, first, jobs


def test_sharded_run_resumes_after_a_cut(tmp_path):
    """Cut after the shards (the op's own child never ran) and inside one shard (its last case line
    lost): --resume judges only that case again and finishes the op with the same cases."""
    common, first, jobs = _cut_after_the_shards(tmp_path)
    shard_log = jobs / "skinny_gemm.shard1" / "run.jsonl"
    lines = shard_log.read_text().splitlines()
    shard_log.write_text("\n".join(lines[:-1]) + "\n")
    again = _cli(common + ["--resume"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "judged 1 listed cases" in (jobs / "skinny_gemm.shard1.log").read_text()
    assert "judged 0 listed cases" in (jobs / "skinny_gemm.shard0.log").read_text()
    second = json.loads((tmp_path / "sh" / "certificate.json").read_text())
    assert _cases(first, "skinny_gemm", "reference") == _cases(second, "skinny_gemm", "reference")


_DRAW = """
import json, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "after":
    import many_constants  # noqa: F401  (a local module full of integer constants)
from verify.candidates import Candidate
from verify.cases import get_profile
from verify.certify import RunOptions, draw_cases
from verify.registry import get_op
opts = RunOptions(device="cpu", profile=get_profile("release"), examples=120)
print(json.dumps(draw_cases(get_op("attn_res_rmsnorm"), Candidate("reference"), opts)))
"""


def test_the_draw_does_not_depend_on_the_modules_imported(tmp_path):
    """A seed draws the same cases whatever else the process imported: a sharded run deals from the
    parent's dry draw, the op's own child and a --resume replay draw again in other processes, and a
    certificate's cases must be reproducible from its seed. (Hypothesis mixes constants of every
    non-site-packages module in sys.modules into its draws; on the device the CuTe DSL bundle lies
    outside site-packages.)"""
    (tmp_path / "many_constants.py").write_text(
        "TABLE = (" + ", ".join(str(7919 * i + 104729 * i * i) for i in range(1, 300)) + ")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    draws = [subprocess.run([sys.executable, "-c", _DRAW, str(tmp_path), when], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600) for when in ("before", "after")]
    for d in draws:
        assert d.returncode == 0, d.stderr
    a, b = (json.loads(d.stdout.strip().splitlines()[-1]) for d in draws)
    assert len(a) >= 100 and a == b


def test_a_case_logged_twice_counts_once(tmp_path):
    """Two shards of different deals may both judge a case: reading the log counts it once, and where
    the two verdicts differ the failing one stands."""
    from verify.runlog import RunLog, read

    op = get_op("skinny_gemm")
    opts = RunOptions(device="cpu", profile=get_profile("quick"), examples=3)
    plain = certify_op(op, Candidate("reference"), opts)
    case = draw_cases(op, Candidate("reference"), opts)[0]
    ok = CaseVerdict("skinny_gemm", "reference", case, "pass", "", "", (), 0.1)
    bad = CaseVerdict("skinny_gemm", "reference", case, FAIL, "compare:y", "planted: the second shard's verdict", (), 0.1)

    def logged(*verdicts):
        log = RunLog(tmp_path / str(len(list(tmp_path.iterdir()))))
        for v in verdicts:
            log.case(v)
        log.close()
        return read(log.path)

    twice = logged(ok, ok)
    assert twice.repeated_lines == 1
    v = certify_op(op, Candidate("reference"), opts, judged=twice.partial[("skinny_gemm", "reference")])
    assert (v.status, v.cases_run, v.cases_passed) == (plain.status, plain.cases_run, plain.cases_passed)
    v = certify_op(op, Candidate("reference"), opts, judged=logged(ok, bad).partial[("skinny_gemm", "reference")])
    assert v.status == FAIL and "the second shard's verdict" in v.reason


def test_a_resume_keeps_each_shards_recorded_deal_and_joins_overlaps_once(tmp_path):
    """A cut sharded run resumed: each shard goes on with the cases it was dealt (its recorded list),
    not a fresh deal, so no case is judged again; a case line two shard logs both hold counts once."""
    common, first, jobs = _cut_after_the_shards(tmp_path)
    # an earlier deal that a fresh one would not repeat: the two shards' lists and logs swapped
    for suffix in (".cases.json", ""):
        a, b, t = (jobs / f"skinny_gemm.shard{k}{suffix}" for k in ("0", "1", "x"))
        a.rename(t), b.rename(a), t.rename(b)
    # and one case both shards judged
    log0, log1 = jobs / "skinny_gemm.shard0" / "run.jsonl", jobs / "skinny_gemm.shard1" / "run.jsonl"
    dup = next(line for line in log0.read_text().splitlines() if '"kind":"case"' in line.replace(" ", ""))
    log1.write_text(log1.read_text() + dup + "\n")
    again = _cli(common + ["--resume"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    for k in (0, 1):
        assert "judged 0 listed cases" in (jobs / f"skinny_gemm.shard{k}.log").read_text()
    assert "1 case lines of cases already logged" in (jobs / "skinny_gemm.log").read_text()
    second = json.loads((tmp_path / "sh" / "certificate.json").read_text())
    assert _cases(first, "skinny_gemm", "reference") == _cases(second, "skinny_gemm", "reference")
    v1, v2 = (c["ops"]["skinny_gemm"]["verdicts"]["reference"] for c in (first, second))
    assert v1["cases_run"] == v2["cases_run"]
