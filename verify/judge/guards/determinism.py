"""guard:deterministic: a second call on the same inputs gives the first call's bits (where the spec
claims determinism), and does not hand back the storage the first call returned (guard:outputs_kept)."""
from __future__ import annotations

from verify.judge.calls import bitwise_same, call_failures, guarded_call
from verify.judge import placement
from verify.judge.guards.outputs import outputs_kept
from verify.judge.invariance import claim_check
from verify.model.verdict import Check


def second_run(ctx) -> list[Check]:
    again = guarded_call(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.device)
    if again.error:
        return [Check("guard:deterministic", False, f"second run raised {again.error}")] + again.checks
    bad, complete = call_failures(again, ctx.first, "second run")
    if bad:
        return bad if complete else bad + [Check("guard:deterministic", False, "the second run's outputs are incomplete")]
    mine = ctx.kept[-1][1]
    same = [n for n in mine if n in again.results and placement.overlaps(again.results[n], ctx.first[n])]
    reused = Check("guard:outputs_kept", False, f"the second call returned {', '.join(same)} in the storage "
                   "the first call returned it in: the candidate hands out one preallocated buffer") if same \
        else outputs_kept([ctx.kept[-1]], "the second call")
    if not reused.ok:           # before the determinism check, which would compare a tensor with itself
        return [reused]
    if ctx.spec.claims.deterministic:     # right values with other bits: invariance:deterministic
        return [claim_check(bitwise_same("guard:deterministic", ctx.first, again.results),
                            lambda: ctx.judge(again.results))]
    return []
