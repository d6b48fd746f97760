"""Where a plan's cases run: one slice of it in this process's workers (`run`, `run --shard I/N`,
`run --resume`), or a slice spread over child processes (`run [--shard I/N] --jobs M`, one GPU per
child where several are visible). Every verdict is in a run.jsonl as soon as it is judged.

`--jobs` children share the slice through claims: before judging a case a child creates
OUT/claims/<index> exclusively, and judges only the cases it claimed. Child j starts at the j-th of M
equal positions in the slice and walks forward while the cases are unclaimed, so each begins on the
cases of one or two ops (the kernels it compiles); when it runs into claimed cases it jumps to the
middle of the longest unclaimed run, which halves the work left to the child on that run. Cases cost
from milliseconds to a minute (a new kernel compile): fixed blocks left most children idle while
the few holding the slow ops worked on.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from verify.model.verdict import FAIL, XPASS, CaseVerdict
from verify.ops.registry import get_op
from verify.plan.plan import PLAN_NAME, Plan, PlannedCase, case_of, load
from verify.run import runlog
from verify.run.runner import InProcess, Judged, RunConfig, judge_cases

class PlanMismatch(ValueError):
    """An output directory holds another plan's log, or a plan or log this harness did not write: one
    line naming it."""


class _PairProgress:
    """Drives RunProgress over a slice of the plan: a pair starts where its first case comes and ends
    (pass or fail, as far as this slice judged it) where the next pair's begins."""

    def __init__(self, console, todo: list[PlannedCase]):
        from verify.run.progress import RunProgress

        pairs = len({(pc.op, pc.candidate) for pc in todo})
        self.progress = RunProgress(console, pairs).__enter__()
        self.pair, self.failed = None, False

    def step(self, pc: PlannedCase, v: CaseVerdict) -> None:
        if (pc.op, pc.candidate) != self.pair:
            self._end()
            self.pair, self.failed = (pc.op, pc.candidate), False
            self.progress.start(pc.op, pc.candidate)
        self.failed |= v.status in (FAIL, XPASS)
        self.progress.case(v)

    def _end(self) -> None:
        if self.pair is not None:
            self.progress.done(CaseVerdict(self.pair[0], self.pair[1], "", "fail" if self.failed else "pass"))
            self.pair = None

    def close(self) -> None:
        self._end()
        self.progress.__exit__(None, None, None)


def _evaluator(cfg: RunConfig, threads: int):
    if cfg.isolate:
        from verify.run.worker import IsolatedRunner

        return IsolatedRunner(case_timeout=cfg.case_timeout, threads=threads)
    return InProcess(threads=threads)


def prepare_out(plan: Plan, out: Path, resume: bool) -> None:
    """Write the plan to OUT (a resume needs the same plan there). A fresh run first clears the logs an
    earlier run's --jobs children left in OUT/shards, which would otherwise be read as this run's."""
    path = out / PLAN_NAME
    if not resume:
        shutil.rmtree(out / "shards", ignore_errors=True)
    if resume and path.exists():
        try:
            old = load(path)
        except ValueError as e:
            raise PlanMismatch(str(e)) from None
        if old.id != plan.id:
            raise PlanMismatch(f"{path} is plan {old.id}, this run's is {plan.id} (other settings or code); "
                               "rerun with the log's settings, or without --resume")
    plan.write(out)


