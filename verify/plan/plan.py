"""The plan: for (ops, candidates, profile, seed, options), the explicit, ordered list of cases a run
judges, written to OUT/plan.json before any case is judged.

Judging a case depends on that case alone, so every way of spreading a run is a slice of this list:
`--jobs`, `--resume` (the cases without a verdict in the log) and `run --shard I/N` (the I-th of N
contiguous blocks of equal size: a block holds one or two ops, so a process compiles the kernels of
those only). `merge` joins the verdicts of shards of one plan, recognised by its id (a hash of
everything in it).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verify.model.case import Case
from verify.model.opdef import OpDef
from verify.model.profile import Profile
from verify.plan.draw import planned_cases
from verify.plan.scope import pin

PLAN_NAME = "plan.json"
FORMAT = "verify-kernels/plan/v1"
WARMUP_CASES = 2          # the first unsplit cases of each pair that also run guard:warmed_up
JUDGE, SKIP, FAIL = "judge", "skip", "fail"


@dataclass(frozen=True)
class PairScope:
    """What the run stage found out about an op/candidate pair before planning it: whether it can run
    here (status judge, or skip / fail with the reason) and, for a candidate that declares a narrower
    contract (plan/scope.py: DTYPES, PARAMS), the profile it is drawn with, the parameter values each
    case is pinned to, and the scope lines its verdict carries."""
    status: str = JUDGE
    reason: str = ""
    profile: Profile | None = None
    scope: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PlannedCase:
    index: int                # position in the plan: what logs, shards and merges key verdicts by
    op: str
    candidate: str
    case: str                 # Case.to_json()
    warmup: bool = False      # also judge guard:warmed_up on this case
    strided_run: bool = True  # the strided and misaligned guard runs (not in the quick profile)


@dataclass(frozen=True)
class PairPlan:
    op: str
    candidate: str
    status: str               # judge | skip | fail (decided before any case: no GPU, import failure)
    reason: str = ""
    scope: tuple[str, ...] = ()       # the candidate's declared scope ("scope: ..." lines)
    cases: tuple[int, ...] = ()       # indices into Plan.cases


@dataclass(frozen=True)
class Plan:
    options: dict
    pairs: tuple[PairPlan, ...]
    cases: tuple[PlannedCase, ...]
    format: str = FORMAT
    id: str = field(default="", compare=False)

    def with_id(self) -> "Plan":
        body = json.dumps([self.options, [asdict(p) for p in self.pairs], [asdict(c) for c in self.cases]],
                          sort_keys=True, default=str, separators=(",", ":"))
        return Plan(self.options, self.pairs, self.cases, self.format, hashlib.sha256(body.encode()).hexdigest()[:16])

    def slice(self, shard: int = 0, shards: int = 1) -> list[PlannedCase]:
        """The cases shard `shard` of `shards` judges: the shard-th of `shards` contiguous blocks."""
        if not 0 <= shard < shards:
            raise ValueError(f"--shard {shard}/{shards}: I must be in 0..N-1")
        n = len(self.cases)
        return list(self.cases[shard * n // shards:(shard + 1) * n // shards])

    def pair(self, op: str, candidate: str) -> PairPlan:
        return next(p for p in self.pairs if p.op == op and p.candidate == candidate)

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "id": self.id, "options": self.options,
                           "pairs": [asdict(p) for p in self.pairs], "cases": [asdict(c) for c in self.cases]},
                          indent=0, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a plan this harness wrote (format {FORMAT})")
        pairs = tuple(PairPlan(**{**p, "cases": tuple(p["cases"]), "scope": tuple(p.get("scope", ()))})
                      for p in d["pairs"])
        plan = cls(d["options"], pairs, tuple(PlannedCase(**c) for c in d["cases"]), d["format"])
        plan = plan.with_id()
        if plan.id != d.get("id"):
            raise ValueError(f"{where}: its id {d.get('id')} does not match its contents (edited?)")
        return plan

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / PLAN_NAME
        path.write_text(self.to_json())
        return path


def load(path: Path) -> Plan:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the plan ({e.strerror or e})") from None
    return Plan.from_json(text, str(path))


def make_plan(ops: list[OpDef], candidates: list[str], profile: Profile, seed: int, tps: list[int] | None,
              examples: int | None, scopes: dict[tuple[str, str], PairScope], options: dict) -> Plan:
    """Every op x candidate pair in order, each with its cases (draw.planned_cases under the pair's
    profile: a candidate that declares fewer dtypes draws fewer). `scopes`: the run stage's PairScope
    per pair (missing: judge with `profile`). `options` are recorded in the plan and its id."""
    pairs, cases = [], []
    for op in ops:
        for label in candidates:
            sc = scopes.get((op.name, label), PairScope())
            if sc.status != JUDGE:
                pairs.append(PairPlan(op.name, label, sc.status, sc.reason))
                continue
            prof = sc.profile or profile
            listed = [pin(c, sc.params) for c in planned_cases(op, prof, seed, tps, examples)]
            listed = list({c.to_json(): c for c in listed}.values())
            unsplit = [c for c in listed if c.tp == 1][:WARMUP_CASES]
            start = len(cases)
            for c in listed:
                cases.append(PlannedCase(len(cases), op.name, label, c.to_json(), c in unsplit, prof.strided_run))
            pairs.append(PairPlan(op.name, label, JUDGE, "", sc.scope, tuple(range(start, len(cases)))))
    return Plan(dict(options), tuple(pairs), tuple(cases)).with_id()


def case_of(pc: PlannedCase) -> Case:
    return Case.from_json(pc.case)
