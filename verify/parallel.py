"""`run --jobs N`: up to N op certifications at once, each op in a child `verify-kernels run`
process of its own, on a GPU slot of its own where several GPUs are visible
(`CUDA_VISIBLE_DEVICES`); a slot takes the next op when its child exits, so long and short ops
balance themselves. The children's per-op verdicts and case records merge into one certificate.

Each child runs the same command with `--ops OP --out OUT/jobs/OP` (its run log, certificate and
console output `OUT/jobs/OP.log` stay there), so `--resume` resumes every op from its own log,
whatever N was. A child that dies before finishing leaves its op's unfinished pairs failing, with
the child's exit status and log named; what it finished is kept.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

# options the parent sets per child or handles itself
# (the parent has already narrowed the ops with --changed-since and carries the rest itself)
_PER_CHILD = {"--jobs": True, "--ops": True, "--out": True, "--junit": True, "--json": False,
              "--changed-since": True}


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

    gpus = visible_gpus(device)
    jobs_dir = out / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    queue, free, running = list(op_names), list(range(jobs)), {}
    problems, by_pair, cases = [], {}, {}

    def start(slot: int, name: str) -> None:
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
        log = open(jobs_dir / f"{name}.log", "w")
        where = f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if gpus else ""
        console.print(f"{name}: started{where} (log {jobs_dir / f'{name}.log'})")
        proc = subprocess.Popen(child_argv(argv, [name], jobs_dir / name), env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        running[slot] = (name, proc, log, time.monotonic())

    def finish(slot: int) -> None:
        name, proc, log, t0 = running.pop(slot)
        rc = proc.returncode
        log.close()
        console.print(f"{name}: child exited with status {rc} after {time.monotonic() - t0:.0f} s")
        path = jobs_dir / name / LOG_NAME
        done = read(path) if path.exists() else None
        if rc not in (0, 1):
            problems.append(f"{name}: its child exited with status {rc}: see {jobs_dir / f'{name}.log'}")
        for cand in candidates:
            v = done.op_verdicts.get((name, cand)) if done else None
            if v is None:
                judged = len(done.partial.get((name, cand), [])) if done else 0
                v = OpVerdict(name, cand, FAIL, reason=f"its child exited with status {rc} before finishing this "
                              f"pair ({judged} cases judged; see {jobs_dir / f'{name}.log'}, resume with --resume)")
            else:
                cases[(name, cand)] = done.cases.get((name, cand), [])
            by_pair[(name, cand)] = v
        free.append(slot)

    while queue or running:
        while queue and free:
            start(free.pop(0), queue.pop(0))
        time.sleep(0.2)
        for slot in [s for s, r in running.items() if r[1].poll() is not None]:
            finish(slot)
    return [by_pair[(n, c)] for n in op_names for c in candidates], cases, problems
