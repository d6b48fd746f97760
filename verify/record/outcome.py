"""A run's outcome from its op verdicts: what was certified, skipped and failed, counted apart, and
whether the run succeeded. An op succeeds only when some candidate certified it (pass, or failed
exactly as its spec waives) and none failed: a run whose every candidate of an op was skipped has
certified nothing for that op, and `check` on its certificate says the same."""
from __future__ import annotations

from dataclasses import dataclass

from verify.model.verdict import FAIL, PASS, SKIP, WAIVED, XPASS

CERTIFIED = (PASS, WAIVED)


@dataclass(frozen=True)
class Outcome:
    certified: int                  # op/candidate pairs
    skipped: int
    failed: int
    uncertified_ops: tuple[str, ...]   # ops with no failure and no certified candidate (all skipped)
    failed_ops: tuple[str, ...]
    scoped: int = 0                 # certified pairs only in a candidate's declared scope (DTYPES, PARAMS)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.uncertified_ops

    def line(self) -> str:
        scoped = f" ({self.scoped} only in a declared scope)" if self.scoped else ""
        text = f"{self.certified} certified{scoped}, {self.skipped} skipped, {self.failed} failed op/candidate pairs"
        if self.failed_ops:
            text += f"; failed: {', '.join(self.failed_ops)}"
        if self.uncertified_ops:
            text += f"; no certified candidate (every one skipped): {', '.join(self.uncertified_ops)}"
        return text


def outcome(verdicts) -> Outcome:
    by_op: dict[str, list[str]] = {}
    for v in verdicts:
        by_op.setdefault(v.op, []).append(v.status)
    failed_ops = tuple(op for op, st in by_op.items() if any(s in (FAIL, XPASS) for s in st))
    uncertified = tuple(op for op, st in by_op.items()
                        if op not in failed_ops and not any(s in CERTIFIED for s in st))
    statuses = [v.status for v in verdicts]
    return Outcome(sum(s in CERTIFIED for s in statuses), sum(s == SKIP for s in statuses),
                   sum(s in (FAIL, XPASS) for s in statuses), uncertified, failed_ops,
                   sum(v.status in CERTIFIED and bool(getattr(v, "scope", ())) for v in verdicts))
