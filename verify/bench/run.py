"""One bench run: for each op and shape, time the candidates beside the reference eager, torch.compile
of it, the op's peers and the floor, on the same rotated input sets; judge each candidate's row.

Anything that fails to prepare or time (an import, a compile, a capture, a kernel error) is that
entry's error in its row, never the end of the run. The shapes run in rounds, one batch size of
every op per round, in each op's coverage order (B = 1, 64, 8, 2, 16, 4, 32): a time budget that
stops starting new shapes, or a SIGTERM, cuts the last rounds of every op alike, and every op keeps
a spread of batches. The shapes not timed are listed with the reason.

Each entry of a layer op (LAUNCH_FAMILIES) also gets its kernel launches per call counted
(verify.bench.launches) after its timing, on the same launch: a count that fails is that entry's
count error, never the run's. An op's integer state (an MLA layer's seq_lens) is put back before
each call of an op-form entry, as the stock layer's step does inside its graph, so that repeated
calls of one step write the same cache slot instead of running out of pages; after each entry it is
put back to the set's start, and the entry's launches are collected before the next is prepared.

A candidate whose module declares a step launch for the op (`<op>_step_peer`, the peer protocol:
prepare(tensors, params) -> launch, e.g. stock.layers:kda_layer_step_peer beside its registry form
stock.layers:layer_steps) is timed through it: its layer prepared once, untimed, and one step per
call, as the stock peer is; the step launch is checked against the reference like a whole-op peer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from verify.bench import floor, peer_check, score, shapes, timing

EAGER, COMPILED, FLOOR = "eager", "compiled", "floor"
LAUNCH_FAMILIES = ("layers",)       # ops whose entries' launches per call are counted and reported


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
    variants: bool = False                      # also time each candidate's declared launch variants
    counter: Callable | None = None             # launch -> launches record (count_entry when None)
    failures: dict[str, dict] = field(default_factory=dict)   # op -> entry -> [error, shapes in a row] so far


def _op_launch(fn, op=None):
    """input set -> a launch of fn on it; the op's integer state tensors are put back to the set's
    starting values before each call (a copy on the device, inside the timed launch). `make.fn` is fn."""
    def make(s):
        ints = [] if op is None else _integer_state_names(op, s)
        if not ints:
            return lambda: fn(**s.tensors, **s.params)
        start = {n: s.tensors[n].clone() for n in ints}

        def launch():
            for n, v in start.items():
                s.tensors[n].copy_(v)
            return fn(**s.tensors, **s.params)
        return launch
    make.fn = fn
    return make


def counts_launches(op) -> bool:
    return op.family in LAUNCH_FAMILIES


STEP_SUFFIX = "_step_peer"


def step_launch_of(op, label: str):
    """The candidate's step launch for the op (its module's `<op name>_step_peer`), or None where the
    module declares none (the candidate is then timed through its registry form)."""
    import importlib

    from verify.ops.registry import import_callable

    path = op.fused if label == "fused" else label if ":" in label else None
    if not path:
        return None
    module = path.split(":", 1)[0]
    if not hasattr(importlib.import_module(module), op.name + STEP_SUFFIX):
        return None
    return import_callable(f"{module}:{op.name}{STEP_SUFFIX}")


def count_entry(launch) -> dict:
    """Kernel launches of one call of `launch` (verify.bench.launches.count_launches: CUDA graph
    nodes, else the profiler's kernels); bench_shape records what it raises as the count's error."""
    from verify.bench.launches import count_launches

    return count_launches(launch).to_json()


def compiled_launch(op):
    """torch.compile of the reference as the harness builds it (verify.judge.candidates.compiled_fn:
    dynamic shapes); where a call of it raises, torch.compile of the reference with static shapes for
    the rest of the run (one compile per shape), its cause kept in `fn.static_because` for the row's
    notes. torch 2.11's inductor fails K3 layer steps at B >= 8 under dynamic shapes (a NameError in
    its generated code), and the speed rule needs a compiled time at every shape. A call that failed
    may have written part of the op's state before the static call runs: the entry is timed, not judged."""
    import torch

    from verify.judge.calls import one_line
    from verify.judge.candidates import compiled_fn, reference_fn

    dynamic, static = compiled_fn(op.name), None

    def fn(**kwargs):
        nonlocal static
        if static is None:
            try:
                return dynamic(**kwargs)
            except Exception as e:  # noqa: BLE001  (any failure of the dynamic compile: the static one is tried)
                fn.static_because = one_line(e)
                static = torch.compile(reference_fn(op), dynamic=False, fullgraph=False)
        return static(**kwargs)
    fn.static_because = None
    return fn


