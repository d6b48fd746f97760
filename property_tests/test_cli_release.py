"""The CLI's interface is pinned: --help texts match the files in planted_release/help (regenerate them
deliberately with `COLUMNS=100 python -m verify.cli [COMMAND] --help`), and bad usage exits 2 with one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HELP = ROOT / "property_tests" / "planted_release" / "help"


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "100", **env}, timeout=120)


@pytest.mark.parametrize("command", ["top", "run", "merge", "report", "diff", "check", "bench", "spec-decode"])
def test_help_is_pinned(command):
    got = _cli(*([] if command == "top" else [command]), "--help")
    assert got.returncode == 0
    assert got.stdout == (HELP / f"{command}.txt").read_text(), \
        f"`verify-kernels {command} --help` changed; if deliberate, regenerate {HELP / (command + '.txt')}"


@pytest.mark.parametrize("args, words", [
    (["run", "--profile", "nope"], "--profile 'nope' is unknown"),
    (["run", "--ops", "no_such_op"], "unknown op 'no_such_op'"),
    (["run", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "--case-timeout", "0"], "--case-timeout 0"),
    (["run", "--examples", "0"], "--examples 0: must be 1 or more"),
    (["run", "--examples", "-1"], "--examples -1: must be 1 or more"),
    (["run", "--tp", "3"], "--tp 3"),
    (["run", "--changed-since", "/nonexistent/cert.json"], "--changed-since: certificate /nonexistent/cert.json"),
    (["run", "--distributed", "gloo", "--sanitize", "memcheck"], "cannot be combined"),
    (["run", "--candidate", "nomodule_xyz:fn"], "--candidate"),
    (["diff", "/nonexistent/a.json", "/nonexistent/b.json"], "cannot read it"),
    (["report", "/nonexistent/a.json"], "cannot read it"),
    (["repro", '{"op": "mla_cache_write", "seed": 1, "batch": 2, "config": "huge"}'], "CASE config: 'huge' is not one of"),
    (["repro", '{"op": "mla_cache_write", "seed": 1, "batch": 2, "dtype": "int8"}'], "CASE dtype: 'int8'"),
    (["repro", '{"op": "mla_cache_write", "seed": 1, "batch": 2, "dist": "weird"}'], "CASE dist: 'weird'"),
    (["repro", '{"op": "mla_cache_write", "seed": 1, "batch": 0}'], "CASE batch: 0"),
    (["repro", '{"op": "mla_cache_write", "seed": "x", "batch": 2}'], "CASE seed: 'x' is not an integer"),
    (["repro", '{"op": "mla_cache_write", "seed": 1, "batch": 2, "tp": 3}'], "CASE tp: 3"),
    (["repro", '{"op": "attn_res_rmsnorm", "seed": 1, "batch": 2, "extra": [["n_blokcs", 3]]}'],
     "CASE extra: ['n_blokcs'] not read"),
    (["repro", '{"op": "mla_cache_write", "seed": 1}'], "CASE is not a case record"),
    # each of these once gave a traceback
    (["run", "--case-timeout", "nan"], "--case-timeout nan"),
    (["run", "--case-timeout", "inf"], "--case-timeout inf"),
    (["run", "--tp", "x"], "--tp 'x': not an integer"),
    (["run", "--ops", ","], "--ops ',': names nothing"),
    (["run", "--candidate", ","], "--candidate ',': names nothing"),
    (["run", "--configs", ","], "--configs ',': names nothing"),
    (["run", "--seed", "99999999999999999999999"], "--seed 99999999999999999999999: must be in"),
    (["run", "--out", "README.md"], "--out README.md: exists and is not a directory"),
    (["run", "--junit", "property_tests"], "--junit property_tests: is a directory"),
    (["repro", "[]"], "CASE is not a case record"),
    (["repro", '{"op": 5, "seed": 1, "batch": 2}'], "CASE op: 5 is not an op name"),
    (["repro", '{"op": "mla_cache_write", "seed": 99999999999999999999999, "batch": 2}'], "CASE seed"),
    (["check", "property_tests/planted_release/help/run.txt"], "cannot read it"),
    (["check", "pyproject.toml"], "cannot read it"),
    (["spec-decode", "--design", "no_such_design"], "--design 'no_such_design' is unknown"),
    (["spec-decode", "--design", "nomodule_xyz:make"], "--design 'nomodule_xyz:make'"),
])
def test_bad_usage_exits_2_with_one_line(args, words):
    got = _cli(*args)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], got.stderr


def test_sanitize_without_sanitizer_or_gpu_says_so():
    from verify.run.sanitize import unavailable_reason

    why = unavailable_reason()
    if why is None:
        pytest.skip("compute-sanitizer and a GPU are present")
    got = _cli("run", "--sanitize", "memcheck", "--ops", "mla_qkv_a")
    assert got.returncode == 2 and why in got.stderr


def test_sanitizer_report_is_parsed():
    from verify.run.sanitize import parse_report

    text = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at kernel_cutlass_rmsnorm+0x1f0
=========     by thread (32,0,0) in block (3,0,0)
========= Invalid __global__ write of size 4 bytes
========= ERROR SUMMARY: 2 errors"""
    assert parse_report(text) == (2, ["Invalid __global__ write of size 4 bytes"])
    assert parse_report("========= ERROR SUMMARY: 0 errors") == (0, [])
    assert parse_report("========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)")[0] == 3


def test_repro_accepts_a_knob_the_op_reads():
    """The unread-knob check must not refuse the knobs an op does read (attn_res_rmsnorm's n_blocks)."""
    got = _cli("repro", '{"op": "attn_res_rmsnorm", "seed": 1, "batch": 2, "config": "tiny", "extra": [["n_blocks", 3]]}')
    assert got.returncode == 0, got.stdout + got.stderr
    assert "n_blocks" in got.stdout


def test_resume_from_a_foreign_log_is_one_line(tmp_path):
    """--resume over a run.jsonl whose lines are not log records: one line naming it (not an
    AttributeError from inside the log reader)."""
    (tmp_path / "run.jsonl").write_text("[]\n")
    got = _cli("run", "--ops", "skinny_gemm", "--candidate", "reference", "--device", "cpu", "--examples", "1",
               "--configs", "tiny", "--out", str(tmp_path), "--resume")
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2 and len(lines) == 1 and "not a log record" in lines[0], got.stderr
