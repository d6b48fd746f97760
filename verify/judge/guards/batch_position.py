"""guard:batch_position: the batch permuted, run, and un-permuted gives each row the bits (where the
spec claims batch invariance and the candidate is held to it) or the tolerance of its first run."""
from __future__ import annotations

import torch

from verify.judge.calls import bitwise_same, call_failures, guarded_call, run_plain
from verify.judge.invariance import claim_check
from verify.model.opdef import OpDef, OpInputs
from verify.model.verdict import Check


def permute_batch(op: OpDef, inputs: OpInputs, perm: torch.Tensor) -> OpInputs:
    t = {k: v.index_select(op.batch_dims[k], perm.to(v.device)) if k in op.batch_dims else v
         for k, v in inputs.tensors.items()}
    return OpInputs(t, dict(inputs.params))


def unpermute(op: OpDef, results: dict, perm: torch.Tensor) -> dict:
    inv = torch.argsort(perm)
    return {k: v.index_select(op.batch_dims[k], inv.to(v.device)) if k in op.batch_dims else v
            for k, v in results.items()}


def check(ctx) -> list[Check]:
    op, batch = ctx.op, ctx.case.batch
    if not op.batch_dims or batch <= 1:
        return []
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(ctx.case.seed))
    if torch.equal(perm, torch.arange(batch)):
        perm = torch.roll(perm, 1)
    p_inputs = permute_batch(op, ctx.dinputs, perm)      # on the device: no host copies
    p_base = run_plain(ctx.reference, op, p_inputs, ctx.device)
    moved = guarded_call(ctx.fn, op, p_inputs, p_base, ctx.device)
    checks, complete = call_failures(moved, ctx.first, "permuted batch")
    if moved.error:
        return checks + [Check("guard:batch_position", False, f"permuted batch raised {moved.error}")]
    if not complete:
        return checks + [Check("guard:batch_position", False, "the permuted batch's outputs are incomplete")]
    back = unpermute(op, moved.results, perm)
    if ctx.spec.claims.batch_invariant and ctx.strict:     # right values with other bits: invariance:batch_position
        return checks + [claim_check(bitwise_same("guard:batch_position", ctx.first, back), lambda: ctx.judge(back))]
    res = ctx.judge(back)
    return checks + [Check("guard:batch_position", all(c.ok for c in res),
                           "; ".join(c.detail for c in res if not c.ok) or "within tolerance after permutation")]