def _peer_launch(prepare):
    return lambda s: prepare(s.tensors, s.params)


def entries_for(op, allowed: dict[str, Callable], device: str = "cuda"
                ) -> tuple[dict[str, Callable], dict[str, str], dict[str, Callable]]:
    """name -> (input set -> launch) for the baselines, the peers and the allowed candidates; name ->
    error for those that cannot even be resolved here; and name -> prepare of each whole-op peer and
    each candidate's step launch (step_launch_of), the ones checked against the reference (peer_check)."""
    from verify.judge.candidates import reference_fn
    from verify.ops.registry import import_callable

    makers, errors, whole = {}, {}, {}
    for name, resolve in ((EAGER, lambda: reference_fn(op)), (COMPILED, lambda: compiled_launch(op))):
        try:
            makers[name] = _op_launch(resolve(), op)
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
            try:
                step = step_launch_of(op, label)
            except Exception as e:  # noqa: BLE001  (a step launch that cannot be imported: the label's error)
                errors[label] = _error_line(e)
                continue
            makers[label] = _op_launch(fn, op) if step is None else _peer_launch(step)
            if step is not None:
                whole[label] = step
    if device == "cuda":
        parallel_compile()
    return makers, errors, whole


def variant_makers(allowed: dict[str, Callable], inputs) -> dict[str, Callable]:
    """"LABEL@VARIANT" -> (input set -> launch) for every launch variant the module of
    each allowed candidate declares at this shape (`variants(tensors, params)`, the declaration the
    certification judges every variant by: verify.judge.pipeline.launch_variants)."""
    from verify.judge.pipeline import launch_variants

    out = {}
    for label, fn in allowed.items():
        if label in (EAGER, COMPILED, "reference"):
            continue
        for prefix, launch in launch_variants(fn, inputs)[1:]:
            name = prefix.removeprefix("variant ").removesuffix(": ")
            out[f"{label}@{name}"] = _op_launch(launch)
    return out


def fastest_variants(row: dict) -> None:
    """row["variants"][label]: the fastest of the label's variants timed here, its median, the
    dispatcher's (the candidate's own entry) and their ratio (> 1: the dispatcher's pick is slower)."""
    med = {k: v.get("median_us") for k, v in row.get("variant_timings", {}).items()}
    for label in row["candidates"]:
        mine = {k.split("@", 1)[1]: us for k, us in med.items() if k.startswith(label + "@") and us is not None}
        pick = row["timings"].get(label, {}).get("median_us")
        if not mine:
            continue
        best = min(mine, key=mine.get)
        row.setdefault("variants", {})[label] = {
            "fastest": best, "fastest_us": mine[best], "dispatcher_us": pick, "timed": len(mine),
            "dispatcher_over_fastest": None if pick is None else round(pick / mine[best], 3)}


def parallel_compile() -> None:
    """Inductor compiles its kernels in torch's worker pool sized by the host's cores (torch's own
    default). compiled_fn pins one thread for the harness's 2-core CPU runs; on a GPU host the
    reference's Triton kernels then compile one by one. The generated code is the same either way."""
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor.async_compile import AsyncCompile

        inductor_config.compile_threads = inductor_config.decide_compile_threads()
        AsyncCompile.warm_pool()           # start the pool now: until its workers are up, inductor
        AsyncCompile.use_process_pool()    # compiles in-process
    except Exception:  # noqa: BLE001  (a torch without these: its own default stands)
        pass


def _device_sets(inputs, n: int, device: str) -> list:
    from verify.model.opdef import OpInputs

    first = OpInputs({k: v.to(device) for k, v in inputs.tensors.items()}, dict(inputs.params))
    return [first] + [OpInputs({k: v.clone() for k, v in first.tensors.items()}, dict(first.params))
                      for _ in range(n - 1)]


def _error_line(e: Exception) -> str:
    """An entry's error for its row: the type, the message's first line (300 characters at most) and
    the file and line that raised it (verify.judge.calls.one_line); the whole traceback goes to stderr."""
    import sys
    import traceback

    from verify.judge.calls import one_line

    traceback.print_exception(e, file=sys.stderr)
    return one_line(e)


GIVE_UP_AFTER = 2       # an entry that failed with the same error at this many shapes in a row is not tried again


NOT_TRIED = "not tried:"   # how a given-up entry's error starts in its row


def _given_up(failures: dict, name: str) -> str | None:
    f = failures.get(name)
    if f is None or f[1] < GIVE_UP_AFTER:
        return None
    return f"{NOT_TRIED} the same error at the {f[1]} shapes before: {f[0]}"[:300]


