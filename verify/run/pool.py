"""`run --jobs N`: up to N op certifications at once, each op in a child `verify-kernels run`
process of its own, on a GPU slot of its own where several GPUs are visible
(`CUDA_VISIBLE_DEVICES`); a slot takes the next op when its child exits, so long and short ops
balance themselves. The children's per-op verdicts and case records merge into one certificate.

Each child runs the same command with `--ops OP --out OUT/jobs/OP` (its run log, certificate and
console output `OUT/jobs/OP.log` stay there), so `--resume` resumes every op from its own log,
whatever N was. A child that dies before finishing leaves its op's unfinished pairs failing, with
the child's exit status and log named; what it finished is kept.

`--shards K` splits each op further: the parent draws the op's cases as the certification would
(`certify.draw_cases`, nothing judged) and deals them round-robin to K children
(`--case-list`, logs OUT/jobs/OP.shardK/), which judge them at once on the op's GPU: CuTe DSL
compiles, input building and the harness's host work run in K processes instead of one. Each
child's CPU thread pools share the host's cores (`child_threads`). When the
K have exited, their case lines are joined into OUT/jobs/OP/run.jsonl and the op's own child runs
with `--resume`: hypothesis replays the judged cases from that memo, judges any case the dry draw
did not foresee (a dist-sweep case for a dist drawn only vacuously), shrinks a failure and writes the op's
verdict, exactly as an unsharded run would. On --resume each shard goes on with the list it was
dealt (`_recorded_deal`), and reading the joined log counts a case two shards both judged once.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# options the parent sets per child or handles itself
# (the parent has already narrowed the ops with --changed-since and carries the rest itself)
_PER_CHILD = {"--jobs": True, "--ops": True, "--out": True, "--junit": True, "--json": False,
              "--changed-since": True, "--shards": True, "--case-list": True}


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


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def child_threads(jobs: int) -> dict[str, str]:
    """Intra-op CPU threads per child: the cores this process may use, shared by the `jobs`
    children (at least 1 each). Unset, every child's torch takes all the cores, and 16 children
    on a 32-core host run 512 busy-waiting OpenMP threads. A value the user set is kept."""
    if any(v in os.environ for v in THREAD_VARS):
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = str(max(1, cores // max(1, jobs)))
    return {v: n for v in THREAD_VARS}


def visible_gpus(device: str) -> list[str]:
    if device != "cuda":
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [g.strip() for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _recorded_deal(jobs_dir: Path, name: str, shards: int) -> list[dict] | None:
    """On --resume, the deal an earlier run wrote (OP.shardK.cases.json), so each shard goes on with
    the cases its own log holds: a fresh dry draw need not deal the same (hypothesis mixes in
    constants of the modules imported so far). None where there is none, or it was for another K.
    Any deal is safe: the op's own child judges every case of its draw that no shard did."""
    paths = [jobs_dir / f"{name}.shard{k}.cases.json" for k in range(shards)]
    if not any(p.exists() for p in paths) or (jobs_dir / f"{name}.shard{shards}.cases.json").exists():
        return None
    try:
        return [json.loads(p.read_text()).get(name, {}) if p.exists() else {} for p in paths]
    except (json.JSONDecodeError, AttributeError):
        return None


