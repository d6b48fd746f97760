"""One case through the pipeline: inputs -> oracle & baseline -> the candidate's first call under
guards -> comparison by class -> the later guards (verify.judge.guards.LATER_GUARDS) -> a verdict.
Every launch variant the candidate declares goes through it."""
from __future__ import annotations

import time
import traceback

from verify.judge import bias, invariance
from verify.judge.calls import guarded_call, on_device, run_plain, to_oracle
from verify.judge.classes import derived_vacuity
from verify.judge.context import CaseContext
from verify.judge.guards import LATER_GUARDS
from verify.judge.guards.outputs import keep, outputs_kept, written_after_return
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs
from verify.model.specs import ToleranceSpec, load_spec
from verify.model.verdict import FAIL, PASS, VACUOUS, CaseVerdict, Check


def evaluate_case(op: OpDef, case: Case, fn, candidate: str, device: str = "cpu",
                  spec: ToleranceSpec | None = None, strided_run: bool = True, warmup: bool = False) -> CaseVerdict:
    """The whole pipeline for one case; never raises for a candidate's failure. `warmup`: also run
    guard:warmed_up (the plan marks a few cases of each op and candidate for it)."""
    from verify.judge.candidates import reference_fn
    from verify.judge.split import run_split

    t0 = time.perf_counter()
    spec = spec or load_spec(op.name)

    def verdict(status, stage="", reason="", checks=()):
        return CaseVerdict(op.name, candidate, case.to_json(), status, stage, reason, tuple(checks),
                           time.perf_counter() - t0)

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
    ctx = CaseContext(op, spec, case, candidate, device, ref, inputs, inputs64, on_device(inputs, device), oracle,
                      base, binds_claims(candidate), strided_run, warmup)
    checks: list[Check] = []
    for label, fn_v in launch_variants(fn, inputs):
        raised, run = judge_launch(ctx.for_launch(fn_v, label))
        if raised:
            return verdict(FAIL, "candidate", f"{label}candidate raised {raised}", checks)
        checks += [c if not label else Check(c.name, c.ok, label + c.detail, c.metrics, c.worst) for c in run]
        bad = [c for c in checks if not c.ok]
        if bad:                         # a claim broken with right values: invariance:<guard>
            return verdict(FAIL, invariance.stage(bad[0]), bad[0].detail, checks)
    return verdict(PASS, checks=checks)


def judge_launch(ctx: CaseContext) -> tuple[str, list[Check]]:
    """One launch of the case: its first call judged, then each later guard until one fails; then
    whether what the first call returned was kept and nothing was written after it returned.
    Returns (the first call's error, or "", the checks)."""
    first = guarded_call(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.device)
    if first.error:
        return first.error, []
    ctx.first_call = first
    run = list(first.checks)
    if all(c.ok for c in run):
        run += ctx.judge(first.results)
    if all(c.ok for c in run):          # systematic error inside the tolerance (judge/bias.py)
        run += bias.case_checks(ctx.op, ctx.spec, first.results, ctx.oracle, ctx.base)
    if not all(c.ok for c in run):
        return "", run
    ctx.kept.append(keep(ctx.op, ctx.variant, first.results))
    for guard in LATER_GUARDS:
        got = guard(ctx)
        run += got
        if not all(c.ok for c in got):
            break
    held = outputs_kept(ctx.kept, "the later calls of this case")
    # a reused output buffer also garbles the later comparisons: it is the reason to report
    run = [held] + run if not held.ok else run + [held]
    return "", run + written_after_return(first, "the later calls of this case")


def judge_case(op: OpDef, case: Case, fn, candidate: str, device: str, spec: ToleranceSpec | None = None,
               strided_run: bool = True, warmup: bool = False) -> CaseVerdict:
    """evaluate_case, with any failure outside the candidate (input builder, reference) as a verdict.
    With $VERIFY_CPROFILE_DIR set, the case runs under cProfile and its stats are written there as
    <op>-<config>-<seed>-<batch>-tp<T>.pstats (where a certification run spends its time)."""
    import os

    t0 = time.perf_counter()
    try:
        if os.environ.get("VERIFY_CPROFILE_DIR"):
            import cProfile
            from pathlib import Path

            out = Path(os.environ["VERIFY_CPROFILE_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            prof = cProfile.Profile()
            try:
                return prof.runcall(evaluate_case, op, case, fn, candidate, device, spec, strided_run, warmup)
            finally:
                prof.dump_stats(out / f"{op.name}-{case.config}-{case.seed}-{case.batch}-tp{case.tp}.pstats")
        return evaluate_case(op, case, fn, candidate, device, spec, strided_run=strided_run, warmup=warmup)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{tb.filename.rsplit('/', 1)[-1]}:{tb.lineno}"
        return CaseVerdict(op.name, candidate, case.to_json(), FAIL, "harness",
                           f"{type(e).__name__}: {str(e)[:300]} (at {where}; inputs or reference failed)",
                           (), time.perf_counter() - t0)


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
