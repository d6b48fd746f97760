"""Where a plan's cases run: one slice of it in this process's workers (`run`, `run --shard I/N`,
`run --resume`), or all of it spread over child processes, one slice each (`run --jobs N`, one GPU
per child where several are visible). Every verdict is in OUT/run.jsonl as soon as it is judged.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from verify.model.verdict import FAIL, XPASS, CaseVerdict
from verify.ops.registry import get_op
from verify.plan.plan import PLAN_NAME, Plan, PlannedCase, load
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
    """Write the plan to OUT (a resume needs the same plan there)."""
    path = out / PLAN_NAME
    if resume and path.exists():
        try:
            old = load(path)
        except ValueError as e:
            raise PlanMismatch(str(e)) from None
        if old.id != plan.id:
            raise PlanMismatch(f"{path} is plan {old.id}, this run's is {plan.id} (other settings or code); "
                               "rerun with the log's settings, or without --resume")
    plan.write(out)


def run_slice(plan: Plan, cfg: RunConfig, out: Path, shard: tuple[int, int] = (0, 1), resume: bool = False,
              console=None) -> Judged:
    """Judge shard I of N of the plan into OUT/run.jsonl (on --resume only the cases the log lacks).
    Returns every verdict the log holds for the plan, earlier ones included."""
    prepare_out(plan, out, resume)
    try:
        before = runlog.read(out / runlog.LOG_NAME) if resume and (out / runlog.LOG_NAME).exists() else None
    except ValueError as e:
        raise PlanMismatch(str(e)) from None
    if before is not None and before.plans - {plan.id}:
        raise PlanMismatch(f"{out / runlog.LOG_NAME} holds verdicts of plan {', '.join(sorted(before.plans - {plan.id}))}, "
                           f"not {plan.id}")
    done = set(before.verdicts) if before else set()
    todo = [pc for pc in plan.slice(*shard) if pc.index not in done]
    log = runlog.RunLog(out, resume=resume)
    log.start(plan.id, shard, {"isolated": cfg.isolate, "case_timeout": cfg.case_timeout})
    ops = {o: get_op(o) for o in {pc.op for pc in todo}}
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    progress = _PairProgress(console, todo)
    evaluator = _evaluator(cfg, plan.options.get("threads", 0))
    try:
        judge_cases(todo, ops, cfg.device, evaluator, lambda pc, v: (log.case(pc.index, v), progress.step(pc, v)),
                    lambda pc, v: log.shrunk(pc.index, v), cfg.profile)
    finally:
        evaluator.close()
        progress.close()
        log.close()
    return judged_in([out])


def judged_in(dirs: list[Path]) -> Judged:
    """Every case verdict in these output directories' logs, by plan index."""
    judged = Judged()
    for d in dirs:
        contents = runlog.read(Path(d) / runlog.LOG_NAME)
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


def run_jobs(plan: Plan, cfg: RunConfig, out: Path, jobs: int, resume: bool = False) -> tuple[Judged, list[str]]:
    """`run --jobs N`: the plan's N slices judged at once by N child processes (OUT/shards/I, each a
    `--shard I/N` run of the same plan file), spread over the visible GPUs; returns their verdicts
    merged, and a line per child that did not finish cleanly."""
    prepare_out(plan, out, resume)
    gpus = visible_gpus(cfg.device)
    procs = []
    for i in range(jobs):
        d = out / "shards" / str(i)
        d.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "verify.run.execute", str(out / PLAN_NAME), f"{i}/{jobs}", str(d),
                "--case-timeout", str(cfg.case_timeout)] + ([] if cfg.isolate else ["--no-isolate"]) \
            + (["--resume"] if resume else [])
        console = open(d / "console.log", "w")
        procs.append((i, d, subprocess.Popen(argv, env=child_env(gpus[i % len(gpus)] if gpus else None),
                                             stdout=console, stderr=subprocess.STDOUT), console))
    problems = []
    for i, d, proc, console in procs:
        rc = proc.wait()
        console.close()
        if rc not in (0, 1):
            problems.append(f"shard {i}/{jobs} exited with status {rc}; its log: {d / 'console.log'}")
    return judged_in([d for _, d, _, _ in procs]), problems


def main(argv: list[str] | None = None) -> int:
    """A `--jobs` child: python -m verify.run.execute PLAN I/N OUT [--case-timeout S] [--no-isolate] [--resume]."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m verify.run.execute")
    p.add_argument("plan")
    p.add_argument("shard")
    p.add_argument("out")
    p.add_argument("--case-timeout", type=float, default=120.0)
    p.add_argument("--no-isolate", action="store_true")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    plan = load(Path(a.plan))
    i, n = (int(x) for x in a.shard.split("/"))
    cfg = config_of(plan, isolate=not a.no_isolate, case_timeout=a.case_timeout)
    judged = run_slice(plan, cfg, Path(a.out), (i, n), a.resume)
    mine = [judged.verdicts.get(pc.index) for pc in plan.slice(i, n)]
    return 1 if any(v is not None and v.status in (FAIL, XPASS) for v in mine) else 0


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

