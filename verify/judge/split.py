"""Tensor-parallel split cases, simulated in one process: shard, run every rank, combine, compare."""
from __future__ import annotations

import torch

from verify.judge.calls import guarded_call, run_plain
from verify.judge.classes import judge_outputs as judge
from verify.model.verdict import FAIL, PASS, Check


def _row_err(a: torch.Tensor, o: torch.Tensor, row_ndim: int = 1) -> torch.Tensor:
    """Per row, the baseline's largest error over the elements where both it and the oracle are
    finite (as compare_derived takes it unsplit): a row with a NaN or infinity elsewhere keeps the
    error of its finite elements (a NaN max here became a zero row error, a tolerance of the median
    rule alone: the fused kda_decode failed a split nonfinite case on its ordinary ulps)."""
    from verify.judge.compare import _rows, baseline_error

    a = _rows(a, row_ndim)
    return baseline_error(a, _rows(o, row_ndim, a.device)).amax(-1)


def run_split(op, case, fn, inputs, inputs64, oracle, base, spec, device, verdict):
    """The candidate runs per rank on its shard; the combined result is judged against the unsplit
    oracle, with the baseline error the larger of the unsplit and the split reference's own error."""
    from verify.judge.candidates import reference_fn

    if op.split is None:
        return verdict(FAIL, "split", f"op {op.name} declares no split rule but the case asks for T={case.tp}")
    if case.tp not in op.split.tp_values:
        return verdict(FAIL, "split", f"T={case.tp} not in the op's tp_values {op.split.tp_values}")
    ref = reference_fn(op)
    shards = op.split.shard(inputs, case.tp)
    base_ranks = [run_plain(ref, op, s, device) for s in shards]
    base_split = op.split.combine(base_ranks, inputs)
    checks, cand_ranks = [], []
    for rank, (shard, expected) in enumerate(zip(shards, base_ranks)):
        res = guarded_call(fn, op, shard, expected, device)
        if res.error:
            return verdict(FAIL, "candidate", f"rank {rank}/{case.tp} raised {res.error}")
        bad = [c for c in res.checks if not c.ok]
        if bad:
            return verdict(FAIL, bad[0].name, f"rank {rank}/{case.tp}: {bad[0].detail}", res.checks)
        cand_ranks.append(res.results)
    cand = op.split.combine(cand_ranks, inputs)
    base_err = {n: torch.maximum(_row_err(base[n], oracle[n], op.row_ndims.get(n, 1)),
                                 _row_err(base_split[n], oracle[n], op.row_ndims.get(n, 1)))
                for n in op.outputs + op.state if base[n].is_floating_point()}
    judge_base = {n: base_split[n] if spec.output(n).klass == "bitwise" else base[n] for n in op.outputs + op.state}
    checks += judge(op, spec, cand, oracle, judge_base, inputs, inputs64, base_err)
    checks.append(Check("split:ranks", True, f"T={case.tp}, {op.split.kind}, order: {op.split.reduction_order}"))
    bad = [c for c in checks if not c.ok]
    if bad:
        return verdict(FAIL, bad[0].name, f"T={case.tp}: {bad[0].detail}", checks)
    return verdict(PASS, checks=checks)
