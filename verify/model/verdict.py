"""Frozen records that flow one way: checks -> case verdicts -> op verdicts. Reporters read these."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP, VACUOUS, WAIVED, XPASS = "pass", "fail", "skip", "vacuous", "waived", "unexpected_pass"


@dataclass(frozen=True)
class Check:
    """One guard or one comparison of one output."""
    name: str                 # e.g. "compare:y", "guard:inputs_unchanged"
    ok: bool
    detail: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    worst: tuple = ()         # ((index, candidate, oracle, baseline), ...)


@dataclass(frozen=True)
class CaseVerdict:
    op: str
    candidate: str
    case: str                 # Case.to_json()
    status: str               # pass | fail | vacuous | skip
    stage: str = ""           # where it failed: inputs, candidate, guard:<name>, compare:<output>
    reason: str = ""
    checks: tuple[Check, ...] = ()
    seconds: float = 0.0

    def failing(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class OpVerdict:
    op: str
    candidate: str
    status: str               # pass | fail | skip | waived | unexpected_pass
    cases_run: int = 0
    cases_passed: int = 0
    cases_vacuous: int = 0
    reason: str = ""
    failure: CaseVerdict | None = None
    repro: str = ""
    worst_ratio: dict[str, float] = field(default_factory=dict)   # output -> max err / tolerance seen
    seconds: float = 0.0
    details: tuple[str, ...] = ()
    scope: tuple[str, ...] = ()   # the candidate's declared scope ("scope: l2_eps = 1e-6 only (...)"); () = the whole contract

    def to_dict(self) -> dict:
        return asdict(self)
