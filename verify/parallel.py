"""`run --jobs N`: the selected ops dealt round-robin to N child `verify-kernels run` processes, one
GPU each where several are visible (`CUDA_VISIBLE_DEVICES`), their per-op verdicts and case
records merged into one certificate.

Each child runs the same command with its own `--ops` and `--out OUT/jobs/<i>` (its run log,
certificate and console output `OUT/jobs/<i>.log` stay there), so `--resume` resumes every child
from its own log. A child that dies before finishing leaves its unfinished pairs failing, with the
child's exit status and log named; what it finished is kept.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# options the parent sets per child or handles itself
# (the parent has already narrowed the ops with --changed-since and carries the rest itself)
_PER_CHILD = {"--jobs": True, "--ops": True, "--out": True, "--junit": True, "--json": False,
              "--changed-since": True}


def partition(names: list[str], jobs: int) -> list[list[str]]:
    """Round-robin in the given (registry) order: stable for a resume with the same --jobs."""
    groups = [names[i::jobs] for i in range(jobs)]
    return [g for g in groups if g]         # fewer ops than jobs: fewer children


def child_argv(argv: list[str], ops: list[str], out: Path) -> list[str]:
    """The parent's `run` arguments without the per-child ones, plus this child's ops and out."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in _PER_CHILD:
            skip = _PER_CHILD[name] and "=" not in a
            continue
        kept.append(a)
    if kept and kept[0] == "run":
        kept = kept[1:]
    return [sys.executable, "-m", "verify.cli", "run", *kept, "--ops", ",".join(ops), "--out", str(out)]


def visible_gpus(device: str) -> list[str]:
    if device != "cuda":
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def run_jobs(argv: list[str], op_names: list[str], candidates: list[str], jobs: int, device: str,
             out: Path, console) -> tuple[list, dict, list[str]]:
    """Run the children and merge. Returns (op verdicts in the order of op_names x candidates,
    (op, candidate) -> case records, one line per child that did not exit 0 or 1)."""
    from verify.runlog import LOG_NAME, read
    from verify.verdict import FAIL, OpVerdict

    groups = partition(op_names, jobs)
    gpus = visible_gpus(device)
    jobs_dir = out / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, group in enumerate(groups):
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        log = open(jobs_dir / f"{i}.log", "w")
        where = f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if gpus else ""
        console.print(f"job {i}{where}: {', '.join(group)}  (log {jobs_dir / f'{i}.log'})")
        procs.append((i, group, subprocess.Popen(child_argv(argv, group, jobs_dir / str(i)), env=env,
                                                 stdout=log, stderr=subprocess.STDOUT), log, time.monotonic()))
    problems = []
    by_pair, cases = {}, {}
    for i, group, proc, log, t0 in procs:
        rc = proc.wait()
        log.close()
        console.print(f"job {i} finished: exit {rc} after {time.monotonic() - t0:.0f} s")
        path = jobs_dir / str(i) / LOG_NAME
        done = read(path) if path.exists() else None
        if rc not in (0, 1):
            problems.append(f"job {i} ({', '.join(group)}) exited with status {rc}: see {jobs_dir / f'{i}.log'}")
        for name in group:
            for cand in candidates:
                v = done.op_verdicts.get((name, cand)) if done else None
                if v is None:
                    judged = len(done.partial.get((name, cand), [])) if done else 0
                    v = OpVerdict(name, cand, FAIL, reason=f"job {i} exited with status {rc} before finishing "
                                  f"this pair ({judged} cases judged; see {jobs_dir / f'{i}.log'}, resume with "
                                  "--resume)")
                else:
                    cases[(name, cand)] = done.cases.get((name, cand), [])
                by_pair[(name, cand)] = v
    return [by_pair[(n, c)] for n in op_names for c in candidates], cases, problems
