"""Invariance claims judged apart from values: a candidate whose results are right (within the
spec's tolerance) but not bit-identical where the spec claims they are (run to run, at another batch
position, on strided or offset views, under inference mode) gets the stage `invariance:<claim>`,
not the plain guard failure that a wrong value gets. A batch-variant cuBLAS-backed kernel then reads
as what it is; it still fails (the release gate demands the claims the spec makes)."""
from __future__ import annotations

from typing import Callable

from verify.model.verdict import Check

CLAIMS = {"guard:deterministic": "run-to-run determinism (spec claims.deterministic)",
          "guard:batch_position": "batch invariance (spec claims.batch_invariant)"}
_DEFAULT = "identical bits for the same values in any layout (spec claims.deterministic)"


def claim_check(check: Check, judged: Callable[[], list[Check]]) -> Check:
    """`check` (a bitwise comparison of a later run's results with the first run's) as an invariance
    failure where the later results are still within tolerance (`judged()`: their comparison checks)."""
    if check.ok or any(not c.ok for c in judged()):
        return check
    claim = CLAIMS.get(check.name, _DEFAULT)
    return Check(check.name, False, f"{check.detail}; the values are within tolerance, but the spec claims {claim}",
                 {**check.metrics, "invariance": claim}, check.worst)


def stage(check: Check) -> str:
    """The case verdict's stage for a failing check: invariance:<guard> for a claim broken within
    tolerance, else the check's name."""
    return f"invariance:{check.name.split(':', 1)[1]}" if check.metrics.get("invariance") else check.name