def run_jobs(argv: list[str], op_names: list[str], candidates: list[str], jobs: int, device: str,
             out: Path, console, dealt: dict | None = None, shards: int = 1) -> tuple[list, dict, list[str]]:
    """Run the children and merge. Returns (op verdicts in the order of op_names x candidates,
    (op, candidate) -> case records, one line per child that did not exit 0 or 1). `dealt`:
    op -> candidate -> drawn cases, to split over `shards` children per op first."""
    from verify.run.runlog import LOG_NAME, read
    from verify.model.verdict import FAIL, OpVerdict

    gpus = visible_gpus(device)
    jobs_dir = out / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    gpu_of = {name: gpus[i % len(gpus)] for i, name in enumerate(op_names)} if gpus else {}
    pending_shards: dict[str, set[str]] = {}
    queue: list[tuple[str, str, list[str]]] = []        # (op, task name, extra child args)
    for name in op_names:
        resumed = (jobs_dir / name / LOG_NAME).exists() and "--resume" in argv
        if dealt and shards > 1 and not resumed:
            pending_shards[name] = set()
            recorded = _recorded_deal(jobs_dir, name, shards) if "--resume" in argv else None
            for k in range(shards):
                task = f"{name}.shard{k}"
                part = recorded[k] if recorded else {c: cs[k::shards] for c, cs in dealt.get(name, {}).items()}
                if not any(part.values()):
                    continue
                (jobs_dir / f"{task}.cases.json").write_text(json.dumps({name: part}))
                pending_shards[name].add(task)
                queue.append((name, task, ["--case-list", str(jobs_dir / f"{task}.cases.json")]))
            if not pending_shards[name]:
                del pending_shards[name]
                queue.append((name, name, []))
        else:
            queue.append((name, name, []))
    free, running = list(range(jobs)), {}
    problems, by_pair, cases = [], {}, {}

    def start(slot: int, name: str, task: str, extra: list[str]) -> None:
        env = {**os.environ, **child_threads(jobs)}
        if gpus:
            # an op's shards and its final child share the op's GPU; ops round-robin over the GPUs
            env["CUDA_VISIBLE_DEVICES"] = gpu_of[name] if dealt and shards > 1 else gpus[slot % len(gpus)]
        log = open(jobs_dir / f"{task}.log", "w")
        where = f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if gpus else ""
        console.print(f"{task}: started{where} (log {jobs_dir / f'{task}.log'})")
        proc = subprocess.Popen(child_argv(argv, [name], jobs_dir / task) + extra, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        running[slot] = (name, task, proc, log, time.monotonic())

    def join_shards(name: str) -> None:
        """The op's shard logs, one run log for its final child to --resume from (reading it counts
        a case two shards both judged once: runlog.read)."""
        lines, start_line = [], None
        for path in sorted(jobs_dir.glob(f"{name}.shard*/{LOG_NAME}")):
            for line in path.read_text().splitlines():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue                      # a line torn by a killed shard
                if obj.get("kind") == "start":
                    start_line = start_line or line
                elif obj.get("kind") == "case":
                    lines.append(line)
        if start_line is not None:
            (jobs_dir / name).mkdir(parents=True, exist_ok=True)
            (jobs_dir / name / LOG_NAME).write_text("\n".join([start_line, *lines]) + "\n")

    def finish(slot: int) -> None:
        name, task, proc, log, t0 = running.pop(slot)
        rc = proc.returncode
        log.close()
        console.print(f"{task}: child exited with status {rc} after {time.monotonic() - t0:.0f} s")
        free.append(slot)
        if rc not in (0, 1):
            problems.append(f"{task}: its child exited with status {rc}: see {jobs_dir / f'{task}.log'}")
        if task != name:                          # a shard: the op's own child runs once all are done
            pending_shards[name].discard(task)
            if not pending_shards[name]:
                join_shards(name)
                queue.insert(0, (name, name, ["--resume"] if "--resume" not in argv else []))
            return
        path = jobs_dir / name / LOG_NAME
        done = read(path) if path.exists() else None
        for cand in candidates:
            v = done.op_verdicts.get((name, cand)) if done else None
            if v is None:
                judged = len(done.partial.get((name, cand), [])) if done else 0
                v = OpVerdict(name, cand, FAIL, reason=f"its child exited with status {rc} before finishing this "
                              f"pair ({judged} cases judged; see {jobs_dir / f'{name}.log'}, resume with --resume)")
            else:
                cases[(name, cand)] = done.cases.get((name, cand), [])
            by_pair[(name, cand)] = v

    while queue or running:
        while queue and free:
            start(free.pop(0), *queue.pop(0))
        time.sleep(0.2)
        for slot in [s for s, r in running.items() if r[2].poll() is not None]:
            finish(slot)
    return [by_pair[(n, c)] for n in op_names for c in candidates], cases, problems
