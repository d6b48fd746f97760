"""`verify-kernels bench --isolate`: each (op, T, B) of the plan benched in a process of its own
(`verify-kernels bench` asked for that op, T and B, under OUT/rows/), the children's rows merged into
one record in OUT.

Why: within one process, memory that a row's entries leave behind (captured graphs' private pools,
segments of the allocator's cache pinned by one live block) is not given back by gc and
empty_cache, and a K3 layer or 896-expert row needs most of an 80 GB card; measured, the reserved
memory grew from row to row until later rows ran out of memory. A fresh process per row starts from
an empty card. A row whose process dies (a segfault, the kernel's OOM killer, a sticky device error)
loses only that row: its shapes are listed as not timed with the exit, and the next row runs.

The children run in round order (run.rounds: one batch size of every op per round), so a time
budget, checked before each child, cuts the last rounds of every op alike; a child still running when
the budget ends is stopped as a SIGTERM stops it (it writes what it timed, its other shapes are
listed), so no child runs the parent past its budget. A SIGTERM to the parent stops the child the
same way, keeps its rows and lists the rest.

An entry that failed with the same error at run.GIVE_UP_AFTER shapes in a row is not tried again, as
in one process: each child is handed the failure counts of the rows before it (the JSON of
{op: {entry: [error, shapes]}} in the FAILURES_ENV environment variable), so a compile that fails
costs its compile time at two rows, not at every row.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

ROWS_DIR = "rows"
FAILURES_ENV = "VERIFY_BENCH_FAILURES"
OWN_SIGNAL_S = 2.0        # a child's time to stop on a signal its process group got, before it is sent one
STOP_WAIT_S = 30.0        # a stopped child's time to write its record before it is killed


def inherited_failures() -> dict:
    """The failure counts a parent `bench --isolate` handed this process (FAILURES_ENV), or {}."""
    text = os.environ.get(FAILURES_ENV)
    if not text:
        return {}
    try:
        got = json.loads(text)
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def groups(per_op: list[tuple[object, list]]) -> list[tuple[object, int, int, list]]:
    """(op, T, B, shapes) per child, in round order (run.rounds over (op, its shapes)), each group's
    shapes those of one op at one T and B (its knob sets)."""
    from verify.bench import run

    out: dict[tuple, tuple] = {}
    for rnd in run.rounds(per_op):
        for op, s in rnd:
            out.setdefault((op.name, s.tp, s.batch), (op, s.tp, s.batch, []))[3].append(s)
    return list(out.values())


def _for_op(specs: list[str], op_name: str) -> list[str]:
    return [s for s in specs if s.partition(":")[0] == op_name]


def child_argv(args, op_name: str, tp: int, batch: int, certs: list[str], out_dir: Path) -> list[str]:
    """The `verify-kernels bench` arguments of one child: the parent's, narrowed to one op, T and B,
    with the op's own --peer and --knobs, and no time budget (the parent keeps it)."""
    argv = ["bench", "--ops", op_name, "--tp", str(tp), "--batch", str(batch), "--candidate", args.candidate,
            "--certificate", ",".join(certs), "--out", str(out_dir)]
    for spec in _for_op(list(getattr(args, "peer", None) or []), op_name):
        argv += ["--peer", spec]
    for spec in _for_op(list(getattr(args, "knobs", None) or []), op_name):
        argv += ["--knobs", spec]
    if getattr(args, "variants", False):
        argv.append("--variants")
    if getattr(args, "profile_kernels", None):
        argv += ["--profile-kernels", args.profile_kernels]
    return argv


def _stop(child: subprocess.Popen, grace_s: float) -> int:
    """The child's exit status after `grace_s` to end on a signal it already got, then SIGTERM and
    STOP_WAIT_S to write its record, then SIGKILL."""
    try:
        return child.wait(grace_s)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGTERM)
        try:
            return child.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            return child.wait()


class ChildExit(NamedTuple):
    rc: int                 # the exit status (minus the signal that ended it)
    stopped: bool = False   # stopped at its deadline (not ended on its own)


def run_child(argv: list[str], timeout_s: float | None = None) -> ChildExit:
    """`python -m verify.cli ARGV` in a new process, its output on this one's; how it ended. Past
    `timeout_s` it is stopped (SIGTERM: it writes what it timed; SIGKILL STOP_WAIT_S later). An
    Interrupted (SIGTERM to this process) stops it too, after OWN_SIGNAL_S for a signal sent to the
    whole group (`timeout`) to reach it first."""
    from verify.bench.run import Interrupted

    child = subprocess.Popen([sys.executable, "-m", "verify.cli", *argv])
    try:
        return ChildExit(child.wait(timeout_s))
    except subprocess.TimeoutExpired:
        return ChildExit(_stop(child, 0.0), stopped=True)
    except (Interrupted, KeyboardInterrupt):
        _stop(child, OWN_SIGNAL_S)
        raise


def _key(d: dict) -> tuple:
    """A shape's identity in a record (a row or a not_reached entry)."""
    return d["op"], d["tp"], d["batch"], tuple(sorted(d.get("knobs", {}).items()))


def exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def bench_isolated(args, ops, labels, tps, batches, certs, out: Path, argv, device: str = "cuda",
                   runner: Callable[[list[str], float | None], ChildExit] = run_child) -> int:
    """The bench of cmd_bench with one child process per (op, T, B) (`groups`); the same record,
    report and exit status. runner ((argv, seconds left) -> ChildExit) is a parameter for a CPU run
    of the plumbing."""
    from rich.console import Console

    from verify.bench import command
    from verify.record.certificate import environment

    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 200)
    out.mkdir(parents=True, exist_ok=True)
    previous = command._on_sigterm(command._interrupt)
    try:
        gate = command.gate_candidates(ops, labels, certs, device, out, console)
        if isinstance(gate, int):
            return gate
        certs = certs or [str(out / "certificate.json")]      # the quick certification's, for the children
        plan, options = command.plan_and_options(args, ops, gate, labels, tps, batches, certs, device)
        saver = command._Saver(out, environment(device) | command.bench_versions(), argv,
                               options | {"isolate": True}, gate, labels)
        state = _run_groups(args, plan, certs, out, runner, console, on_change=saver.save)
        command._on_sigterm(signal.SIG_IGN)
        rec = saver.save(state, text=True, html=True)
    finally:
        command._on_sigterm(previous)
    return command.finish(console, rec, out, args, gate)


def _child_record(child_out: Path) -> dict:
    """The child's bench record, or {} where it wrote none or one cut mid-write (its exit says why)."""
    from verify.bench import output

    try:
        return output.load(child_out / output.FILE)
    except Exception:  # noqa: BLE001
        return {}


def _run_groups(args, plan, certs, out, runner, console, on_change) -> dict:
    """Each group in its child, round by round; the merged state {"rows", "not_reached", "notes"}."""
    from verify.bench import run

    per_op, rows, notes = run.plan_shapes(plan)
    not_reached = []
    failures: dict[str, dict] = {}
    todo = groups(per_op)
    pending = [s.to_dict() | {"reason": "pending"} for g in todo for s in g[3]]

    def state() -> dict:
        return {"rows": rows, "not_reached": not_reached + pending, "notes": {k: v for k, v in notes.items() if v}}

    def take(child_out: Path, where: str, shapes: list, rc: int | None, stopped: bool = False) -> None:
        """The child's rows and notes into the state; the group's shapes it did not time listed with
        its reason ("time budget" where the budget's end stopped it), or with the child's exit where it
        ended abnormally or wrote no reason (rc None: the run stops here, and the caller gives them
        its reason)."""
        rec = _child_record(child_out)
        got = {_key(r) for r in rec.get("rows", [])}
        rows.extend(rec.get("rows", []))
        for r in rec.get("rows", []):
            run.note_row_failures(failures.setdefault(r["op"], {}), r)
        for k, v in rec.get("notes", {}).items():
            mine = notes.setdefault(k, [])
            mine.extend(n for n in v if n not in mine)
        theirs = {_key(d): d.get("reason") for d in rec.get("not_reached", [])}
        abnormal = rc not in (0, 1, None) and not stopped
        for s in shapes:
            d = s.to_dict()
            if _key(d) in got:
                continue
            reason = theirs.get(_key(d))
            if stopped:
                reason = "time budget"
            elif rc is None:
                reason = reason or "pending"
            elif abnormal or reason in (None, "pending"):
                reason = f"its process ended ({exit_text(rc)}) before timing it"
            not_reached.append(d | {"reason": reason})
        if abnormal:
            notes.setdefault("run", []).append(f"{where}: its process ended ({exit_text(rc)}); its record: {child_out}")

    start = time.monotonic()
    before = os.environ.get(FAILURES_ENV)
    try:
        for i, (op, tp, batch, shapes) in enumerate(todo):
            del pending[:len(shapes)]
            if run.past_budget(args.time_budget, start, shapes, len(pending), not_reached, notes):
                continue
            child_out = out / ROWS_DIR / f"{i:03d}-{op.name}-T{tp}-B{batch}"
            where = f"{op.name} T={tp} B={batch}"
            console.print(f"bench --isolate: {where} in its own process ({child_out})")
            os.environ[FAILURES_ENV] = json.dumps({op.name: failures.get(op.name, {})})
            left_s = None if args.time_budget is None else max(args.time_budget - (time.monotonic() - start), 1.0)
            try:
                rc, stopped = runner(child_argv(args, op.name, tp, batch, certs, child_out), left_s)
            except BaseException:
                take(child_out, where, shapes, None)
                raise
            if stopped:
                notes.setdefault("run", []).append(f"time budget of {args.time_budget:g} s reached in {where}: "
                                                   f"its process was stopped")
            take(child_out, where, shapes, rc, stopped)
            on_change(state())
    except (run.Interrupted, KeyboardInterrupt) as e:
        why = run.interrupted(e, start, notes)
        not_reached[:] = [d | {"reason": why} if d["reason"] == "pending" else d for d in not_reached]
        not_reached.extend(d | {"reason": why} for d in pending)
        pending.clear()
    finally:
        if before is None:
            os.environ.pop(FAILURES_ENV, None)
        else:
            os.environ[FAILURES_ENV] = before
    run.sort_rows(rows, plan.ops)
    return state()
