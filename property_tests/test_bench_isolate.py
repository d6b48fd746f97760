"""verify-kernels bench --isolate on the CPU: one child per (op, T, B) in round order, the children's
records merged into one, and a child that dies, a time budget or a SIGTERM losing only what they
must. Each child here is the bench itself, run in-process on the CPU under a counting clock."""
from __future__ import annotations

import argparse
import signal

import pytest

from property_tests.test_bench import ROUNDS, CountingClock, _bench_args, _cli, _dry_gate, _dry_plan
from verify.bench import command, isolate, output, run, shapes, timing
from verify.ops.registry import get_op

OPS = ("router_topk", "mla_cache_write")


def _parse(argv: list[str]):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    command.add_args(sub.add_parser("bench"))
    return p.parse_args(argv)


def _in_process(calls: list, crash: dict | None = None):
    """A runner: the child's bench on the CPU, in this process; crash[(op, B)] = exit status returned
    instead of running it (a child that died before writing)."""
    def runner(argv: list[str], timeout_s: float | None = None) -> isolate.ChildExit:
        args = _parse(argv)
        calls.append((args.ops, int(args.batch), argv))
        if crash and (args.ops, int(args.batch)) in crash:
            return isolate.ChildExit(crash[(args.ops, int(args.batch))])
        ops, labels, tps, batches, certs, out = command._setup(args)
        return isolate.ChildExit(command._bench(args, ops, labels, tps, batches, certs, out, argv,
                                                device="cpu", clock=CountingClock()))
    return runner


def _isolated(monkeypatch, tmp_path, runner, entries=None, **kw):
    """bench_isolated over OPS at B = 1, 2, 4 on the CPU; `entries` replaces run.entries_for (the dry
    plan's no-op launches by default)."""
    _dry_plan(monkeypatch, OPS)
    _dry_gate(monkeypatch, OPS)
    if entries is not None:
        monkeypatch.setattr(run, "entries_for", entries)
    monkeypatch.setattr(timing, "plan_samples", lambda *a, **k: (2, 1))
    cert = tmp_path / "c.json"
    cert.write_text("{}")
    args = _bench_args(candidate="fused", variants=False, peer=[], knobs=[], **kw)
    return isolate.bench_isolated(args, [get_op(o) for o in OPS], ["fused"], [1], [1, 2, 4], [str(cert)],
                                  tmp_path / "out", ["bench", "--isolate"], device="cpu", runner=runner)


def test_each_op_t_and_b_runs_in_its_own_child_in_round_order_and_the_records_merge(monkeypatch, tmp_path):
    calls = []
    rc = _isolated(monkeypatch, tmp_path, _in_process(calls))
    assert rc == 0
    assert [(op, b) for op, b, _ in calls] == ROUNDS
    for op, b, argv in calls:
        assert argv[:7] == ["bench", "--ops", op, "--tp", "1", "--batch", str(b)]
        assert argv[argv.index("--certificate") + 1] == str(tmp_path / "c.json")
    rec = output.load(tmp_path / "out" / output.FILE)
    assert sorted((r["op"], r["batch"]) for r in rec["rows"]) == sorted(ROUNDS)
    assert rec["not_reached"] == [] and rec["options"]["isolate"] is True
    assert all(r["timings"]["fused"]["median_us"] > 0 for r in rec["rows"])
    assert len(list((tmp_path / "out" / isolate.ROWS_DIR).iterdir())) == len(ROUNDS)
    assert "### router_topk" in (tmp_path / "out" / "bench.md").read_text()


def test_a_child_that_dies_loses_only_its_row(monkeypatch, tmp_path):
    calls = []
    rc = _isolated(monkeypatch, tmp_path, _in_process(calls, crash={("mla_cache_write", 4): -signal.SIGSEGV}))
    assert rc == 1 and len(calls) == len(ROUNDS)
    rec = output.load(tmp_path / "out" / output.FILE)
    assert sorted((r["op"], r["batch"]) for r in rec["rows"]) == sorted(x for x in ROUNDS if x != ("mla_cache_write", 4))
    assert [(d["op"], d["batch"], d["reason"]) for d in rec["not_reached"]] == [
        ("mla_cache_write", 4, "its process ended (killed by SIGSEGV) before timing it")]
    assert any("mla_cache_write T=1 B=4: its process ended (killed by SIGSEGV)" in n for n in rec["notes"]["run"])