def _claim(claims: Path, index: int) -> bool:
    """True when this process creates claims/<index> first: the case is ours to judge."""
    try:
        os.close(os.open(claims / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _largest_gap(todo: list[PlannedCase], claims: Path) -> tuple[int, int] | None:
    """[a, b): the longest run of unclaimed cases in todo, None when every case is claimed."""
    taken = {int(n) for n in os.listdir(claims) if n.isdigit()}
    best, a = None, None
    for k, pc in enumerate(todo + [None]):
        free = pc is not None and pc.index not in taken
        if free and a is None:
            a = k
        elif not free and a is not None:
            if best is None or k - a > best[1] - best[0]:
                best = (a, k)
            a = None
    return best


def _locality(pc: PlannedCase) -> tuple:
    """Where a `--jobs` child walks the cases: grouped by what its kernels compile for (op, candidate,
    config, dtype, rank count), then batch, so each child meets few compile keys. A CuTe DSL kernel
    traces for about a second per static configuration and every process keeps its own cache: walked
    in plan order, each of 16 children compiled most of an op's keys. The plan and the verdicts are the
    same either way; only which child judges which case changes."""
    c = case_of(pc)
    return pc.op, pc.candidate, c.config, c.dtype, c.tp, c.batch, pc.index


def _claimed(todo: list[PlannedCase], claims: Path, start: int):
    """The cases of todo this process judges: from `start` forward while they are unclaimed; then,
    again and again, from the middle of the longest run nobody has claimed (the process working that
    run from its front keeps the first half), until every case is claimed."""
    pos = start
    while True:
        while pos < len(todo) and _claim(claims, todo[pos].index):
            yield todo[pos]
            pos += 1
        gap = _largest_gap(todo, claims)
        if gap is None:
            return
        a, b = gap
        pos = a if a == 0 else a + (b - a) // 2      # a > 0: the case before a is claimed, its claimer works on into a


def run_slice(plan: Plan, cfg: RunConfig, out: Path, shard: tuple[int, int] = (0, 1), resume: bool = False,
              console=None, claims: tuple[Path, int, int] | None = None) -> Judged:
    """Judge shard I of N of the plan into OUT/run.jsonl (on --resume only the cases the log lacks).
    With claims (DIR, j, M): the slice from its j-th of M positions on, then the middle of whatever
    run of it nobody has claimed yet (_claimed), each case judged only where this process claims it
    in DIR. Returns every verdict the logs in OUT hold for the plan, earlier ones included."""
    prepare_out(plan, out, resume)
    done = set(_judged_before(plan, out).verdicts) if resume else set()
    todo = [pc for pc in plan.slice(*shard) if pc.index not in done]
    entries = todo
    if claims is not None:
        cdir, j, m = claims
        walk = sorted(todo, key=_locality)
        entries = _claimed(walk, cdir, j * len(walk) // m)
    log = runlog.RunLog(out, resume=resume)
    log.start(plan.id, shard, {"isolated": cfg.isolate, "case_timeout": cfg.case_timeout})
    ops = {o: get_op(o) for o in {pc.op for pc in todo}}
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    progress = _PairProgress(console, todo)
    evaluator = _evaluator(cfg, plan.options.get("threads", 0))
    try:
        judge_cases(entries, ops, cfg.device, evaluator, lambda pc, v: (log.case(pc.index, v), progress.step(pc, v)),
                    lambda pc, v: log.shrunk(pc.index, v), cfg.profile)
    finally:
        evaluator.close()
        progress.close()
        log.close()
    return judged_in([out], plan.id)


def logs_in(d: Path) -> list[Path]:
    """The run logs of an output directory: its own, and its `--jobs` children's (d/shards/*)."""
    d = Path(d)
    own = [d / runlog.LOG_NAME] if (d / runlog.LOG_NAME).is_file() else []
    kids = sorted(d.glob(f"shards/*/{runlog.LOG_NAME}"), key=lambda p: (len(p.parent.name), p.parent.name))
    return own + kids


def _judged_before(plan: Plan, out: Path) -> Judged:
    """What a resumed run finds judged in OUT; a PlanMismatch when a log there holds another plan."""
    try:
        return judged_in([out], plan.id)
    except ValueError as e:
        raise PlanMismatch(str(e)) from None


def judged_in(dirs: list[Path], plan_id: str | None = None) -> Judged:
    """Every case verdict in these output directories' logs (their --jobs children's included), by
    plan index; with plan_id, a log that holds another plan's verdicts is a ValueError naming it."""
    judged = Judged()
    for log in (p for d in dirs for p in logs_in(d)):
        contents = runlog.read(log)
        if plan_id is not None and contents.plans - {plan_id}:
            raise ValueError(f"{log} holds verdicts of plan {', '.join(sorted(map(str, contents.plans - {plan_id})))}, "
                             f"not {plan_id}")
        for i, v in contents.verdicts.items():
            judged.verdicts.setdefault(i, v)
        for i, v in contents.shrunk.items():
            judged.shrunk.setdefault(i, v)
    return judged


def visible_gpus(device: str) -> list[str]:
    if device != "cuda":
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def child_env(gpu: str | None) -> dict[str, str]:
    """A child's environment: its GPU where several are visible. (Its thread count is the plan's.)"""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def run_jobs(plan: Plan, cfg: RunConfig, out: Path, jobs: int, resume: bool = False,
             shard: tuple[int, int] = (0, 1)) -> tuple[Judged, list[str]]:
    """`run [--shard I/N] --jobs M`: the slice judged at once by M child processes (OUT/shards/j), which
    share it through claims in OUT/claims, spread over the visible GPUs; returns their verdicts
    merged, and a line per child that did not finish cleanly. On --resume every case a child's log
    already holds is claimed before any child starts."""
    prepare_out(plan, out, resume)
    gpus = visible_gpus(cfg.device)
    claims = out / "claims"
    shutil.rmtree(claims, ignore_errors=True)
    claims.mkdir(parents=True)
    for i in _judged_before(plan, out).verdicts if resume else ():
        (claims / str(i)).touch()
    procs = []
    for j in range(jobs):
        d = out / "shards" / str(j)
        d.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "verify.run.execute", str(out / PLAN_NAME), f"{shard[0]}/{shard[1]}", str(d),
                "--claims", str(claims), "--start", f"{j}/{jobs}",
                "--case-timeout", str(cfg.case_timeout)] + ([] if cfg.isolate else ["--no-isolate"]) \
            + (["--resume"] if resume else [])
        console = open(d / "console.log", "w")
        procs.append((j, d, subprocess.Popen(argv, env=child_env(gpus[j % len(gpus)] if gpus else None),
                                             stdout=console, stderr=subprocess.STDOUT), console))
    problems = []
    for j, d, proc, console in procs:
        rc = proc.wait()
        console.close()
        if rc not in (0, 1):
            problems.append(f"job {j} of {jobs} exited with status {rc}; its log: {d / 'console.log'}")
    return judged_in([out], plan.id), problems


def main(argv: list[str] | None = None) -> int:
    """A `--jobs` child: python -m verify.run.execute PLAN I/N OUT [--claims DIR --start J/M]
    [--case-timeout S] [--no-isolate] [--resume]."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m verify.run.execute")
    p.add_argument("plan")
    p.add_argument("shard")
    p.add_argument("out")
    p.add_argument("--case-timeout", type=float, default=120.0)
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--claims")
    p.add_argument("--start", default="0/1")
    a = p.parse_args(argv)
    plan = load(Path(a.plan))
    i, n = (int(x) for x in a.shard.split("/"))
    j, m = (int(x) for x in a.start.split("/"))
    cfg = config_of(plan, isolate=not a.no_isolate, case_timeout=a.case_timeout)
    claims = (Path(a.claims), j, m) if a.claims else None
    judged = run_slice(plan, cfg, Path(a.out), (i, n), a.resume, claims=claims)
    return 1 if any(v.status in (FAIL, XPASS) for v in judged.verdicts.values()) else 0


def config_of(plan: Plan, isolate: bool = True, case_timeout: float = 120.0) -> RunConfig:
    """The RunConfig a plan was made with (what judging its cases needs: device, profile)."""
    from dataclasses import replace

    from verify.model.profile import get_profile

    o = plan.options
    profile = get_profile(o["profile"])
    profile = replace(profile, configs=tuple(o["configs"]),
                      dtypes=None if o.get("dtypes") is None else tuple(o["dtypes"]))
    return RunConfig(tuple(o["ops"]), tuple(o["candidates"]), o["device"], profile, o["seed"],
                     None if o.get("tp") is None else tuple(o["tp"]), o.get("examples"), isolate, case_timeout,
                     o.get("harness", ""), o.get("threads", 0))


if __name__ == "__main__":
    sys.exit(main())

