"""guard:inference_mode: the call under torch.inference_mode(), as a serving engine makes it (grad
off, inference tensors), gives the first run's results (bitwise under the strided run's rule). A
kernel that dispatches on torch.is_grad_enabled() or is_inference_mode_enabled() to a "serving" fast
path is otherwise judged only on the path the harness's grad-enabled calls take."""
from __future__ import annotations

import torch

from verify.judge.calls import call_failures, guarded_call
from verify.model.verdict import Check


def check(ctx) -> list[Check]:
    if not ctx.strided_run:
        return []
    name, where = "guard:inference_mode", "under torch.inference_mode()"
    with torch.inference_mode():
        run = guarded_call(ctx.fn, ctx.op, ctx.dinputs, ctx.base, ctx.device)
    if run.error:
        return [Check(name, False, f"{where}: raised {run.error}")] + run.checks
    checks, complete = call_failures(run, ctx.first, where)
    if not complete:
        return checks + [Check(name, False, f"{where}: the outputs are incomplete")]
    return checks + [ctx.same_as_first(name, where, run.results)]
