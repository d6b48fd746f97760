"""guard:strided_inputs and guard:misaligned_inputs: the inputs as strided / offset views, and as
contiguous views one element past a 16-byte boundary (then the out= buffers so placed). The results
must be the first run's (bitwise where the spec claims determinism and the candidate is held to it),
or the candidate must refuse with an error that names the layout it needs: a stated contract."""
from __future__ import annotations

from verify.judge.calls import call_failures, guarded_call
from verify.judge import placement
from verify.model.verdict import Check

MISALIGN = 1       # elements past an aligned base in the misaligned-inputs run (element_size bytes)


def message(error: str) -> str:
    """A candidate's error in lower case without the file it was raised in (" (at path:line)")."""
    return error.rsplit(" (at ", 1)[0].lower()


def strided_inputs(ctx) -> list[Check]:
    if not ctx.strided_run:
        return []
    strided = guarded_call(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.device, strided=True)
    checks, complete = call_failures(strided, ctx.first, "strided/offset views")
    if strided.error:
        ok = any(w in message(strided.error) for w in ("contiguous", "stride")) and not checks
        return checks + [Check("guard:strided_inputs", ok, f"strided inputs rejected: {strided.error}" if ok
                               else f"strided/offset inputs raised {strided.error}")]
    if not complete:
        return checks + [Check("guard:strided_inputs", False, "the strided run's outputs are incomplete")]
    return checks + [ctx.same_as_first("guard:strided_inputs", "strided/offset views", strided.results)]


def misaligned_inputs(ctx) -> list[Check]:
    """guard:misaligned_inputs: every input and state tensor contiguous, its base MISALIGN elements
    past a 16-byte boundary (a view such as x[1:] of a contiguous tensor; out= buffers aligned), then,
    for a candidate that takes out=, the out= buffers so placed (inputs aligned). Vector or TMA loads
    and stores that assume an aligned base touch other bytes there, or fault. The call's other guard
    failures (canaries, inputs changed, state not written back) are reported as this run's."""
    if not ctx.strided_run:
        return []
    checks = _misaligned_run(ctx, f"inputs {MISALIGN} element past an aligned base", "inputs", offset=MISALIGN)
    if ctx.op.outputs and placement.accepts_out(ctx.fn):
        checks += _misaligned_run(ctx, f"out= buffers {MISALIGN} element past an aligned base", "out= buffers",
                                  out_offset=MISALIGN)
    return checks


def _misaligned_run(ctx, where: str, what: str, offset: int = 0, out_offset: int = 0) -> list[Check]:
    name = "guard:misaligned_inputs"
    run = guarded_call(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.device, offset=offset, out_offset=out_offset)
    checks, complete = call_failures(run, ctx.first, where)
    if run.error and checks:           # wrote outside its outputs before it raised: no refusal
        return checks + [Check(name, False, f"{where}: raised {run.error} after the writes above")]
    if run.error:
        said = message(run.error)
        if "misaligned address" in said or "misalignedaddress" in said:    # CUDA's fault, not a refusal
            return [Check(name, False, f"{where}: the kernel faulted: {run.error}")]
        if "align" in said:
            return [Check(name, True, f"the candidate refused misaligned {what}: {run.error}")]
        return [Check(name, False, f"{where}: raised {run.error} (a refusal must say the {what} need "
                      "aligning)")]
    if not complete:
        return checks + [Check(name, False, f"{where}: the outputs are incomplete")]
    return checks + [ctx.same_as_first(name, where, run.results)]