def _note_failure(failures: dict, name: str, err: str | None) -> None:
    """Count consecutive identical errors per entry (a success or another error restarts the count)."""
    if err is None:
        failures.pop(name, None)
        return
    prev = failures.get(name)
    failures[name] = [err, prev[1] + 1 if prev and prev[0] == err else 1]


def note_row_failures(failures: dict, row: dict) -> None:
    """The failure counts of one op carried past a row timed elsewhere (a `bench --isolate` child):
    each timed entry restarts its count, each entry's error counts as it would have here (an entry
    given up there was not tried: its count stays)."""
    for name in row.get("timings", {}):
        _note_failure(failures, name, None)
    for name, err in row.get("errors", {}).items():
        if name != "inputs" and not name.startswith(f"{FLOOR}:") and not err.startswith(NOT_TRIED):
            _note_failure(failures, name, err)


def bench_shape(op, shape, inputs, makers: dict, errors: dict, candidates: list[str], clock, device: str,
                profile: Callable | None = None, timing_kw: dict | None = None, checks: dict | None = None,
                failures: dict | None = None, variants: dict | None = None, counter: Callable | None = None) -> dict:
    """One row: every entry timed over the same rotated sets, the floor, and each candidate judged;
    each whole-op peer in `checks` (name -> prepare) first run against the reference once.

    failures (kept by the caller across one op's shapes): an entry that failed with the same error at
    GIVE_UP_AFTER shapes in a row is not tried again (a compile that fails would cost its compile
    time at every shape); its row says so. variants (variant_makers): timed on the same sets into
    row["variant_timings"], unjudged, and summarised by fastest_variants. counter (launch -> record,
    count_entry): each timed entry's launches per call into row["launches"], counted after its timing."""
    failures = {} if failures is None else failures
    nbytes = floor.declared_bytes(op, inputs)
    n_sets = timing.sets_needed(max(floor.input_bytes(inputs.tensors), nbytes or 0))
    row = {"op": op.name, "shape": shape.label, **shape.to_dict(), "bytes": nbytes, "sets": n_sets,
           "candidates": list(candidates), "timings": {}, "errors": dict(errors), "judged": {}}
    sets = _device_sets(inputs, n_sets, device)
    ints = _integer_state(op, sets)
    if checks:
        from verify.judge.candidates import reference_fn

        row["peer_checks"] = {}
        for name, prepare in checks.items():
            if _given_up(failures, name):
                row["peer_checks"][name] = "not checked: the peer is not tried (see its error)"
                continue
            try:
                row["peer_checks"][name] = peer_check.check(op, sets[0], reference_fn(op), prepare)
            except Exception as e:  # noqa: BLE001
                row["peer_checks"][name] = f"not checked: {type(e).__name__}: {e}"[:300]
    try:
        for name, make in makers.items():
            skip = _given_up(failures, name)
            if skip:
                row["errors"][name] = skip
                continue
            err = None
            _reset_peak(device)
            try:
                launches = [make(s) for s in sets]
                row["timings"][name] = timing.time_launches(launches, clock, **(timing_kw or {})).to_dict()
                if profile is not None:
                    profile(op.name, shape.label, name, launches)
            except Exception as e:  # noqa: BLE001  (one entry's failure is its row's error)
                err = row["errors"][name] = _error_line(e)
            if counter is not None and err is None:
                try:
                    count = counter(launches[0])
                except Exception as e:  # noqa: BLE001  (a count that fails is the count's error)
                    count = {"error": _error_line(e)}
                row.setdefault("launches", {})[name] = count
            _note_failure(failures, name, err)
            why = getattr(getattr(make, "fn", None), "static_because", None)
            if why and err is None:
                row.setdefault("static_compile", {})[name] = why
            launches = None
            _put_back(ints)
            _release(device)
            mem = _memory(device)
            if mem is not None:
                row.setdefault("memory_gb", {})[name] = mem
        for name, make in (variants or {}).items():
            try:
                row.setdefault("variant_timings", {})[name] = timing.time_launches(
                    [make(s) for s in sets], clock, **(timing_kw or {})).to_dict()
            except Exception as e:  # noqa: BLE001  (a variant that cannot run at this shape: its error)
                row["errors"][name] = _error_line(e)
            _put_back(ints)
        if variants:
            fastest_variants(row)
        if nbytes:
            kinds = {}
            for kind in floor.FLOOR_KINDS:
                try:
                    kinds[kind] = timing.time_launches(floor.floor_launches(nbytes, n_sets, device, kind), clock,
                                                       **(timing_kw or {})).to_dict()
                except Exception as e:  # noqa: BLE001
                    row["errors"][f"{FLOOR}:{kind}"] = f"{type(e).__name__}: {e}"[:300]
            timed = {k: v for k, v in kinds.items() if v.get("median_us") is not None}
            if timed:                       # the faster copy is the floor (floor.py says why)
                best = min(timed, key=lambda k: timed[k]["median_us"])
                row["timings"][FLOOR] = timed[best] | {"kind": best}
                row["floor_copies"] = {k: v["median_us"] for k, v in timed.items()}
            else:
                row["errors"][FLOOR] = "no copy of the declared bytes could be timed"
        else:
            row["errors"][FLOOR] = f"{op.name} declares no moved_bytes"
    finally:
        del sets
    judge_row(row, [p.name for p in op.peers])
    return row


