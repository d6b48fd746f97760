"""run --jobs N --shards K: an op's drawn cases judged by K children at once, then replayed by the
op's own child; the same certificate as a serial run, failures still found, shrunk and reported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verify.candidates import Candidate
from verify.case import Case
from verify.cases import get_profile
from verify.certify import RunOptions, certify_op, draw_cases
from verify.registry import get_op
from verify.verdict import FAIL, CaseVerdict

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


def test_shards_need_jobs(tmp_path):
    r = _cli(["--ops", "skinny_gemm", "--candidate", "reference", "--shards", "3", "--out", "x"], tmp_path)
    assert r.returncode == 2 and "--shards 3: needs" in r.stderr


def test_sharded_run_resumes_after_a_cut(tmp_path):
    """Cut after the shards (the op's own child never ran) and inside one shard (its last case line
    lost): --resume judges only that case again and finishes the op with the same cases."""
    common = ["--ops", "skinny_gemm", "--candidate", "reference", "--profile", "ci", "--examples", "8",
              "--no-isolate", "--jobs", "2", "--shards", "2", "--out", "sh"]
    assert _cli(common, tmp_path).returncode == 0
    first = json.loads((tmp_path / "sh" / "certificate.json").read_text())
    jobs = tmp_path / "sh" / "jobs"
    (jobs / "skinny_gemm" / "run.jsonl").unlink()
    shard_log = jobs / "skinny_gemm.shard1" / "run.jsonl"
    lines = shard_log.read_text().splitlines()
    shard_log.write_text("\n".join(lines[:-1]) + "\n")
    again = _cli(common + ["--resume"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "judged 1 listed cases" in (jobs / "skinny_gemm.shard1.log").read_text()
    assert "judged 0 listed cases" in (jobs / "skinny_gemm.shard0.log").read_text()
    second = json.loads((tmp_path / "sh" / "certificate.json").read_text())
    assert _cases(first, "skinny_gemm", "reference") == _cases(second, "skinny_gemm", "reference")
