"""One case through the pipeline: inputs -> oracle & baseline -> candidate under guards -> compare."""
from __future__ import annotations

import functools
import time
import traceback

import torch

from verify import compare, guards, process_state
from verify.case import Case
from verify.opdef import OpDef, OpInputs
from verify.specs import ToleranceSpec, load_spec
from verify.verdict import FAIL, PASS, VACUOUS, CaseVerdict, Check


class CandidateError(Exception):
    """The candidate raised; the message is one line naming the exception."""


def on_device(inputs: OpInputs, device) -> OpInputs:
    """The inputs copied to `device` once per case, for the candidate's guarded calls: each call
    places (and afterwards compares) its inputs from these, device to device, instead of copying
    every tensor from the host twice per call. The same tensors on the CPU."""
    if str(device) == "cpu":
        return inputs
    return OpInputs({k: v.to(device) for k, v in inputs.tensors.items()}, dict(inputs.params))


def to_oracle(inputs: OpInputs) -> OpInputs:
    """Exact upcast of every floating tensor to float64; integer tensors unchanged."""
    return OpInputs({k: v.to(torch.float64) if v.is_floating_point() else v.clone() for k, v in inputs.tensors.items()},
                    dict(inputs.params))


def _collect(op: OpDef, returned, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = op.outputs
    got = () if not names else ((returned,) if len(names) == 1 and not isinstance(returned, (tuple, list))
                                else tuple(returned))
    results = dict(zip(names, got))
    results.update({s: tensors[s] for s in op.state})
    return results


def run_plain(fn, op: OpDef, inputs: OpInputs, device) -> dict[str, torch.Tensor]:
    """Run a trusted function (the reference) on private copies; return outputs and state after."""
    tensors = {k: v.to(device).clone() for k, v in inputs.tensors.items()}
    return _collect(op, fn(**tensors, **inputs.params), tensors)


class CandidateExit(RuntimeError):
    """A candidate raised SystemExit: an in-process run (--no-isolate) judges it a failure and goes on,
    where it used to end the whole run with no certificate (session 18's probe)."""


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {msg[:300]}{where}"


class _Placed:
    """One candidate call's tensors: inputs (and state) in canary buffers, poisoned `out=` buffers
    for a destination-passing candidate, and the keyword arguments that pass them. `offset`: the
    inputs' (and state's) views start that many elements past an aligned base; outputs stay aligned."""

    def __init__(self, fn, op: OpDef, inputs: OpInputs, expected: dict[str, torch.Tensor], device,
                 strided: bool = False, offset: int = 0, out_offset: int = 0, use_out: bool = True,
                 owned: bool = False, merged: bool = False):
        self.op, self.device, self.expected = op, device, expected
        self.inputs = {k: guards.place(k, v, device, strided=strided, offset=offset, owned=owned)
                       for k, v in inputs.tensors.items()}
        for group in guards.merge_groups(inputs.tensors, op.state) if merged else ():
            self.inputs.update(guards.place_merged(group, inputs.tensors, device))
        self.outs: dict[str, guards.Guarded] = {}
        self.kwargs = {k: g.view for k, g in self.inputs.items()}
        if use_out and op.outputs and guards.accepts_out(fn):
            self.outs = {n: guards.place(n, expected[n], device, strided=False, poison=True, offset=out_offset)
                         for n in op.outputs}
            self.kwargs["out"] = tuple(self.outs[n].view for n in op.outputs) if len(op.outputs) > 1 \
                else self.outs[op.outputs[0]].view

    def launch(self, fn, params: dict):
        """The candidate on these tensors, with the allocator poisoned, not waited for (the caller
        synchronizes); raises what it raises."""
        guards.poison_allocator([self.expected[n] for n in self.op.outputs], self.device)
        with guards.poisoned_empty():
            try:
                return fn(**self.kwargs, **params)
            except SystemExit as e:      # sys.exit() in a candidate: its verdict, not the end of a
                raise CandidateExit(f"the candidate called sys.exit({e.code!r})") from None   # --no-isolate run

    def call(self, fn, params: dict):
        """launch(), then wait for the device."""
        returned = self.launch(fn, params)
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return returned

    def outputs(self, returned) -> tuple[dict[str, torch.Tensor], list[Check]]:
        """What it returned or wrote, matched to the op's outputs and state; type and aliasing checks."""
        results, checks = guards.check_outputs(self.op, returned, self.expected, self.inputs, self.outs)
        results.update({s: self.inputs[s].view for s in self.op.state})
        return results, checks

    def unwritten(self, results: dict[str, torch.Tensor]) -> list[Check]:
        """Poison left in an output (when every output came back)."""
        if len(results) != len(self.op.outputs) + len(self.op.state):
            return []
        return [guards.check_unwritten({n: results[n] for n in self.op.outputs}, self.expected)]


def guarded_call(fn, op: OpDef, inputs: OpInputs, expected: dict[str, torch.Tensor], device,
                 strided: bool = False, offset: int = 0, out_offset: int = 0, use_out: bool = True,
                 owned: bool = False, merged: bool = False) -> guards.CallResult:
    """Call the candidate once with every tensor in a canary buffer; check what it did."""
    placed = _Placed(fn, op, inputs, expected, device, strided, offset, out_offset, use_out, owned, merged)
    before = process_state.process_state(device)
    try:
        returned = placed.call(fn, inputs.params)
    except Exception as e:  # the candidate's own failure is a verdict, never a crash of the run
        process_state.restore_process_state(before, device)
        try:    # a refusal must not hide writes made before it (canaries, inputs), where they can be read
            wrote = guards.check_inputs_and_canaries(op, placed.inputs, inputs.tensors, placed.outs)
        except Exception:       # a sticky device error: the raise is the verdict
            wrote = []
        return guards.CallResult(checks=[c for c in wrote if not c.ok], error=_one_line(e))
    changed = process_state.restore_process_state(before, device)
    results, checks = placed.outputs(returned)
    inputs_and_canaries = functools.partial(guards.check_inputs_and_canaries, op, placed.inputs, inputs.tensors,
                                            placed.outs)
    checks += inputs_and_canaries()
    checks.append(process_state.process_state_check(changed))
    return guards.CallResult(results=results, checks=checks + placed.unwritten(results), recheck=inputs_and_canaries)


def judge(op: OpDef, spec: ToleranceSpec, cand: dict, oracle: dict, base: dict, inputs: OpInputs,
          inputs64: OpInputs, baseline_err: dict | None = None) -> list[Check]:
    """Compare every output and state tensor by its spec class. Tie-aware ids are judged first; the
    outputs that depend on them are then judged against the reference recomputed with the
    candidate's ids (OpDef.reweigh), so an allowed choice inside the tie band is not punished. Ids
    that fail their check are still reweighed where well-formed (weights right for wrong ids are not
    reported ~1e5x over tolerance); where malformed, the outputs that depend on them fail unjudged."""
    checks = []
    names = list(op.outputs + op.state)
    magnitudes = op.magnitudes(inputs64, cand) if op.magnitudes is not None else {}
    unjudged: dict[str, str] = {}        # output -> why it was not judged (its ids are malformed)
    at_failed_ids: dict[str, str] = {}   # output -> the note that it was judged at ids that failed
    for name in [n for n in names if spec.output(n).klass == "tie_aware_ids"]:
        if op.tie_scores is None:
            raise ValueError(f"op {op.name}: output {name} is tie_aware_ids but the OpDef has no tie_scores")
        c = cand[name]
        s64, swd = op.tie_scores(inputs64), op.tie_scores(inputs)
        checks.append(compare.compare_tie_aware_ids(name, c, s64.cpu().double(), swd.cpu(), c.shape[-1],
                                                    magnitudes.get(name)))
        if op.reweigh is None:
            continue
        why = compare.malformed_ids(c, tuple(base[name].shape), s64.shape[-1])
        if why:
            unjudged |= {n: f"not judged: the candidate's {name} are malformed ({why}), so no reference "
                         f"{n} exist for them" for n in op.reweigh(inputs, base[name])}
            continue
        oracle = {**oracle, **op.reweigh(inputs64, c.to(next(iter(oracle.values())).device))}
        reweighed = op.reweigh(inputs, c.to(next(iter(base.values())).device))
        base = {**base, **reweighed}
        baseline_err = None
        if not checks[-1].ok:
            at_failed_ids |= {n: f"judged at the candidate's {name}, which failed the {name} check" for n in reweighed}
    for name in names:
        out_spec = spec.output(name)
        c = cand[name]
        if name in unjudged:
            checks.append(Check(f"compare:{name}", False, unjudged[name]))
        elif out_spec.klass == "bitwise":
            checks.append(compare.compare_bitwise(name, c, base[name]))
        elif out_spec.klass == "derived":
            k, floor = out_spec.bounds(base[name].dtype)
            checks.append(compare.compare_derived(name, c, oracle[name], base[name], k, floor,
                                                  (baseline_err or {}).get(name), op.row_ndims.get(name, 1),
                                                  magnitudes.get(name), out_spec.element_floor_for(base[name].dtype)))
        if name in at_failed_ids and checks[-1].name == f"compare:{name}":
            done = checks[-1]
            checks[-1] = Check(done.name, done.ok, f"{done.detail}; {at_failed_ids[name]}", done.metrics, done.worst)
    return checks


def derived_vacuity(op: OpDef, spec: ToleranceSpec, oracle: dict) -> str | None:
    for name in op.outputs + op.state:
        if spec.output(name).klass == "derived":
            why = compare.vacuous_reason(oracle[name])
            if why:
                return f"{name}: {why}"
    return None


def permute_batch(op: OpDef, inputs: OpInputs, perm: torch.Tensor) -> OpInputs:
    t = {k: v.index_select(op.batch_dims[k], perm.to(v.device)) if k in op.batch_dims else v
         for k, v in inputs.tensors.items()}
    return OpInputs(t, dict(inputs.params))


def unpermute(op: OpDef, results: dict, perm: torch.Tensor) -> dict:
    inv = torch.argsort(perm)
    return {k: v.index_select(op.batch_dims[k], inv.to(v.device)) if k in op.batch_dims else v
            for k, v in results.items()}


def _keep(op: OpDef, label: str, results: dict) -> tuple[str, dict, dict]:
    """(label, a call's returned outputs and state, a copy of them) for outputs_kept."""
    live = {n: results[n] for n in (*op.outputs, *op.state) if n in results}
    return label, live, {n: t.clone() for n, t in live.items()}


def outputs_kept(kept: list[tuple[str, dict, dict]], later: str) -> Check:
    """guard:outputs_kept: a tensor a call returned is the caller's; no later call may change it. A
    candidate that returns a preallocated buffer (one per shape, or a ring of a few) passes every
    single-call check, while a caller holding the previous result (a decode loop, a residual
    stream) sees it overwritten. The copies taken after each launch's first call are compared bit for
    bit with the live tensors after the later calls."""
    name = "guard:outputs_kept"
    for label, live, copy in kept:
        changed = [n for n in live if not compare.compare_bitwise(n, live[n], copy[n]).ok]
        if changed:
            return Check(name, False, f"{label}the tensor{'s' if len(changed) > 1 else ''} "
                         f"{', '.join(changed)} returned by a first call changed during {later}: the "
                         "candidate hands out storage it writes again (a preallocated output buffer?)")
    return Check(name, True, f"returned outputs unchanged by {later}")


def written_after_return(call: guards.CallResult, later: str) -> list[Check]:
    """The call's inputs and canaries checked again once later calls have run: a write that lands
    after the call returned (a thread, a kernel on a stream the call did not wait for) passes the
    checks made at its return and corrupts the caller's tensors afterwards."""
    return [c if c.ok else Check(c.name, False, f"after {later} (a write landing after the call returned): {c.detail}")
            for c in call.recheck()]


def _call_failures(call: guards.CallResult, first: dict, where: str) -> tuple[list[Check], bool]:
    """A later guarded call's own failed checks (output type, canaries, inputs, process state),
    relabelled with `where`, and whether its results hold every output `first` has (else nothing
    of it can be compared)."""
    bad = [Check(c.name, False, f"{where}: {c.detail}", c.metrics, c.worst) for c in call.checks if not c.ok]
    return bad, all(n in call.results for n in first)


def _bitwise_same(tag: str, a: dict, b: dict) -> Check:
    """`b` (a later run's outputs) bit for bit against `a` (the first run's); a failure carries each
    differing output's mismatch count and the worst elements of the first one, as
    (index, this run, first run, None)."""
    diffs = [(n, r) for n in a if not (r := compare.compare_bitwise(n, b[n], a[n])).ok]
    if not diffs:
        return Check(tag, True, "bitwise identical")
    counts = "; ".join(f"{n}: {r.metrics['mismatches']} of {b[n].numel()} elements differ" for n, r in diffs)
    return Check(tag, False, f"outputs differ bitwise from the first run's: {counts}",
                 {"mismatches": sum(r.metrics["mismatches"] for _, r in diffs)}, diffs[0][1].worst)


def evaluate_case(op: OpDef, case: Case, fn, candidate: str, device: str = "cpu",
                  spec: ToleranceSpec | None = None, strided_run: bool = True) -> CaseVerdict:
    """The whole pipeline for one case; never raises for a candidate's failure."""
    t0 = time.perf_counter()
    _CASE_MEMO.clear()
    spec = spec or load_spec(op.name)

    def verdict(status, stage="", reason="", checks=()):
        return CaseVerdict(op.name, candidate, case.to_json(), status, stage, reason, tuple(checks),
                           time.perf_counter() - t0)

    from verify.candidates import reference_fn
    from verify.split import run_split

    ref = reference_fn(op)
    inputs = op.make_inputs(case)
    inputs64 = to_oracle(inputs)
    oracle = run_plain(ref, op, inputs64, device)
    base = run_plain(ref, op, inputs, device)
    why = derived_vacuity(op, spec, oracle)
    if why:
        return verdict(VACUOUS, "inputs", why)
    if case.tp > 1:
        return run_split(op, case, fn, inputs, inputs64, oracle, base, spec, device, verdict)
    checks: list[Check] = []
    dinputs = on_device(inputs, device)
    kept: list[tuple[str, dict, dict]] = []      # every launch's first results, with a copy of them
    for label, fn_v in launch_variants(fn, inputs):
        first = guarded_call(fn_v, op, dinputs, base, device)
        if first.error:
            return verdict(FAIL, "candidate", f"{label}candidate raised {first.error}", checks)
        run = list(first.checks)
        if all(c.ok for c in run):
            run += judge(op, spec, first.results, oracle, base, inputs, inputs64)
        if all(c.ok for c in run):      # systematic error inside the tolerance (verify/bias.py)
            from verify import bias

            run += bias.case_checks(op, spec, first.results, oracle, base)
        if all(c.ok for c in run):
            kept.append(_keep(op, label, first.results))
            run += _extra_runs(op, spec, case, fn_v, inputs, base, first.results, oracle, inputs64, device,
                                  binds_claims(candidate), strided_run, dinputs=dinputs,
                                  kept=kept[-1], candidate=candidate + label)
            held = outputs_kept(kept, "the later calls of this case")
            # a reused output buffer also garbles the later comparisons: it is the reason to report
            run = [held] + run if not held.ok else run + [held]
            run += written_after_return(first, "the later calls of this case")
        checks += [c if not label else Check(c.name, c.ok, label + c.detail, c.metrics, c.worst) for c in run]
        bad = [c for c in checks if not c.ok]
        if bad:
            from verify.invariance import stage     # a claim broken within tolerance: invariance:<guard>

            return verdict(FAIL, stage(bad[0]), bad[0].detail, checks)
    return verdict(PASS, checks=checks)


def launch_variants(fn, inputs: OpInputs) -> list[tuple[str, object]]:
    """The default launch plus every shape-tuned variant the candidate's module declares through
    `variants(tensors, params)`: each is certified, not only the one the dispatcher picks."""
    import functools
    import sys

    declare = getattr(sys.modules.get(getattr(fn, "__module__", ""), None), "variants", None)
    runs = [("", fn)]
    if callable(declare):
        for v in declare(inputs.tensors, inputs.params):
            runs.append((f"variant {getattr(v, 'name', v)}: ", functools.partial(fn, variant=v)))
    return runs


def binds_claims(candidate: str) -> bool:
    """The spec's bitwise claims (batch invariance, identical bits for strided views) bind every kernel
    judged: ours and a user's. Only the two CPU-BLAS stand-ins are held to the class tolerance in
    those runs: the reference and torch.compile of it call MKL/oneDNN, whose row results depend on
    the row's position in the blocked GEMM and on the operand strides, without being wrong."""
    return candidate not in ("reference", "compiled")


def _extra_runs(op, spec, case, fn, inputs, base, first, oracle, inputs64, device, strict: bool = True,
                strided_run: bool = True, refresh: bool = True, dinputs: OpInputs | None = None,
                kept: tuple[str, dict, dict] | None = None, candidate: str = "") -> list[Check]:
    """Second run (determinism), permuted batch (position independence), new values in the same
    buffers (no state kept across calls), strided/offset views, a misaligned base (those two not
    without `strided_run`). `kept`: _keep of `first`."""
    from verify.candidates import reference_fn

    dinputs = dinputs if dinputs is not None else inputs      # the same values, already on the device
    checks = []
    kept = [kept or _keep(op, "", first)]
    again = guarded_call(fn, op, dinputs, base, device)
    if again.error:
        return [Check("guard:deterministic", False, f"second run raised {again.error}")] + again.checks
    bad, complete = _call_failures(again, first, "second run")
    if bad:
        return bad if complete else bad + [Check("guard:deterministic", False, "the second run's outputs are incomplete")]
    same = [n for n in kept[0][1] if n in again.results and guards.overlaps(again.results[n], first[n])]
    reused = Check("guard:outputs_kept", False, f"the second call returned {', '.join(same)} in the storage "
                   "the first call returned it in: the candidate hands out one preallocated buffer") if same \
        else outputs_kept(kept, "the second call")
    if not reused.ok:           # before the determinism check, which would compare a tensor with itself
        return [reused]
    if spec.claims.deterministic:
        from verify.invariance import claim_check

        checks.append(claim_check(_bitwise_same("guard:deterministic", first, again.results),
                                  lambda: judge(op, spec, again.results, oracle, base, inputs, inputs64)))
    batch = case.batch
    if op.batch_dims and batch > 1:
        perm = torch.randperm(batch, generator=torch.Generator().manual_seed(case.seed))
        if torch.equal(perm, torch.arange(batch)):
            perm = torch.roll(perm, 1)
        p_inputs = permute_batch(op, dinputs, perm)      # on the device: no host copies
        p_base = run_plain(reference_fn(op), op, p_inputs, device)
        moved = guarded_call(fn, op, p_inputs, p_base, device)
        bad, complete = _call_failures(moved, first, "permuted batch")
        checks += bad
        if moved.error:
            checks.append(Check("guard:batch_position", False, f"permuted batch raised {moved.error}"))
        elif not complete:
            checks.append(Check("guard:batch_position", False, "the permuted batch's outputs are incomplete"))
        else:
            back = unpermute(op, moved.results, perm)
            if spec.claims.batch_invariant and strict:
                from verify.invariance import claim_check

                checks.append(claim_check(_bitwise_same("guard:batch_position", first, back),
                                          lambda: judge(op, spec, back, oracle, base, inputs, inputs64)))
            else:
                res = judge(op, spec, back, oracle, base, inputs, inputs64)
                checks.append(Check("guard:batch_position", all(c.ok for c in res),
                                    "; ".join(c.detail for c in res if not c.ok) or "within tolerance after permutation"))
    other = refreshed_inputs(op, case, inputs) if refresh else None
    if refresh:
        from verify import serving_guards

        checks.append(refreshed_inputs_check(op, spec, fn, inputs, other, device))
        checks.append(serving_guards.partial_refresh_check(op, spec, fn, inputs, other, device))
        checks.append(serving_guards.state_chain_check(op, spec, fn, inputs, base, other, device))
        if (op.name, candidate) not in _WARMED and other is not None:
            _WARMED.add((op.name, candidate))
            checks.append(warmed_up_check(op, spec, fn, dinputs, other[1], device))
        from verify.serving_calls import grown_inputs_check    # integer inputs grown in place

        checks += [c for c in (grown_inputs_check(op, spec, fn, inputs, device),) if c is not None]
    if str(device).startswith("cuda") and spec.claims.deterministic:
        from verify.gpu_guards import concurrent_check, cuda_graph_check, side_stream_check, stream_order_check

        checks += [side_stream_check(fn, op, dinputs, base, first, device), cuda_graph_check(fn, op, dinputs, first, device)]
        if other is not None:
            checks.append(stream_order_check(fn, op, dinputs, other[1], base, first, device))
            checks.append(concurrent_check(fn, op, dinputs, other[1], base, first, device))
    held = outputs_kept(kept, "the later calls of this case")
    if not held.ok:            # checked here too: later calls with the case's own values can write the
        return checks + [held]     # same bits back into a reused buffer and hide it at the case's end
    if not strided_run:
        return checks
    from verify.serving_calls import THREAD_CASES, host_threads_check

    if refresh and other is not None and _THREADED.get((op.name, candidate), 0) < THREAD_CASES:
        _THREADED[(op.name, candidate)] = _THREADED.get((op.name, candidate), 0) + 1      # a few cases per pair
        checks.append(host_threads_check(op, spec, fn, inputs, other[1], device, strict))
    strided = guarded_call(fn, op, dinputs, base, device, strided=True)
    bad, complete = _call_failures(strided, first, "strided/offset views")
    checks += bad
    if strided.error:
        ok = any(w in _message(strided.error) for w in ("contiguous", "stride")) and not bad
        checks.append(Check("guard:strided_inputs", ok, f"strided inputs rejected: {strided.error}" if ok
                            else f"strided/offset inputs raised {strided.error}"))
    elif not complete:
        checks.append(Check("guard:strided_inputs", False, "the strided run's outputs are incomplete"))
    else:
        checks.append(_same_as_first("guard:strided_inputs", "strided/offset views", strided.results, first, op,
                                     spec, strict, oracle, base, inputs, inputs64))
    checks += misaligned_inputs_checks(op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict)
    from verify import serving_guards

    checks += serving_guards.call_form_checks(op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device,
                                              strict)
    checks += inference_mode_checks(op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict)
    return checks


def _message(error: str) -> str:
    """A candidate's error in lower case without the file it was raised in (" (at path:line)")."""
    return error.rsplit(" (at ", 1)[0].lower()


def _same_as_first(name: str, where: str, results: dict, first: dict, op: OpDef, spec: ToleranceSpec, strict: bool,
                   oracle: dict, base: dict, inputs: OpInputs, inputs64: OpInputs) -> Check:
    """A later run's complete results against the first run's: bit for bit where the spec claims
    determinism and the candidate is held to its claims (`strict`), else judged like a first call."""
    if spec.claims.deterministic and strict:
        from verify.invariance import claim_check

        same = _bitwise_same(name, first, results)
        return claim_check(Check(name, same.ok, f"{where}: {same.detail}", same.metrics, same.worst),
                           lambda: judge(op, spec, results, oracle, base, inputs, inputs64))
    bad = [c for c in judge(op, spec, results, oracle, base, inputs, inputs64) if not c.ok]
    return Check(name, not bad, f"{where}: " + ("; ".join(f"{c.name}: {c.detail}" for c in bad) or "within tolerance"),
                 bad[0].metrics if bad else {}, bad[0].worst if bad else ())


def inference_mode_checks(op: OpDef, spec: ToleranceSpec, fn, dinputs: OpInputs, base: dict, first: dict,
                          oracle: dict, inputs: OpInputs, inputs64: OpInputs, device, strict: bool) -> list[Check]:
    """guard:inference_mode: the call under torch.inference_mode(), as a serving engine makes it
    (grad off, inference tensors), gives the first run's results (bitwise under the strided run's
    rule). A kernel that dispatches on torch.is_grad_enabled() or is_inference_mode_enabled() to a
    "serving" fast path is otherwise judged only on the path the harness's grad-enabled calls take."""
    name, where = "guard:inference_mode", "under torch.inference_mode()"
    with torch.inference_mode():
        run = guarded_call(fn, op, dinputs, base, device)
    if run.error:
        return [Check(name, False, f"{where}: raised {run.error}")] + run.checks
    checks, complete = _call_failures(run, first, where)
    if not complete:
        return checks + [Check(name, False, f"{where}: the outputs are incomplete")]
    return checks + [_same_as_first(name, where, run.results, first, op, spec, strict, oracle, base, inputs, inputs64)]


MISALIGN = 1       # elements past an aligned base in the misaligned-inputs run (element_size bytes)


def misaligned_inputs_checks(op: OpDef, spec: ToleranceSpec, fn, dinputs: OpInputs, base: dict, first: dict,
                             oracle: dict, inputs: OpInputs, inputs64: OpInputs, device, strict: bool) -> list[Check]:
    """guard:misaligned_inputs: every input and state tensor contiguous, its base MISALIGN elements
    past a 16-byte boundary (a view such as x[1:] of a contiguous tensor; out= buffers aligned), then,
    for a candidate that takes out=, the out= buffers so placed (inputs aligned). Vector or TMA loads
    and stores that assume an aligned base touch other bytes there, or fault. The results must be
    the first run's (bitwise under the strided run's rule), or the candidate must refuse with an
    exception that names the alignment: a stated contract, recorded as such. The call's other guard
    failures (canaries, inputs changed, state not written back) are reported as this run's."""
    checks = _misaligned_run(op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict,
                             f"inputs {MISALIGN} element past an aligned base", "inputs", offset=MISALIGN)
    if op.outputs and guards.accepts_out(fn):
        checks += _misaligned_run(op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict,
                                  f"out= buffers {MISALIGN} element past an aligned base", "out= buffers",
                                  out_offset=MISALIGN)
    return checks


def _misaligned_run(op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict: bool,
                    where: str, what: str, offset: int = 0, out_offset: int = 0) -> list[Check]:
    name = "guard:misaligned_inputs"
    run = guarded_call(fn, op, dinputs, base, device, offset=offset, out_offset=out_offset)
    checks, complete = _call_failures(run, first, where)
    if run.error and checks:           # wrote outside its outputs before it raised: no refusal
        return checks + [Check(name, False, f"{where}: raised {run.error} after the writes above")]
    if run.error:
        said = _message(run.error)
        if "misaligned address" in said or "misalignedaddress" in said:    # CUDA's fault, not a refusal
            return [Check(name, False, f"{where}: the kernel faulted: {run.error}")]
        if "align" in said:
            return [Check(name, True, f"the candidate refused misaligned {what}: {run.error}")]
        return [Check(name, False, f"{where}: raised {run.error} (a refusal must say the {what} need "
                      "aligning)")]
    if not complete:
        return checks + [Check(name, False, f"{where}: the outputs are incomplete")]
    return checks + [_same_as_first(name, where, run.results, first, op, spec, strict, oracle, base, inputs, inputs64)]


# Within one case, what every launch variant's later runs share (the other seed's values, their oracle
# and baseline): computed once, not once per variant. Keyed by object identity; the objects are kept.
_CASE_MEMO: dict[tuple, tuple[object, object]] = {}


def case_memo(key: tuple, keep: tuple, compute):
    """compute() once per case for `key` (ids of the objects in `keep`, which the memo holds alive)."""
    hit = _CASE_MEMO.get(key)
    if hit is None:
        hit = _CASE_MEMO[key] = (keep, compute())
    return hit[1]


def _judged_on(op: OpDef, spec: ToleranceSpec, inputs2: OpInputs, device) -> tuple[OpInputs, dict, dict] | None:
    """(oracle inputs, oracle, baseline) for other values of a case, or None where they are vacuous."""
    return case_memo(("judged", op.name, id(inputs2), str(device)), (inputs2,),
                     lambda: _judged_on_now(op, spec, inputs2, device))


def _judged_on_now(op: OpDef, spec: ToleranceSpec, inputs2: OpInputs, device) -> tuple[OpInputs, dict, dict] | None:
    from verify.candidates import reference_fn

    inputs64_2 = to_oracle(inputs2)
    oracle2 = run_plain(reference_fn(op), op, inputs64_2, device)
    if derived_vacuity(op, spec, oracle2):
        return None
    return inputs64_2, oracle2, run_plain(reference_fn(op), op, inputs2, device)


REFRESH_SEEDS = 2        # other seeds tried for a case with the same shapes and static params
WARMUP_CALLS = 100       # calls of one shape before guard:warmed_up judges the next
_WARMED: set[tuple[str, str]] = set()     # (op, candidate) pairs this process has warmed up once
_THREADED: dict[tuple[str, str], int] = {}   # (op, candidate) -> cases judged by guard:host_threads (serving_calls.py)


def warmed_up_check(op: OpDef, spec: ToleranceSpec, fn, dinputs: OpInputs, inputs2: OpInputs, device) -> Check:
    """guard:warmed_up: WARMUP_CALLS calls of one shape, then a call on other values in fresh buffers,
    judged. A case calls the candidate a dozen times, but a serving process calls it millions: a
    wrapper that captures a CUDA graph, swaps in an autotuned variant or caches a plan after N calls
    of a shape is judged only if N is reached. Once per op and candidate in a process (a cost of
    WARMUP_CALLS calls); a counter above WARMUP_CALLS still goes unseen."""
    name = "guard:warmed_up"
    judged = _judged_on(op, spec, inputs2, device)
    if judged is None:
        return Check(name, True, "not run: the other values' case is vacuous")
    inputs64_2, oracle2, base2 = judged
    placed = _Placed(fn, op, dinputs, base2, device)      # the same shapes as this case's: one set of buffers
    try:
        for _ in range(WARMUP_CALLS):
            for s in op.state:                            # each call from the case's state (a layer's cache
                placed.inputs[s].view.copy_(dinputs.tensors[s])   # fills up over 100 decode steps)
            placed.call(fn, dinputs.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return Check(name, False, f"one of {WARMUP_CALLS} calls of the same shape raised {_one_line(e)}")
    after = guarded_call(fn, op, inputs2, base2, device)
    if after.error:
        return Check(name, False, f"after {WARMUP_CALLS} calls of the same shape, a call raised {after.error}")
    bad = [c for c in after.checks if not c.ok]
    bad = bad or [c for c in judge(op, spec, after.results, oracle2, base2, inputs2, inputs64_2) if not c.ok]
    if bad:
        return Check(name, False, f"after {WARMUP_CALLS} calls of the same shape, a call on new values in fresh "
                     f"buffers: {bad[0].name}: {bad[0].detail}", bad[0].metrics, bad[0].worst)
    return Check(name, True, f"judged like a first call after {WARMUP_CALLS} calls of the same shape")


def refreshed_inputs(op: OpDef, case: Case, first: OpInputs) -> tuple[int | None, OpInputs] | None:
    """(seed, inputs) of another seed of this case with the same tensor shapes, dtypes and params;
    where no seed within REFRESH_SEEDS draws them (an op whose shapes depend on the seed), (None,
    this case's inputs with its float tensors rescaled); None if nothing differs. The same objects for
    every launch variant of the case (case_memo)."""
    return case_memo(("refreshed", op.name, id(first)), (first,), lambda: _refreshed_inputs_now(op, case, first))


def _refreshed_inputs_now(op: OpDef, case: Case, first: OpInputs) -> tuple[int | None, OpInputs] | None:
    from dataclasses import replace

    want = {k: (tuple(v.shape), v.dtype) for k, v in first.tensors.items()}
    for i in range(1, REFRESH_SEEDS + 1):
        seed = (case.seed + 7919 * i) % 2**31
        other = op.make_inputs(replace(case, seed=seed))
        if other.params == first.params and {k: (tuple(v.shape), v.dtype) for k, v in other.tensors.items()} == want:
            if any(not torch.equal(other.tensors[k], first.tensors[k]) for k in want):
                return seed, other
    # shapes drawn from the seed (paged caches, sequence lengths): the same case with every float
    # tensor scaled elementwise by factors in [0.5, 1.5); integer tensors (indices, lengths) kept
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    scaled = {k: (v * (0.5 + torch.rand(v.shape, generator=gen, dtype=torch.float64))).to(v.dtype)
              if v.is_floating_point() and v.numel() else v.clone() for k, v in first.tensors.items()}
    if any(not torch.equal(scaled[k], first.tensors[k]) for k in want):
        return None, OpInputs(scaled, dict(first.params))
    return None


def refreshed_inputs_check(op: OpDef, spec: ToleranceSpec, fn, inputs: OpInputs,
                           found: tuple[int | None, OpInputs] | None, device) -> Check:
    """guard:refreshed_inputs: call once, write another case's values into the same input (and
    state) tensors, in place, at the same addresses, and call again. The second result is judged
    against the reference on the new values. A candidate that keeps anything across calls keyed by
    pointer, shape or call count (prepacked or converted weights, a memo of outputs, a workspace
    assumed clean) answers for the old values or stale state. `found`: refreshed_inputs(...)."""
    name = "guard:refreshed_inputs"
    if found is None:
        return Check(name, True, "not run: no other values with this case's shapes could be drawn")
    seed2, inputs2 = found
    where = f"seed {seed2}" if seed2 is not None else "this case's float inputs rescaled"
    judged = _judged_on(op, spec, inputs2, device)
    if judged is None:
        return Check(name, True, "not run: the other seed's case is vacuous")
    inputs64_2, oracle2, base2 = judged
    placed = _Placed(fn, op, inputs, base2, device)
    try:
        placed.call(fn, inputs.params)
        for k, g in placed.inputs.items():     # through .data: no _version bump, as a graph replay,
            g.view.data.copy_(inputs2.tensors[k].to(device))   # a DLPack or IPC alias writes
        for g in placed.outs.values():
            g.view.fill_(guards.poison_value(g.view.dtype))
        returned = placed.call(fn, inputs2.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return Check(name, False, f"a call with new values in the same buffers raised {_one_line(e)}")
    results, out_checks = placed.outputs(returned)
    bad = [c for c in out_checks + placed.unwritten(results) if not c.ok]
    if not bad:
        bad = [c for c in judge(op, spec, results, oracle2, base2, inputs2, inputs64_2) if not c.ok]
    if bad:
        return stale_or_wrong(name, op, spec, fn, inputs2, judged, device, bad,
                              f"new values ({where}) written into the same input buffers, in place, after a first call",
                              f"the values of {where} (same shapes; drawn by the refreshed-inputs run)")
    return Check(name, True, "new values in the same buffers judged like a first call")


def stale_or_wrong(name: str, op: OpDef, spec: ToleranceSpec, fn, values: OpInputs, judged, device,
                   bad: list[Check], later: str, values_are: str) -> Check:
    """A later call failed (`bad`) on `values` (judged: _judged_on(values)): stale state, or simply wrong
    on these values? A first call on them in fresh buffers tells which. `later` says what the failed
    call was, `values_are` what the values are."""
    inputs64_2, oracle2, base2 = judged
    fresh = guarded_call(fn, op, values, base2, device)
    fresh_ok = not fresh.error and all(c.ok for c in fresh.checks)
    if fresh_ok:
        plain = [c for c in judge(op, spec, fresh.results, oracle2, base2, values, inputs64_2) if not c.ok]
        if plain:
            return Check(plain[0].name, False, f"on {values_are}, in fresh buffers too: {plain[0].detail}",
                         plain[0].metrics, plain[0].worst)
    return Check(name, False, f"{later}: " + "; ".join(f"{c.name}: {c.detail}" for c in bad)
                 + (" (the same values in fresh buffers pass)" if fresh_ok else ""))
