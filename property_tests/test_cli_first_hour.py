"""A new user's first hour with the CLI: what the run says and what it exits with, a usage error in one
line, a pipe closed early, Ctrl-C, progress in a CI log, fast answers from `list` / `describe`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UK = "property_tests.user_kernels"


def _cli(*args, cwd=ROOT, timeout=600, **env):
    e = {**os.environ, "COLUMNS": "100", **env}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=e, timeout=timeout)


def test_a_wrong_kernel_skipped_by_its_dtype_scope_is_not_a_success_and_check_agrees(tmp_path):
    cand = f"{UK}.gemm_fp16_only_wrong:skinny_gemm"
    run = _cli("run", "--ops", "skinny_gemm", "--candidate", cand, "--no-isolate", "--out", str(tmp_path))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "0 certified, 1 skipped, 0 failed" in run.stdout
    assert "no certified candidate (every one skipped): skinny_gemm" in run.stdout
    check = _cli("check", str(tmp_path / "certificate.json"), "--ops", "skinny_gemm", "--candidate", cand)
    assert check.returncode == 1, check.stdout + check.stderr


def test_summary_counts_certified_skipped_and_failed_apart(tmp_path):
    run = _cli("run", "--ops", "skinny_gemm,mxfp4_dequant", "--candidate", f"reference,fused,{UK}.gemm_ok:skinny_gemm",
               "--no-isolate", "--out", str(tmp_path), "--examples", "2", "--device", "cpu")
    # reference: 2 certified; fused: 2 skipped (no CUDA); the gemm module: skinny_gemm certified, and
    # mxfp4_dequant failed (a GEMM is not a dequant: it raises)
    assert "3 certified, 2 skipped, 1 failed op/candidate pairs; failed: mxfp4_dequant" in run.stdout, run.stdout
    assert run.returncode == 1


def test_a_candidate_in_an_imported_module_that_is_not_a_kernel_is_a_one_line_usage_error():
    for cand, words in (("os:path", "'os:path' is not callable"), ("os:no_such_fn", "has no attribute 'no_such_fn'")):
        got = _cli("run", "--candidate", cand, "--ops", "skinny_gemm", "--no-isolate", "--out", "/tmp/vk-usage")
        assert got.returncode == 2, got.stderr
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "--candidate" in lines[0], got.stderr


def test_list_into_a_closed_pipe_ends_quietly():
    """`verify-kernels list | head -3`: the reader is gone before the listing is written (its end of the
    pipe is closed first, so the write always fails): no BrokenPipeError traceback, SIGPIPE's status."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "verify.cli", "list"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == "", err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_keeps_the_results_and_names_the_resume_command(tmp_path, sig):
    """Ctrl-C (SIGINT) or a scheduler's stop (SIGTERM, as `timeout` sends it, to the process group): exit
    130, the judged cases kept, the resume command named, and a certificate of what was judged in which
    the unfinished pair fails as incomplete."""
    import signal
    import time

    # the default isolated run; Ctrl-C as a terminal sends it: SIGINT to the whole process group
    cmd = [sys.executable, "-m", "verify.cli", "run", "--ops", "kda_layer", "--candidate", "reference",
           "--examples", "200", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored:
    # the suite run with `&` or nohup would hand that to the CLI, which then never sees the ^C. A
    # terminal's foreground job has the default disposition; give the CLI that.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = tmp_path / "run.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (log.exists() and '"kind":"case"' in log.read_text()):
        time.sleep(0.05)
    os.killpg(proc.pid, getattr(signal, sig))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert "--resume" in err and str(log) in err
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert any(x["kind"] == "case" for x in lines)                  # what was judged is kept
    assert all(x["record"]["status"] == "pass" for x in lines if x["kind"] == "case"), lines   # no case judged by the ^C
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert cert["options"]["interrupted"] is True
    verdict = cert["ops"]["kda_layer"]["verdicts"]["reference"]
    judged = sum(x["kind"] == "case" for x in lines)
    assert verdict["status"] == "fail" and verdict["reason"].startswith("incomplete: "), verdict["reason"]
    assert verdict["cases_run"] == judged


def test_a_redirected_run_prints_progress_lines(tmp_path):
    run = _cli("run", "--ops", "skinny_gemm", "--candidate", "reference", "--no-isolate", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[0].startswith("plan "), run.stdout[:300]     # the plan is written first
    lines = [x for x in run.stdout.splitlines() if x.startswith("[")]
    assert lines[0] == "[1/1] skinny_gemm / reference: started", lines[:3]
    assert any(x.startswith("[1/1] skinny_gemm / reference: ") and "cases judged, 0 failed" in x and x.endswith(": pass")
               for x in lines), lines


def test_progress_lines_come_at_most_every_interval():
    import io

    from rich.console import Console

    from verify.run.progress import RunProgress
    from verify.model.verdict import FAIL, PASS, CaseVerdict

    buf = io.StringIO()
    with RunProgress(Console(file=buf, width=200), 2, interval_s=0.0) as p:    # every case
        p.start("skinny_gemm", "mine")
        for status in (PASS, FAIL, PASS):
            p.case(CaseVerdict("skinny_gemm", "mine", "", status))
    lines = buf.getvalue().splitlines()
    assert lines[-1].startswith("[1/2] skinny_gemm / mine: 3 cases judged, 1 failed"), lines
    buf = io.StringIO()
    with RunProgress(Console(file=buf, width=200), 1, interval_s=3600.0) as p:
        p.start("skinny_gemm", "mine")
        for _ in range(50):
            p.case(CaseVerdict("skinny_gemm", "mine", "", PASS))
    assert len(buf.getvalue().splitlines()) == 1, buf.getvalue()      # "started", then nothing within the hour


def test_quick_shrinks_a_failure_to_the_smallest_case(tmp_path):
    run = _cli("run", "--ops", "skinny_gemm", "--candidate", f"{UK}.gemm_ok:skinny_gemm_drops_k_tail", "--no-isolate",
               "--out", str(tmp_path))
    assert run.returncode == 1
    cert = json.loads((tmp_path / "certificate.json").read_text())
    case = json.loads(cert["ops"]["skinny_gemm"]["verdicts"][f"{UK}.gemm_ok:skinny_gemm_drops_k_tail"]["failure"]["case"])
    assert (case["seed"], case["batch"], case["config"], case["tp"]) == (0, 1, "tiny", 1), case


def test_list_describe_and_help_do_not_import_torch():
    code = ("import contextlib, io, sys\n"
            "from verify import cli\n"
            "for argv in (['list'], ['list', '--json'], ['describe', 'kda_decode'], ['describe', 'mla_layer', '--json']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        assert cli.main(argv) == 0, argv\n"
            "try:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        cli.main(['run', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'hypothesis', 'cutlass'))))\n")
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]", got.stdout


def test_describe_is_readable_and_json_keeps_the_whole_spec():
    text = _cli("describe", "skinny_gemm").stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100 and len(lines) > 15, max(map(len, lines))
    assert "  derivation:" in lines and any(x.strip().startswith("Element rule (element_floor):") for x in lines)
    blob = json.loads(_cli("describe", "skinny_gemm", "--json").stdout)
    assert blob["spec"]["outputs"]["y"]["class"] == "derived" and len(blob["spec"]["derivation"]) > 2000
    assert blob["signature"].startswith("x[M,K]")


def test_the_console_script_imports_a_candidate_from_the_working_directory(tmp_path):
    """The repro lines name modules of the user's tree (`property_tests.planted...`, `mykernels:gemm`)
    and are pasted where the run was made: the installed `verify-kernels` must find them there, as
    `python -m verify.cli` does."""
    import shutil

    exe = shutil.which("verify-kernels") or str(Path(sys.executable).parent / "verify-kernels")
    assert Path(exe).exists(), "the verify-kernels console script is not installed (pip install -e .)"
    (tmp_path / "mykernels_cwd.py").write_text(
        "from references.gemm import skinny_gemm as _ref\n\ndef gemm(x, w):\n    return _ref(x, w)\n")
    case = ('{"batch":3,"config":"tiny","dist":"normal","dtype":"bfloat16","extra":[],"op":"skinny_gemm",'
            '"seed":1,"tp":1}')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([exe, "repro", case, "--candidate", "mykernels_cwd:gemm", "--device", "cpu"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "status: pass" in got.stdout, got.stdout
