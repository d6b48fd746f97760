"""The bench's compiled entry: torch.compile of the reference with dynamic shapes, as the harness builds
it, and with static shapes where a call of that raises; the switch named in the row and the notes."""
from __future__ import annotations

import torch

from property_tests.test_bench import FAST, CountingClock
from verify.bench import run, shapes
from verify.judge import candidates
from verify.ops.registry import get_op


def _fakes(monkeypatch, fail: bool):
    compiles = []

    def dynamic_fn(name):
        def f(**kw):
            if fail:
                raise NameError("name 's15' is not defined")
            return candidates.reference_fn(get_op(name))(**kw)
        return f

    def compile_(fn, dynamic=None, fullgraph=None):
        compiles.append(dynamic)
        return fn
    monkeypatch.setattr(candidates, "compiled_fn", dynamic_fn)
    monkeypatch.setattr(torch, "compile", compile_)
    return compiles


def _inputs(op, batch=2):
    shape = shapes.Shape(op.name, 1, batch)
    return shape, op.make_inputs(shapes.case_for(op, shape))


def test_a_dynamic_compile_that_raises_is_replaced_by_a_static_one_once(monkeypatch):
    compiles = _fakes(monkeypatch, fail=True)
    op = get_op("router_topk")
    _, inputs = _inputs(op)
    fn = run.compiled_launch(op)
    want = candidates.reference_fn(op)(**inputs.tensors, **inputs.params)
    for _ in range(2):
        got = fn(**inputs.tensors, **inputs.params)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert compiles == [False]
    assert fn.static_because.startswith("NameError: name 's15' is not defined (at test_bench_compiled.py:")


def test_a_dynamic_compile_that_works_is_kept(monkeypatch):
    compiles = _fakes(monkeypatch, fail=False)
    op = get_op("router_topk")
    _, inputs = _inputs(op)
    fn = run.compiled_launch(op)
    fn(**inputs.tensors, **inputs.params)
    assert compiles == [] and fn.static_because is None


def test_the_row_and_the_run_notes_say_which_compile_was_timed(monkeypatch):
    _fakes(monkeypatch, fail=True)
    op = get_op("router_topk")
    plan = run.Plan(ops=[op], candidates={op.name: []}, allowed={op.name: {"reference": None}}, tps=[1],
                    batches=[1, 2], device="cpu")
    monkeypatch.setattr(run, "parallel_compile", lambda: None)
    res = run.bench_all(plan, CountingClock(), lambda row, st: None, timing_kw=FAST)
    assert all("compiled" in r["timings"] for r in res["rows"])
    assert all(r["static_compile"]["compiled"].startswith("NameError") for r in res["rows"])
    assert [n.split(":")[0] for n in res["notes"][op.name] if n.startswith("compiled at")] == [
        "compiled at T=1 B=1", "compiled at T=1 B=2"]