def _reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _memory(device: str) -> dict | None:
    """On CUDA, after an entry: the allocator's peak during it and what stays allocated and reserved
    once its launches are collected (GB), and the card's free memory: a row cut by an out-of-memory
    error says which entry held what."""
    if device != "cuda":
        return None
    import torch

    free, _ = torch.cuda.mem_get_info()
    gb = 1e-9
    return {"peak": round(torch.cuda.max_memory_allocated() * gb, 2),
            "after": round(torch.cuda.memory_allocated() * gb, 2),
            "reserved": round(torch.cuda.memory_reserved() * gb, 2), "free": round(free * gb, 2)}


def _integer_state_names(op, s) -> list[str]:
    """The op's integer state tensors in input set `s` (an MLA layer's seq_lens)."""
    return [n for n in op.state if n in s.tensors and not s.tensors[n].is_floating_point()]


def _integer_state(op, sets) -> list[tuple]:
    """(tensor, its starting copy) for each integer state tensor of each set."""
    return [(s.tensors[n], s.tensors[n].clone()) for s in sets for n in _integer_state_names(op, s)]


def _put_back(ints: list[tuple]) -> None:
    """Each set's integer state back to its start after an entry: an op-form launch puts it back before
    each call, so its last call leaves it advanced, and the next entry's step launch (prepared from the
    set) would start one token on, past a sequence's last allocated page."""
    for t, start in ints:
        t.copy_(start)


def _release(device: str) -> None:
    """After each entry: its launches (prepared weights, captured graphs and their pools) collected and
    the allocator's cache returned, so that the next entry of a K3 layer row is prepared in the memory
    they held, not beside it."""
    import gc

    gc.collect()
    _free(device)


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


class Interrupted(BaseException):
    """The run was told to stop (SIGTERM, as `timeout` sends): a BaseException, so no entry's
    `except Exception` takes it for that entry's error."""


def untimed_row(op, shape, candidates: list[str], why: str) -> dict:
    """A row of the plan that is not timed, saying why (counted in the score's shapes)."""
    return {"op": op.name, "shape": shape.label, **shape.to_dict(), "bytes": None, "sets": 0,
            "candidates": list(candidates), "timings": {}, "judged": {}, "errors": {"not timed": why}}


def rounds(per_op: list[tuple[object, list]]) -> list[list[tuple[object, object]]]:
    """[(op, shape)] per round: round k holds the k-th batch size (in the op's shape order) of every
    op that has one, ops in plan order, each batch's shapes (T, knobs) together."""
    out: list[list] = []
    for op, op_shapes in per_op:
        by_batch: dict[int, list] = {}
        for s in op_shapes:
            by_batch.setdefault(s.batch, []).append(s)
        for k, group in enumerate(by_batch.values()):
            if k == len(out):
                out.append([])
            out[k] += [(op, s) for s in group]
    return out