def test_a_time_budget_starts_no_child_past_it(monkeypatch, tmp_path):
    calls = []
    rc = _isolated(monkeypatch, tmp_path, _in_process(calls), time_budget=1e-9)
    assert rc == 1 and calls == []
    rec = output.load(tmp_path / "out" / output.FILE)
    assert rec["rows"] == [] and [(d["op"], d["batch"], d["reason"]) for d in rec["not_reached"]] == [
        (op, b, "time budget") for op, b in ROUNDS]


def test_a_child_gets_what_is_left_of_the_budget_and_one_that_runs_past_it_is_listed(monkeypatch, tmp_path):
    """The budget bounds a child, not only the start of one: each child is handed the seconds left, and
    one stopped at the budget's end keeps what it timed, its other shapes listed as "time budget"."""
    clock = [0.0]
    monkeypatch.setattr(isolate.time, "monotonic", lambda: clock[0])
    calls, given = [], []
    inner = _in_process(calls)

    def runner(argv, timeout_s=None):
        given.append(timeout_s)
        clock[0] += 4.0 if len(calls) == 0 else 30.0      # the second child runs past the 10 s budget
        return inner(argv) if len(calls) == 0 else (calls.append(None) or isolate.ChildExit(1, stopped=True))
    rc = _isolated(monkeypatch, tmp_path, runner, time_budget=10.0)
    assert rc == 1 and given == [10.0, 6.0]
    rec = output.load(tmp_path / "out" / output.FILE)
    assert [(r["op"], r["batch"]) for r in rec["rows"]] == [ROUNDS[0]]
    assert [(d["op"], d["batch"], d["reason"]) for d in rec["not_reached"]] == [
        (op, b, "time budget") for op, b in ROUNDS[1:]]
    assert any(f"reached in {ROUNDS[1][0]} T=1 B={ROUNDS[1][1]}: its process was stopped" in n
               for n in rec["notes"]["run"])


def test_a_child_that_ends_on_its_own_past_the_deadline_is_not_called_stopped(monkeypatch, tmp_path):
    """"Stopped" comes from the stop itself: a child that finished its row on its own just after the
    budget's end keeps its row with no stop note; the shapes after it are listed as "time budget"."""
    clock = [0.0]
    monkeypatch.setattr(isolate.time, "monotonic", lambda: clock[0])
    calls = []
    inner = _in_process(calls)

    def runner(argv, timeout_s=None):
        clock[0] += 11.0                                  # past the 10 s budget, but it ended by itself
        return inner(argv)
    rc = _isolated(monkeypatch, tmp_path, runner, time_budget=10.0)
    rec = output.load(tmp_path / "out" / output.FILE)
    assert rc == 1 and [(r["op"], r["batch"]) for r in rec["rows"]] == [ROUNDS[0]]
    assert not any("its process was stopped" in n for n in rec["notes"].get("run", []))
    assert [(d["op"], d["batch"], d["reason"]) for d in rec["not_reached"]] == [
        (op, b, "time budget") for op, b in ROUNDS[1:]]


def test_run_child_stops_a_child_at_its_deadline(monkeypatch):
    """A real child past its deadline gets SIGTERM (its record-writing exit), not an endless wait."""
    import subprocess
    import sys
    import time

    real = subprocess.Popen
    sleeper = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); "
               "print('ready', flush=True); time.sleep(60)")
    monkeypatch.setattr(isolate.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", sleeper], **kw))
    t0 = time.monotonic()
    assert isolate.run_child(["bench"], timeout_s=1.0) == (3, True)
    assert time.monotonic() - t0 < 20


def test_a_sigterm_in_a_child_keeps_the_rows_before_and_lists_the_rest(monkeypatch, tmp_path):
    calls = []
    inner = _in_process(calls)

    def runner(argv, timeout_s=None):
        if len(calls) == 3:
            raise run.Interrupted("SIGTERM")
        return inner(argv)
    before = signal.getsignal(signal.SIGTERM)
    rc = _isolated(monkeypatch, tmp_path, runner)
    assert rc == 1 and signal.getsignal(signal.SIGTERM) == before
    rec = output.load(tmp_path / "out" / output.FILE)
    assert sorted((r["op"], r["batch"]) for r in rec["rows"]) == sorted(ROUNDS[:3])
    assert [(d["op"], d["batch"], d["reason"]) for d in rec["not_reached"]] == [
        (op, b, "interrupted (Interrupted: SIGTERM)") for op, b in ROUNDS[3:]]


def test_a_child_gets_only_its_own_ops_peers_and_knobs():
    args = argparse.Namespace(candidate="fused", variants=True, profile_kernels="torch",
                              peer=["router_topk:p=m:f", "moe_experts_mxfp4:q=m:g"],
                              knobs=["mla_decode_attn:context=8", "router_topk:n_experts=64"])
    argv = isolate.child_argv(args, "router_topk", 8, 64, ["a.json", "b.json"], "o")
    assert argv == ["bench", "--ops", "router_topk", "--tp", "8", "--batch", "64", "--candidate", "fused",
                    "--certificate", "a.json,b.json", "--out", "o", "--peer", "router_topk:p=m:f",
                    "--knobs", "router_topk:n_experts=64", "--variants", "--profile-kernels", "torch"]
    assert _parse(argv).ops == "router_topk"


def test_groups_follow_the_rounds_and_keep_an_ops_knob_sets_together():
    op = get_op("mla_decode_attn")
    gs = isolate.groups([(o, shapes.shapes_for(o, [1, 8], [1, 64])[0]) for o in (op, get_op("router_topk"))])
    assert [(o.name, t, b) for o, t, b, _ in gs][:2] == [("mla_decode_attn", 1, 1), ("mla_decode_attn", 8, 1)]
    assert all(len(ss) == max(1, len(op.bench_knobs)) for o, t, b, ss in gs if o is op)
    assert all(s.batch == b and s.tp == t for o, t, b, ss in gs for s in ss)


def test_isolate_with_spec_decode_is_one_line():
    r = _cli("bench", "--isolate", "--spec-decode", "checkpoints")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "verify-kernels: error: --isolate: applies to op rows, not to --spec-decode designs"]


