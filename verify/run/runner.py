"""Run a plan: judge its cases (all of them, a slice, or those a log lacks), shrink a failing case, and
summarise each op/candidate pair's case verdicts into its op verdict.

The summary reads the case verdicts in plan order only, so a run, its resume, and the merge of its
shards give the same op verdicts. Shrinking starts from a failing case and only re-judges smaller
cases of it (batch, config, dtype, T toward the smallest), in the process that found the failure.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from verify.judge.candidates import Candidate, CandidateImportError, CandidateUnavailable
from verify.judge import bias
from verify.judge.pipeline import judge_case
from verify.model.case import Case
from verify.model.opdef import OpDef
from verify.model.profile import CONFIG_ORDER, Profile, drawn_dtypes
from verify.model.specs import SpecError, load_spec
from verify.model.verdict import FAIL, PASS, SKIP, VACUOUS, WAIVED, XPASS, CaseVerdict, OpVerdict
from verify.plan.plan import FAIL as PLAN_FAIL
from verify.plan.plan import JUDGE, PairScope, Plan, PlannedCase, make_plan
from verify.plan.scope import ScopeError, candidate_scope

FATAL_STAGES = ("timeout", "crash")     # after one, the pair's later cases in this process are not judged
SHRINK_STEPS = 12                        # re-judged cases at most when shrinking one failure


@dataclass(frozen=True)
class RunConfig:
    """The settings of one run, frozen: what the CLI parses into and every library function takes."""
    ops: tuple[str, ...]
    candidates: tuple[str, ...]
    device: str = "cpu"
    profile: Profile | None = None
    seed: int = 0
    tps: tuple[int, ...] | None = None
    examples: int | None = None
    isolate: bool = True
    case_timeout: float = 120.0
    harness: str = ""            # the judging code's hash (record.certificate.harness_hash), kept in the plan
    threads: int = 0             # torch intra-op threads for every case (0: torch's default here): CPU BLAS
                                 # bits depend on it, so every slice of a plan runs with the plan's count

    def plan_options(self) -> dict:
        p = self.profile
        return {"ops": list(self.ops), "candidates": list(self.candidates), "device": self.device,
                "profile": p.name, "configs": list(p.configs), "dtypes": None if p.dtypes is None else list(p.dtypes),
                "seed": self.seed, "tp": None if self.tps is None else list(self.tps), "examples": self.examples,
                "harness": self.harness, "threads": self.threads or _default_threads()}


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


# -- planning --------------------------------------------------------------------------------------

def pair_scope(op: OpDef, candidate: Candidate, profile: Profile, device: str) -> PairScope:
    """Whether a pair can be judged here, before any case: its spec loads, its candidate resolves (a
    fused kernel needs a GPU: a skip), and the scope its module declares (DTYPES, PARAMS)."""
    label = candidate.label
    try:
        load_spec(op.name)
    except SpecError as e:
        return PairScope(PLAN_FAIL, f"spec: {e}")
    if label == "compiled" and op.compile_heavy and not profile.compile_heavy:
        return PairScope("skip", f"torch.compile of {op.name} takes minutes on a CPU; not in the "
                                 f"{profile.name} profile (run --profile ci)")
    try:
        fn = candidate.resolve(op, device)
    except CandidateUnavailable as e:
        return PairScope("skip", str(e))
    except CandidateImportError as e:
        return PairScope(PLAN_FAIL, f"candidate: {e}")
    try:
        declared = candidate_scope(op, fn, profile)
    except ScopeError as e:
        return PairScope(PLAN_FAIL, f"candidate: {e}")
    if declared.profile is None:
        return PairScope("skip", declared.skip_reason)
    return PairScope(JUDGE, "", declared.profile, declared.notes, dict(declared.params))


def build_plan(cfg: RunConfig, ops: list[OpDef], candidates: list[Candidate]) -> Plan:
    scopes = {(op.name, c.label): pair_scope(op, c, cfg.profile, cfg.device) for op in ops for c in candidates}
    return make_plan(ops, [c.label for c in candidates], cfg.profile, cfg.seed,
                     None if cfg.tps is None else list(cfg.tps), cfg.examples, scopes, cfg.plan_options())


# -- judging ---------------------------------------------------------------------------------------

class InProcess:
    """Judges cases in this process (run --no-isolate, tests): candidates resolved once per pair."""

    def __init__(self, candidates: dict[str, Candidate] | None = None, threads: int = 0):
        self.candidates = candidates or {}
        self.threads = threads
        self._fns: dict[tuple[str, str, str], object] = {}

    def evaluate(self, op: OpDef, case: Case, label: str, device: str, strided_run: bool = True,
                 warmup: bool = False) -> CaseVerdict:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        key = (op.name, label, device)
        if key not in self._fns:
            self._fns[key] = self.candidates.get(label, Candidate(label)).resolve(op, device)
        return judge_case(op, case, self._fns[key], label, device, load_spec(op.name), strided_run, warmup)

    def close(self) -> None:
        pass


def judge_cases(entries: Iterable[PlannedCase], ops: dict[str, OpDef], device: str, evaluator,
                on_verdict: Callable[[PlannedCase, CaseVerdict], None],
                on_shrunk: Callable[[PlannedCase, CaseVerdict], None] | None = None,
                profile: Profile | None = None) -> None:
    """Judge each planned case; every verdict goes to on_verdict as it comes. After a hang or a crash
    (FATAL_STAGES) the pair's later cases here are recorded as skipped (each would cost a timeout).
    A failing case is shrunk when `profile.shrink` and on_shrunk is given."""
    fatal: dict[tuple[str, str], int] = {}
    for pc in entries:
        op, case = ops[pc.op], Case.from_json(pc.case)
        pair = (pc.op, pc.candidate)
        if pair in fatal:
            on_verdict(pc, CaseVerdict(pc.op, pc.candidate, pc.case, SKIP, "not judged",
                                       f"case #{fatal[pair]} of this pair hung or crashed; its later cases here "
                                       "were not judged"))
            continue
        v = evaluator.evaluate(op, case, pc.candidate, device, pc.strided_run, pc.warmup)
        v = replace(v, case=pc.case)
        on_verdict(pc, v)
        if v.status == FAIL and v.stage in FATAL_STAGES:
            fatal[pair] = pc.index
        elif v.status == FAIL and on_shrunk is not None and profile is not None and profile.shrink \
                and not _waiver(op.name, pc.candidate, case):
            small = shrink(op, case, pc, device, evaluator, profile)
            if small is not None:
                on_shrunk(pc, small)


def _smaller(op: OpDef, case: Case, profile: Profile) -> list[Case]:
    """Smaller cases of one case, simplest first: T = 1, batch 1 then halved, smaller configs, the
    working dtype. The seed and dist stay (they are what the case is about)."""
    out = []
    if case.tp > 1:
        out.append(replace(case, tp=1))
    for b in (1, case.batch // 2):
        if 1 <= b < case.batch:
            out.append(replace(case, batch=b))
    for cfg in CONFIG_ORDER[:CONFIG_ORDER.index(case.config)] if case.config in CONFIG_ORDER else ():
        if cfg in op.configs:
            out.append(replace(case, config=cfg))
    first = drawn_dtypes(op, profile)[0]
    if case.dtype != first:
        out.append(replace(case, dtype=first))
    return out


def shrink(op: OpDef, case: Case, pc: PlannedCase, device: str, evaluator, profile: Profile) -> CaseVerdict | None:
    """Greedy shrinking of a failing case: take the first smaller case that still fails, repeat, at
    most SHRINK_STEPS judged cases. None when no smaller case fails."""
    best, steps = None, 0
    progress = True
    while progress and steps < SHRINK_STEPS:
        progress = False
        for small in _smaller(op, Case.from_json(best.case) if best else case, profile):
            if steps >= SHRINK_STEPS:
                break
            steps += 1
            v = evaluator.evaluate(op, small, pc.candidate, device, pc.strided_run, False)
            if v.status == FAIL and v.stage not in FATAL_STAGES:
                best, progress = replace(v, case=small.to_json()), True
                break
    return best


# -- summarising -----------------------------------------------------------------------------------

def _waiver(op_name: str, label: str, case: Case):
    try:
        spec = load_spec(op_name)
    except SpecError:
        return None
    return next((w for w in spec.waivers if w.applies(label, case)), None)


def repro_command(case: Case, candidate: str, device: str) -> str:
    return f"verify-kernels repro {shlex.quote(case.to_json())} --candidate {shlex.quote(candidate)} --device {device}"


@dataclass
class Judged:
    """Case verdicts of one plan by index, and the shrunk form of those that failed."""
    verdicts: dict[int, CaseVerdict] = field(default_factory=dict)
    shrunk: dict[int, CaseVerdict] = field(default_factory=dict)


def summarise(plan: Plan, judged: Judged, device: str) -> list[OpVerdict]:
    """One op verdict per pair of the plan, from its case verdicts in plan order: the first failing
    (or waived-but-passing) case fails it; a pair whose every case was vacuous fails; a pair with
    cases not yet judged fails as incomplete."""
    out = []
    for pair in plan.pairs:
        if pair.status != JUDGE:
            out.append(OpVerdict(pair.op, pair.candidate, SKIP if pair.status == "skip" else FAIL, reason=pair.reason))
            continue
        seen, failure, waived = [], None, []
        missing = [i for i in pair.cases if i not in judged.verdicts]
        for i in pair.cases:
            v = judged.verdicts.get(i)
            if v is None:
                continue
            seen.append(v)
            w = _waiver(pair.op, pair.candidate, Case.from_json(v.case))
            if w is not None and v.status == FAIL:
                waived.append(v)
            elif w is not None and v.status == PASS and failure is None:
                failure = CaseVerdict(v.op, v.candidate, v.case, XPASS, "waiver",
                                      f"waived case now passes; remove the waiver ({w.reason})")
            elif v.status == FAIL and failure is None:
                failure = judged.shrunk.get(i, v)
                if i in judged.shrunk:
                    c = Case.from_json(v.case)
                    failure = replace(failure, reason=f"{failure.reason} (shrunk from the case at B={c.batch}, "
                                                      f"{c.config}, {c.dtype}, T={c.tp})")
        if failure is None and missing:
            failure = CaseVerdict(pair.op, pair.candidate, "", FAIL, "incomplete",
                                  f"{len(missing)} of {len(pair.cases)} planned cases have no verdict "
                                  "(a cut run: --resume, or merge every shard)")
        if failure is None and seen and all(v.status == VACUOUS for v in seen):
            failure = CaseVerdict(pair.op, pair.candidate, "", FAIL, "inputs", "every planned case was vacuous")
        if failure is None and not missing:     # a bias too small for one case shows over all of them
            failure = bias.pair_failure(pair.op, pair.candidate, seen)
        out.append(_op_verdict(pair, seen, failure, waived, device))
    return out


def _op_verdict(pair, seen: list[CaseVerdict], failure, waived, device: str) -> OpVerdict:
    worst: dict[str, float] = {}
    for v in seen:
        for c in v.checks:
            r = c.metrics.get("ratio")
            if r is not None and c.name.startswith("compare:"):
                worst[c.name[8:]] = max(worst.get(c.name[8:], 0.0), r)
    counts = dict(cases_run=sum(v.status != SKIP for v in seen), cases_passed=sum(v.status == PASS for v in seen),
                  cases_vacuous=sum(v.status == VACUOUS for v in seen), worst_ratio=worst,
                  seconds=sum(v.seconds for v in seen))
    scope = "; ".join(pair.scope)
    if failure is not None:
        status = XPASS if failure.status == XPASS else FAIL
        repro = repro_command(Case.from_json(failure.case), pair.candidate, device) if failure.case else ""
        return OpVerdict(pair.op, pair.candidate, status, reason=f"{failure.stage}: {failure.reason}",
                         failure=failure, repro=repro, **counts)
    if waived:
        return OpVerdict(pair.op, pair.candidate, WAIVED, reason=f"{len(waived)} waived cases failed as expected"
                         + (f"; {scope}" if scope else ""), scope=pair.scope, **counts)
    return OpVerdict(pair.op, pair.candidate, PASS, reason=scope, details=(scope,) if scope else (),
                     scope=pair.scope, **counts)


# -- one pair, in one call (the pytest plugin, tests) ----------------------------------------------

@dataclass
class RunOptions:
    device: str = "cpu"
    profile: Profile | None = None
    seed: int = 0
    tps: list[int] | None = None
    on_case: Callable[[CaseVerdict], None] | None = None     # called for every case as it completes
    examples: int | None = None                               # override profile.examples
    evaluator: object | None = None       # .evaluate(op, case, label, device, strided_run, warmup); None: in-process


def certify_op(op: OpDef, candidate: Candidate, opts: RunOptions) -> OpVerdict:
    """Plan, judge and summarise one op/candidate pair in this process (or opts.evaluator)."""
    t0 = time.perf_counter()
    cfg = RunConfig((op.name,), (candidate.label,), opts.device, opts.profile, opts.seed,
                    None if opts.tps is None else tuple(opts.tps), opts.examples)
    scope = pair_scope(op, candidate, opts.profile, opts.device)
    plan = make_plan([op], [candidate.label], opts.profile, opts.seed, opts.tps, opts.examples,
                     {(op.name, candidate.label): scope}, {"ops": [op.name]})
    judged = Judged()

    def on_verdict(pc, v):
        judged.verdicts[pc.index] = v
        if opts.on_case:
            opts.on_case(v)

    evaluator = opts.evaluator or InProcess({candidate.label: candidate})
    judge_cases(plan.cases, {op.name: op}, cfg.device, evaluator, on_verdict,
                lambda pc, v: judged.shrunk.__setitem__(pc.index, v), opts.profile)
    v = summarise(plan, judged, opts.device)[0]
    return replace(v, seconds=time.perf_counter() - t0)


def replay(op: OpDef, case: Case, candidate: Candidate, device: str) -> CaseVerdict:
    fn = candidate.resolve(op, device)
    return judge_case(op, case, fn, candidate.label, device, load_spec(op.name))