def bench_all(plan: Plan, clock, on_row: Callable[[dict, dict], None], profile: Callable | None = None,
              timing_kw: dict | None = None, on_round: Callable[[dict], None] | None = None) -> dict:
    """Every shape of the plan, round by round (`rounds`). Returns {"rows", "not_reached", "notes"}.

    After each row, on_row(row, state) gets the state so far, whose not_reached lists every shape not
    yet timed ("pending"): a record written from it and then cut keeps the plan's rest; on_round(state)
    after each round. An op with no allowed candidate gets untimed rows (no baseline is timed for
    nothing). Past plan.budget_s no new shape starts ("time budget"); an Interrupted (or
    KeyboardInterrupt) ends the run between two steps ("interrupted"); either way the state so far
    is returned."""
    start = time.monotonic()
    per_op, rows, notes = plan_shapes(plan)
    not_reached = []
    plan_rounds = rounds(per_op)
    todo = [x for r in plan_rounds for x in r]
    pending = [s.to_dict() | {"reason": "pending"} for _, s in todo]
    round_end = {id(r[-1][1]) for r in plan_rounds if r}

    def state() -> dict:
        return {"rows": rows, "not_reached": not_reached + pending,
                "notes": {k: v for k, v in notes.items() if v}}

    cache, entries = shapes.InputCache(plan.device), {}
    largest = {op.name: max((s.batch for s in ss), default=1) for op, ss in per_op}
    try:
        for op, shape in todo:
            pending.pop(0)
            if past_budget(plan.budget_s, start, [shape], len(pending), not_reached, notes):
                continue
            t0 = time.monotonic()
            cands = plan.candidates.get(op.name, [])
            try:
                if op.name not in entries:
                    entries[op.name] = (*entries_for(op, plan.allowed[op.name], plan.device),
                                        {k: list(v) for k, v in plan.failures.get(op.name, {}).items()})
                makers, errors, checks, failures = entries[op.name]
                inputs = cache.inputs(op, shape, largest[op.name])
                row = bench_shape(op, shape, inputs, makers, errors, cands, clock, plan.device, profile,
                                  timing_kw, checks, failures,
                                  variant_makers(plan.allowed[op.name], inputs) if plan.variants else None,
                                  (plan.counter or count_entry) if counts_launches(op) else None)
            except Exception as e:  # noqa: BLE001  (inputs or a split that cannot be built: the row says so)
                row = untimed_row(op, shape, cands, "")
                row["errors"] = {"inputs": f"{type(e).__name__}: {e}"[:300]}
            except BaseException:
                pending.insert(0, shape.to_dict() | {"reason": "pending"})
                raise
            row["seconds"] = round(time.monotonic() - t0, 2)
            for name, why in row.get("static_compile", {}).items():
                notes.setdefault(op.name, []).append(
                    f"{name} at {shape.label}: timed with static shapes (torch.compile with dynamic shapes raised {why})")
            rows.append(row)
            on_row(row, state())
            try:
                _free(plan.device)
            except Exception as e:  # noqa: BLE001  (a sticky device error: every later shape would fail alike)
                why = f"device error after {op.name} {shape.label}: {type(e).__name__}: {e}"
                raise Interrupted(why[:300]) from None
            if on_round is not None and id(shape) in round_end:
                on_round(state())
    except (Interrupted, KeyboardInterrupt) as e:
        why = interrupted(e, start, notes)
        not_reached.extend(d | {"reason": why} for d in pending)
        pending.clear()
    sort_rows(rows, plan.ops)
    return state()


def plan_shapes(plan: Plan) -> tuple[list[tuple[object, list]], list[dict], dict[str, list[str]]]:
    """(op, its shapes) of each op with an allowed candidate; an untimed row per shape of each op
    without one (no baseline is timed for nothing); the plan's notes with each op's shape notes."""
    notes = {k: list(v) for k, v in plan.notes.items()}
    per_op, rows = [], []
    for op in plan.ops:
        op_shapes, op_notes = shapes.shapes_for(op, plan.tps, plan.batches)
        notes.setdefault(op.name, []).extend(op_notes)
        if plan.allowed.get(op.name):
            per_op.append((op, op_shapes))
        else:
            why = "no asked candidate holds a passing verdict for this op (see refused)"
            rows += [untimed_row(op, s, plan.candidates.get(op.name, []), why) for s in op_shapes]
    return per_op, rows, notes


def past_budget(budget_s: float | None, start: float, group: list, left: int, not_reached: list,
                notes: dict) -> bool:
    """Past the time budget: the group's shapes listed ("time budget") and, the first time, a run note
    counting them and the `left` shapes after them. False within it."""
    if budget_s is None or time.monotonic() - start <= budget_s:
        return False
    if not any(d["reason"] == "time budget" for d in not_reached):
        notes.setdefault("run", []).append(f"time budget of {budget_s:g} s reached after "
                                           f"{time.monotonic() - start:.0f} s: {len(group) + left} shapes not started")
    not_reached.extend(s.to_dict() | {"reason": "time budget"} for s in group)
    return True


def interrupted(e: BaseException, start: float, notes: dict) -> str:
    """The reason of the shapes a stop left untimed; the run note saying when."""
    why = f"interrupted ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
    notes.setdefault("run", []).append(f"{why} after {time.monotonic() - start:.0f} s")
    return why


def sort_rows(rows: list[dict], ops: list) -> None:
    """Rows in the plan's op order, then knobs, T and B (in place)."""
    order = {op.name: i for i, op in enumerate(ops)}
    rows.sort(key=lambda r: (order.get(r["op"], len(order)), sorted(r["knobs"].items()), r["tp"], r["batch"]))


def _free(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