@pytest.mark.parametrize("rc, text", [(-9, "killed by SIGKILL"), (3, "exit status 3"), (-200, "killed by signal 200")])
def test_exit_text(rc, text):
    assert isolate.exit_text(rc) == text


def test_a_real_child_process_that_exits_is_listed_with_its_status(monkeypatch, tmp_path, capfd):
    """The spawn itself: without a GPU the child bench exits 2 with its one line, and the parent lists
    the row's shape with that exit."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _dry_gate(monkeypatch, OPS)
    cert = tmp_path / "c.json"
    cert.write_text("{}")
    args = _bench_args(candidate="fused", variants=False, peer=[], knobs=[])
    rc = isolate.bench_isolated(args, [get_op("router_topk")], ["fused"], [1], [1], [str(cert)], tmp_path / "out",
                                ["bench", "--isolate"], device="cpu")
    assert rc == 1
    assert "verify-kernels bench: needs a CUDA device" in capfd.readouterr().err
    rec = output.load(tmp_path / "out" / output.FILE)
    assert rec["rows"] == [] and [(d["op"], d["reason"]) for d in rec["not_reached"]] == [
        ("router_topk", "its process ended (exit status 2) before timing it")]


def test_an_entry_failing_the_same_way_in_two_children_is_not_tried_in_the_next(monkeypatch, tmp_path):
    """The children share the failure counts, as the shapes of one process do: a compile that fails
    the same way at two rows of an op costs no third compile; another op keeps its own count."""
    import os

    tried = []

    def entries(op, allowed_fns, device="cuda"):
        def broken(s):
            tried.append(op.name)
            raise RuntimeError("inductor: the compile failed")
        return {"compiled": broken, "fused": lambda s: (lambda: None)}, {}, {}

    monkeypatch.delenv(isolate.FAILURES_ENV, raising=False)
    calls = []
    rc = _isolated(monkeypatch, tmp_path, _in_process(calls), entries=entries)
    assert rc == 0
    assert sorted(tried) == sorted(OPS * run.GIVE_UP_AFTER)
    rec = output.load(tmp_path / "out" / output.FILE)
    for op in OPS:
        by_b = {r["batch"]: r["errors"]["compiled"] for r in rec["rows"] if r["op"] == op}
        assert by_b[1].startswith("RuntimeError: inductor") and by_b[4] == by_b[1], by_b
        assert by_b[2].startswith("not tried: the same error at the 2 shapes before: RuntimeError"), by_b
        assert all("fused" in r["timings"] for r in rec["rows"] if r["op"] == op)
    assert isolate.FAILURES_ENV not in os.environ


def test_a_child_reads_no_failures_from_a_missing_or_broken_handover(monkeypatch):
    monkeypatch.delenv(isolate.FAILURES_ENV, raising=False)
    assert isolate.inherited_failures() == {}
    monkeypatch.setenv(isolate.FAILURES_ENV, "{not json")
    assert isolate.inherited_failures() == {}
    monkeypatch.setenv(isolate.FAILURES_ENV, '{"router_topk": {"compiled": ["E", 2]}}')
    assert isolate.inherited_failures() == {"router_topk": {"compiled": ["E", 2]}}
