"""run --jobs N: up to N ops at once, one child run each, one merged certificate equal to a serial
run's; a child that dies fails only its op's unfinished pairs, naming its status and log; bad
combinations refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = "mxfp4_dequant,mla_cache_write,router_topk,skinny_gemm"


def _cli(args, tmp_path, extra_path=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), extra_path,
                                                                  os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "verify.cli", "run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def _pairs(cert: dict) -> dict:
    return {(op, cand): (v["status"], v["cases_run"], v["cases_passed"],
                         [(c["seed"], c["batch"], c["config"], c["dtype"], c["status"]) for c in e["cases"][cand]])
            for op, e in cert["ops"].items() for cand, v in e["verdicts"].items()}


def test_jobs_merge_equals_a_serial_run(tmp_path):
    common = ["--ops", OPS, "--candidate", "reference", "--profile", "quick", "--no-isolate"]
    serial = _cli(common + ["--out", "serial"], tmp_path)
    par = _cli(common + ["--out", "par", "--jobs", "3"], tmp_path)
    assert serial.returncode == 0 and par.returncode == 0, par.stdout + par.stderr
    a = json.loads((tmp_path / "serial" / "certificate.json").read_text())
    b = json.loads((tmp_path / "par" / "certificate.json").read_text())
    assert _pairs(a) == _pairs(b) and len(_pairs(b)) == 4
    assert b["options"]["jobs"] == 3
    assert sorted(p.name for p in (tmp_path / "par" / "jobs").iterdir()) == sorted(
        [op for op in OPS.split(",")] + [f"{op}.log" for op in OPS.split(",")])


def test_a_dying_job_fails_only_its_unfinished_pairs(tmp_path):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "vk_dies.py").write_text(
        "import os\n"
        "def dequant(packed, scale, out_dtype='bfloat16'):\n"
        "    os._exit(3)\n")
    r = _cli(["--ops", "mxfp4_dequant,mla_cache_write", "--candidate", "vk_dies:dequant", "--profile", "quick",
              "--no-isolate", "--jobs", "2", "--out", "out"], tmp_path, extra_path=str(mod))
    assert r.returncode == 1, r.stdout + r.stderr
    cert = json.loads((tmp_path / "out" / "certificate.json").read_text())
    dq = cert["ops"]["mxfp4_dequant"]["verdicts"]["vk_dies:dequant"]
    assert dq["status"] == "fail" and "exited with status 3" in dq["reason"] and "jobs/mxfp4_dequant.log" in dq["reason"]
    # the other child ran its op to a verdict of its own (this candidate has mxfp4_dequant's signature,
    # so mla_cache_write's cases make it raise: a candidate failure, not a dead child)
    cw = cert["ops"]["mla_cache_write"]["verdicts"]["vk_dies:dequant"]
    assert cw["status"] == "fail" and "exited" not in cw["reason"], cw["reason"]
    assert "mxfp4_dequant: its child exited with status 3" in r.stdout


def test_jobs_refused_in_bad_combinations(tmp_path):
    assert _cli(["--jobs", "0", "--ops", "mxfp4_dequant"], tmp_path).returncode == 2
    r = _cli(["--jobs", "2", "--distributed", "gloo", "--ops", "mxfp4_dequant"], tmp_path)
    assert r.returncode == 2 and "--jobs and --distributed cannot be combined" in r.stderr


def test_jobs_with_changed_since_carry_the_unchanged_ops(tmp_path):
    common = ["--ops", "mxfp4_dequant,mla_cache_write", "--candidate", "reference", "--profile", "quick",
              "--no-isolate"]
    assert _cli(common + ["--out", "base"], tmp_path).returncode == 0
    r = _cli(common + ["--out", "again", "--jobs", "2", "--changed-since", "base/certificate.json"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    cert = json.loads((tmp_path / "again" / "certificate.json").read_text())
    assert set(cert["ops"]) == {"mxfp4_dequant", "mla_cache_write"}
    assert all("carried_from" in v for e in cert["ops"].values() for v in e["verdicts"].values())


def test_children_share_the_cores(tmp_path, monkeypatch):
    """Each child's CPU thread pools get cores // jobs threads (unset, 16 torch children on a 32-core
    host each start 32 OpenMP threads); a value the user set passes through unchanged."""
    from verify.run import pool as parallel
    for v in parallel.THREAD_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    assert parallel.child_threads(16) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert parallel.child_threads(48) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert parallel.child_threads(16) == {}
    monkeypatch.undo()

    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "vk_threads.py").write_text(
        "import os, torch\n"
        "from references.mxfp4 import mxfp4_dequant\n"
        "def dequant(packed, scale, out_dtype='bfloat16'):\n"
        "    with open(os.environ['VK_THREADS_LOG'], 'a') as f:\n"
        "        f.write(f\"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()}\\n\")\n"
        "    return mxfp4_dequant(packed, scale, out_dtype)\n")
    log = tmp_path / "threads.log"
    env = {k: v for k, v in os.environ.items() if k not in parallel.THREAD_VARS}
    env.update(VK_THREADS_LOG=str(log), PYTHONPATH=os.pathsep.join([str(ROOT), str(mod)]))
    r = subprocess.run([sys.executable, "-m", "verify.cli", "run", "--ops", "mxfp4_dequant,mla_cache_write",
                        "--candidate", "vk_threads:dequant", "--profile", "quick", "--examples", "2",
                        "--no-isolate", "--jobs", "2", "--out", "out"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    want = str(max(1, len(os.sched_getaffinity(0)) // 2))
    seen = set(log.read_text().split("\n")) - {""}
    assert seen == {f"{want} {want}"}, seen
