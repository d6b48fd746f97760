"""guard:outputs_kept and the late-write recheck: what a call handed back stays the caller's."""
from __future__ import annotations

from verify.judge.compare import compare_bitwise
from verify.model.opdef import OpDef
from verify.model.verdict import Check


def keep(op: OpDef, label: str, results: dict) -> tuple[str, dict, dict]:
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
        changed = [n for n in live if not compare_bitwise(n, live[n], copy[n]).ok]
        if changed:
            return Check(name, False, f"{label}the tensor{'s' if len(changed) > 1 else ''} "
                         f"{', '.join(changed)} returned by a first call changed during {later}: the "
                         "candidate hands out storage it writes again (a preallocated output buffer?)")
    return Check(name, True, f"returned outputs unchanged by {later}")


def written_after_return(call, later: str) -> list[Check]:
    """The call's inputs and canaries checked again once later calls have run: a write that lands
    after the call returned (a thread, a kernel on a stream the call did not wait for) passes the
    checks made at its return and corrupts the caller's tensors afterwards."""
    return [c if c.ok else Check(c.name, False, f"after {later} (a write landing after the call returned): {c.detail}")
            for c in call.recheck()]


def outputs_kept_so_far(ctx) -> list[Check]:
    """outputs_kept after the guard runs with the case's own values, before the strided runs: those
    can write the same bits back into a reused buffer and hide it."""
    held = outputs_kept(ctx.kept, "the later calls of this case")
    return [] if held.ok else [held]
