"""Certify candidates op by op: hypothesis draws cases, shrinks failures, waivers are applied."""
from __future__ import annotations

import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hyp_seed

from verify.candidates import Candidate, CandidateImportError, CandidateUnavailable
from verify.case import Case
from verify.cases import (Profile, batch_sweep_cases, case_strategy, dist_sweep_cases, drawn_dtypes, knob_sweep_cases,
                          tp_sweep_cases)
from verify.evaluate import evaluate_case
from verify.opdef import OpDef
from verify.specs import SpecError, load_spec
from verify.worker import FATAL_STAGES
from verify.verdict import FAIL, PASS, SKIP, VACUOUS, WAIVED, XPASS, CaseVerdict, OpVerdict


class _CaseFailed(Exception):
    def __init__(self, verdict: CaseVerdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


@dataclass
class RunOptions:
    device: str = "cpu"
    profile: Profile | None = None
    seed: int = 0
    tps: list[int] | None = None
    on_case: Callable[[CaseVerdict], None] | None = None     # called for every case as it completes
    examples: int | None = None                               # override profile.examples
    evaluator: Callable | None = None     # (op_name, case, label, device) -> CaseVerdict; None = in-process


def repro_command(case: Case, candidate: str, device: str) -> str:
    return f"verify-kernels repro {shlex.quote(case.to_json())} --candidate {shlex.quote(candidate)} --device {device}"


def safe_evaluate(op: OpDef, case: Case, fn, candidate: str, device: str, spec, strided_run: bool = True) -> CaseVerdict:
    """evaluate_case, with any failure outside the candidate (input builder, reference) as a verdict."""
    t0 = time.perf_counter()
    try:
        if os.environ.get("VERIFY_CPROFILE_DIR"):
            return _profiled(op, case, fn, candidate, device, spec, strided_run)
        return evaluate_case(op, case, fn, candidate, device, spec, strided_run=strided_run)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{tb.filename.rsplit('/', 1)[-1]}:{tb.lineno}"
        return CaseVerdict(op.name, candidate, case.to_json(), FAIL, "harness",
                           f"{type(e).__name__}: {str(e)[:300]} (at {where}; inputs or reference failed)",
                           (), time.perf_counter() - t0)


def _profiled(op: OpDef, case: Case, fn, candidate: str, device: str, spec, strided_run: bool) -> CaseVerdict:
    """evaluate_case under cProfile, the stats written to $VERIFY_CPROFILE_DIR/<op>-<seed>-<batch>.pstats
    (where a certification run spends its time: `python -m pstats` or bench/profile_summary.py)."""
    import cProfile

    out = Path(os.environ["VERIFY_CPROFILE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    try:
        return prof.runcall(evaluate_case, op, case, fn, candidate, device, spec, strided_run=strided_run)
    finally:
        prof.dump_stats(out / f"{op.name}-{case.config}-{case.seed}-{case.batch}-tp{case.tp}.pstats")


def _judge(op: OpDef, case: Case, fn, label: str, opts: RunOptions, spec, strided_run: bool) -> CaseVerdict:
    """One case, by the run's evaluator (an isolated worker) or in this process."""
    if opts.evaluator is not None:
        return opts.evaluator(op.name, case, label, opts.device, strided_run=strided_run)
    return safe_evaluate(op, case, fn, label, opts.device, spec, strided_run)


def certify_op(op: OpDef, candidate: Candidate, opts: RunOptions, judged: Sequence[CaseVerdict] = ()) -> OpVerdict:
    """Draw, judge and summarise cases of one op/candidate pair. `judged`: the case verdicts a cut run
    already logged for this pair with the same settings (run --resume); hypothesis draws the same cases
    for the same seed, so they replay from the memo and only the cases not yet judged are evaluated."""
    t0 = time.perf_counter()
    label = candidate.label
    try:
        spec = load_spec(op.name)
    except SpecError as e:
        return OpVerdict(op.name, label, FAIL, reason=f"spec: {e}")
    if candidate.label == "compiled" and op.compile_heavy and not opts.profile.compile_heavy:
        return OpVerdict(op.name, label, SKIP, reason=f"torch.compile of {op.name} takes minutes on a CPU; "
                                                      "not in the quick profile (run --profile ci)")
    try:
        fn = candidate.resolve(op, opts.device)
    except CandidateUnavailable as e:
        return OpVerdict(op.name, label, SKIP, reason=str(e))
    except CandidateImportError as e:
        return OpVerdict(op.name, label, FAIL, reason=f"candidate: {e}")
    from verify.scope import ScopeError, candidate_scope     # the module's DTYPES / PARAMS declarations

    try:
        declared = candidate_scope(op, fn, opts.profile)
    except ScopeError as e:
        return OpVerdict(op.name, label, FAIL, reason=f"candidate: {e}")
    if declared.profile is None:
        return OpVerdict(op.name, label, SKIP, reason=declared.skip_reason)
    profile, scope = declared.profile, "; ".join(declared.notes)
    seen: list[CaseVerdict] = []
    waived_fail: list[CaseVerdict] = []       # failures a spec waiver expects

    done: dict[str, CaseVerdict] = {}       # case json -> verdict: hypothesis replays and shrinks reuse it
    fatal: list[CaseVerdict] = []           # a hang or crash: stop drawing (each would cost a timeout)

    def record(v: CaseVerdict) -> CaseVerdict:
        """Memoise and count a judged case; what a draw of it returns (a waived pass: XPASS)."""
        done[v.case] = v
        if v.status == FAIL and v.stage in FATAL_STAGES:
            fatal.append(v)
        seen.append(v)
        waiver = next((w for w in spec.waivers if w.applies(label, Case.from_json(v.case))), None)
        if waiver is not None and v.status == FAIL:
            waived_fail.append(v)
        elif waiver is not None and v.status == PASS:
            done[v.case] = CaseVerdict(v.op, label, v.case, XPASS, "waiver",
                                       f"waived case now passes; remove the waiver ({waiver.reason})")
        return done[v.case]

    for v in judged:          # already in the log: counted once here, never evaluated or logged again
        record(v)

    def run_one(case: Case) -> CaseVerdict:
        case = declared.apply(case)       # declared PARAMS pinned (a knob of the case: repro replays it)
        key = case.to_json()
        if key in done:
            return done[key]          # prop raises, from one place, so hypothesis sees one failure origin
        if fatal:
            reject()
        v = _judge(op, case, fn, label, opts, spec, profile.strided_run)
        if v.case != key:     # the memo is keyed by the case as drawn
            v = replace(v, case=key)
        judged_now = record(v)
        if opts.on_case:
            opts.on_case(v)
        return judged_now

    @settings(max_examples=opts.examples or profile.examples, deadline=None, database=None,
              derandomize=False, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if profile.shrink else []))
    @given(case_strategy(op, profile, opts.tps, opts.device))
    def prop(case: Case):
        # a vacuous case counts as a draw (no reject()): the draw sequence then depends on no verdict
        # but a failure, so the cases `run --shards` deals from a dry draw are the ones this run judges
        v = run_one(case)
        if v.status == XPASS or (v.status == FAIL and v not in waived_fail):
            raise _CaseFailed(v)

    failure = None
    try:
        hyp_seed(opts.seed + sum(map(ord, op.name)))(prop)()
    except _CaseFailed as e:
        failure = e.verdict
    if failure is None and seen and all(v.status == VACUOUS for v in seen):
        failure = CaseVerdict(op.name, label, "", FAIL, "inputs", "every drawn case was vacuous")
    if failure is None and fatal:
        failure = fatal[0]
    if failure is None:
        # a judged case this draw sequence did not reach (dealt by --shards from a dry draw that went
        # another way after a vacuous case) still counts: every judged case must pass
        failure = next((v for v in seen if v.status in (FAIL, XPASS) and v not in waived_fail), None)
    if failure is None:
        drawn = {Case.from_json(v.case).dist for v in seen if v.case and v.status != VACUOUS}
        for case in (tp_sweep_cases(op, profile, opts.seed, opts.tps)
                     + dist_sweep_cases(op, profile, opts.seed, drawn)
                     + knob_sweep_cases(op, profile, opts.seed, opts.tps)
                     + batch_sweep_cases(op, profile, opts.seed)):
            v = run_one(case)
            if v.status == XPASS or (v.status == FAIL and v not in waived_fail):
                failure = v
                break
    if failure is None:       # a bias too small to show in one case shows over all of them (verify/bias.py)
        from verify.bias import pair_failure

        failure = pair_failure(op.name, label, seen)
    seconds = time.perf_counter() - t0 + sum(v.seconds for v in judged)     # a resumed pair's whole cost
    return _summarise(op, label, opts, seen, failure, waived_fail, seconds, scope, declared.notes)


def _summarise(op, label, opts, seen, failure, waived_fail, seconds, scope: str = "",
               notes: tuple[str, ...] = ()) -> OpVerdict:
    worst: dict[str, float] = {}
    for v in seen:
        for c in v.checks:
            r = c.metrics.get("ratio")
            if r is not None and c.name.startswith("compare:"):
                worst[c.name[8:]] = max(worst.get(c.name[8:], 0.0), r)
    counts = dict(cases_run=len(seen), cases_passed=sum(v.status == PASS for v in seen),
                  cases_vacuous=sum(v.status == VACUOUS for v in seen), worst_ratio=worst, seconds=seconds)
    if failure is not None:
        status = XPASS if failure.status == XPASS else FAIL
        repro = repro_command(Case.from_json(failure.case), label, opts.device) if failure.case else ""
        return OpVerdict(op.name, label, status, reason=f"{failure.stage}: {failure.reason}", failure=failure,
                         repro=repro, **counts)
    if waived_fail:
        return OpVerdict(op.name, label, WAIVED, reason=f"{len(waived_fail)} waived cases failed as expected"
                         + (f"; {scope}" if scope else ""), scope=notes, **counts)
    return OpVerdict(op.name, label, PASS, reason=scope, details=(scope,) if scope else (),
                     scope=notes, **counts)


def draw_cases(op: OpDef, candidate: Candidate, opts: RunOptions) -> list[str]:
    """The cases a certification of this pair would judge, in order, without judging any (every draw
    answers pass): what `run --shards` deals out to its children. A vacuous case is a draw like a
    pass, so a real run draws the same cases up to its first failure; only the dist sweep, which
    skips dists drawn in judged cases, can add a case here (a dist drawn only vacuously)."""
    drawn: list[str] = []

    def dry(op_name, case, label, device, strided_run=True) -> CaseVerdict:
        return CaseVerdict(op_name, label, case.to_json(), PASS, "", "", (), 0.0)

    v = certify_op(op, candidate, replace(opts, evaluator=dry, on_case=lambda c: drawn.append(c.case)))
    if v.status == SKIP or (v.status == FAIL and not drawn):
        return []
    return drawn


def judge_listed(op: OpDef, candidate: Candidate, cases: list[str], opts: RunOptions,
                 judged: set[str] = frozenset()) -> int:
    """Judge exactly these cases (a `--shards` child); each verdict goes to opts.on_case. Cases in
    `judged` (its own log, on --resume) are skipped. Returns how many were judged now."""
    fn = candidate.resolve(op, opts.device)
    spec = load_spec(op.name)
    n = 0
    for text in cases:
        if text in judged:
            continue
        v = _judge(op, Case.from_json(text), fn, candidate.label, opts, spec, opts.profile.strided_run)
        opts.on_case(replace(v, case=text))
        n += 1
    return n


def replay(op: OpDef, case: Case, candidate: Candidate, device: str) -> CaseVerdict:
    fn = candidate.resolve(op, device)
    return safe_evaluate(op, case, fn, candidate.label, device, load_spec(op.name))


def run_all(args, ops, candidates, profile, tps, device, log, console) -> tuple[list[OpVerdict], dict]:
    """Every op x candidate of a `run`, by mode; each verdict goes to the run log as it completes.
    Returns the op verdicts and (op, candidate) -> compact case records for the certificate."""
    from verify.reporters.progress import RunProgress
    from verify.runlog import case_record

    prev = log.previous
    cases: dict[tuple[str, str], list[dict]] = {k: list(v) for k, v in prev.cases.items()}

    shown: list = []          # the progress reporter, once the pairs start (a bar, or lines in a log)

    def on_case(v: CaseVerdict) -> None:
        log.case(v)
        cases.setdefault((v.op, v.candidate), []).append(case_record(v))
        for p in shown:
            p.case(v)

    if args.distributed:
        from verify.distributed import certify_distributed, collective_ops

        chosen = ops if args.ops else collective_ops(ops)
        verdicts = []
        for cand in candidates:
            verdicts += certify_distributed(chosen, cand.label, args.distributed, tps or [2, 4], args.seed,
                                            on_case=on_case)
        for v in verdicts:
            log.op(v)
        return verdicts, cases
    runner = None
    if not args.no_isolate and not args.sanitize:
        from verify.worker import IsolatedRunner

        runner = IsolatedRunner(case_timeout=args.case_timeout)
    opts = RunOptions(device=device, profile=profile, seed=args.seed, tps=tps, examples=args.examples,
                      on_case=on_case, evaluator=runner.evaluate if runner else None)
    if getattr(args, "case_list", None):       # a --shards child: judge the cases dealt to it, no verdict
        import json

        listed = json.loads(Path(args.case_list).read_text())
        try:
            for op in ops:
                for cand in candidates:
                    done = {v.case for v in prev.partial.get((op.name, cand.label), [])}
                    n = judge_listed(op, cand, listed.get(op.name, {}).get(cand.label, []), opts, done)
                    console.print(f"{op.name} / {cand.label}: judged {n} listed cases")
        finally:
            if runner is not None:
                runner.close()
        return [], cases
    verdicts = []
    try:
        with RunProgress(console, len(ops) * len(candidates)) as progress:
            shown.append(progress)
            for op in ops:
                for cand in candidates:
                    progress.start(op.name, cand.label)
                    done = prev.op_verdicts.get((op.name, cand.label))
                    if done is not None:
                        v = done
                    elif args.sanitize:
                        from verify.sanitize import sanitize_op

                        v = sanitize_op(op, cand.label, args.sanitize, args.seed)
                    else:
                        judged = prev.partial.get((op.name, cand.label), [])
                        if prev.repeated_lines:
                            console.print(f"{op.name} / {cand.label}: {prev.repeated_lines} case lines of "
                                          "cases already logged (shards of two deals), each case counted once")
                        if judged:
                            console.print(f"{op.name} / {cand.label}: {len(judged)} cases judged earlier (a cut "
                                          f"run, or --shards children) are replayed from {log.path}")
                            cases[(op.name, cand.label)] = [case_record(c) for c in judged]
                        v = certify_op(op, cand, opts, judged)
                    if done is None:
                        log.op(v)
                    verdicts.append(v)
                    progress.done(v)
    finally:
        if runner is not None:
            runner.close()
    return verdicts, cases
