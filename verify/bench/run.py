"""One bench run: for each op and shape, time the candidates beside the reference eager, torch.compile
of it, the op's peers and the floor, on the same rotated input sets; judge each candidate's row.

Anything that fails to prepare or time (an import, a compile, a capture, a kernel error) is that
entry's error in its row, never the end of the run. A time budget, shared out evenly over the ops
(time an op leaves unused passes on), stops starting new shapes; the shapes not reached are listed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from verify.bench import floor, peer_check, score, shapes, timing

EAGER, COMPILED, FLOOR = "eager", "compiled", "floor"


@dataclass
class Plan:
    """What to time: per op, the candidate labels asked for and the (label -> fn) of those allowed."""
    ops: list
    candidates: dict[str, list[str]]            # op -> labels that apply to it (refused ones included)
    allowed: dict[str, dict[str, Callable]]     # op -> label -> function with the op's signature
    tps: list[int]
    batches: list[int]
    device: str = "cuda"
    budget_s: float | None = None
    notes: dict[str, list[str]] = field(default_factory=dict)


def _op_launch(fn):
    return lambda s: (lambda: fn(**s.tensors, **s.params))


def _peer_launch(prepare):
    return lambda s: prepare(s.tensors, s.params)


def entries_for(op, allowed: dict[str, Callable]) -> tuple[dict[str, Callable], dict[str, str], dict[str, Callable]]:
    """name -> (input set -> launch) for the baselines, the peers and the allowed candidates; name ->
    error for those that cannot even be resolved here; and name -> prepare of each whole-op peer (the
    ones checked against the reference, peer_check)."""
    from verify.judge.candidates import compiled_fn, reference_fn
    from verify.ops.registry import import_callable

    makers, errors, whole = {}, {}, {}
    for name, resolve in ((EAGER, lambda: reference_fn(op)), (COMPILED, lambda: compiled_fn(op.name))):
        try:
            makers[name] = _op_launch(resolve())
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    for peer in op.peers:
        try:
            prepare = import_callable(peer.prepare)
            makers[f"peer:{peer.name}"] = _peer_launch(prepare)
            if not peer.part:
                whole[f"peer:{peer.name}"] = prepare
        except Exception as e:  # noqa: BLE001
            errors[f"peer:{peer.name}"] = f"{type(e).__name__}: {e}"[:300]
    for label, fn in allowed.items():
        if label not in (EAGER, COMPILED, "reference"):
            makers[label] = _op_launch(fn)
    return makers, errors, whole


def _device_sets(inputs, n: int, device: str) -> list:
    from verify.model.opdef import OpInputs

    first = OpInputs({k: v.to(device) for k, v in inputs.tensors.items()}, dict(inputs.params))
    return [first] + [OpInputs({k: v.clone() for k, v in first.tensors.items()}, dict(first.params))
                      for _ in range(n - 1)]


def bench_shape(op, shape, inputs, makers: dict, errors: dict, candidates: list[str], clock, device: str,
                profile: Callable | None = None, timing_kw: dict | None = None, checks: dict | None = None) -> dict:
    """One row: every entry timed over the same rotated sets, the floor, and each candidate judged;
    each whole-op peer in `checks` (name -> prepare) first run against the reference once."""
    nbytes = floor.declared_bytes(op, inputs)
    n_sets = timing.sets_needed(max(floor.input_bytes(inputs.tensors), nbytes or 0))
    row = {"op": op.name, "shape": shape.label, **shape.to_dict(), "bytes": nbytes, "sets": n_sets,
           "candidates": list(candidates), "timings": {}, "errors": dict(errors), "judged": {}}
    sets = _device_sets(inputs, n_sets, device)
    if checks:
        from verify.judge.candidates import reference_fn

        row["peer_checks"] = {}
        for name, prepare in checks.items():
            try:
                row["peer_checks"][name] = peer_check.check(op, sets[0], reference_fn(op), prepare)
            except Exception as e:  # noqa: BLE001
                row["peer_checks"][name] = f"not checked: {type(e).__name__}: {e}"[:300]
    try:
        for name, make in makers.items():
            try:
                launches = [make(s) for s in sets]
                row["timings"][name] = timing.time_launches(launches, clock, **(timing_kw or {})).to_dict()
                if profile is not None:
                    profile(op.name, shape.label, name, launches)
            except Exception as e:  # noqa: BLE001  (one entry's failure is its row's error)
                row["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        if nbytes:
            try:
                row["timings"][FLOOR] = timing.time_launches(floor.floor_launches(nbytes, n_sets, device), clock,
                                                             **(timing_kw or {})).to_dict()
            except Exception as e:  # noqa: BLE001
                row["errors"][FLOOR] = f"{type(e).__name__}: {e}"[:300]
        else:
            row["errors"][FLOOR] = f"{op.name} declares no moved_bytes"
    finally:
        del sets
    judge_row(row, [p.name for p in op.peers])
    return row


def judge_row(row: dict, peer_names: list[str]) -> None:
    """Each timed candidate against eager, compiled, every declared peer and the floor (in place)."""
    med = {k: v.get("median_us") for k, v in row["timings"].items()}
    for cand in row["candidates"]:
        label = EAGER if cand == "reference" else cand
        us = med.get(label)
        if us is None:
            continue
        baselines = {b: med.get(b) for b in (EAGER, COMPILED) if b != label}
        baselines.update({f"peer:{p}": med.get(f"peer:{p}") for p in peer_names})
        verdict = score.judge(us, baselines, med.get(FLOOR))
        verdict["speedup"] = score.speedups(us, {k: v for k, v in med.items() if k not in (label, FLOOR)})
        row["judged"][cand] = verdict


def bench_all(plan: Plan, clock, on_row: Callable[[dict], None], profile: Callable | None = None,
              timing_kw: dict | None = None) -> dict:
    """Every op of the plan, shape by shape. Returns {"rows": [...], "not_reached": [...], "notes": {...}}."""
    rows, not_reached, notes = [], [], dict(plan.notes)
    start = time.monotonic()
    cache = shapes.InputCache()
    for i, op in enumerate(plan.ops):
        op_shapes, op_notes = shapes.shapes_for(op, plan.tps, plan.batches)
        notes.setdefault(op.name, []).extend(op_notes)
        makers, errors, checks = entries_for(op, plan.allowed.get(op.name, {}))
        left = None if plan.budget_s is None else plan.budget_s - (time.monotonic() - start)
        deadline = None if left is None else time.monotonic() + left / (len(plan.ops) - i)
        largest = max((s.batch for s in op_shapes), default=1)
        for shape in op_shapes:
            if deadline is not None and time.monotonic() > deadline:
                not_reached.append(shape.to_dict())
                continue
            t0 = time.monotonic()
            try:
                inputs = cache.inputs(op, shape, largest)
                row = bench_shape(op, shape, inputs, makers, errors, plan.candidates.get(op.name, []), clock,
                                  plan.device, profile, timing_kw, checks)
            except Exception as e:  # noqa: BLE001  (inputs or a split that cannot be built: the row says so)
                row = {"op": op.name, "shape": shape.label, **shape.to_dict(), "bytes": None, "sets": 0,
                       "candidates": plan.candidates.get(op.name, []), "timings": {}, "judged": {},
                       "errors": {"inputs": f"{type(e).__name__}: {e}"[:300]}}
            row["seconds"] = round(time.monotonic() - t0, 2)
            rows.append(row)
            on_row(row)
            _free(plan.device)
    order = {op.name: i for i, op in enumerate(plan.ops)}
    rows.sort(key=lambda r: (order[r["op"]], sorted(r["knobs"].items()), r["tp"], r["batch"]))
    return {"rows": rows, "not_reached": not_reached, "notes": {k: v for k, v in notes.items() if v}}


def _free(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
