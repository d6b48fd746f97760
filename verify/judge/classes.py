"""Comparison of a candidate's outputs by each output's class in the spec (bitwise, derived,
tie-aware ids), and the vacuity rule (a derived output whose oracle is all zeros or not finite)."""
from __future__ import annotations

import torch

from verify.judge import compare
from verify.judge.calls import on_device
from verify.model.opdef import OpDef, OpInputs
from verify.model.specs import ToleranceSpec
from verify.model.verdict import Check


def judge_outputs(op: OpDef, spec: ToleranceSpec, cand: dict, oracle: dict, base: dict, inputs: OpInputs,
          inputs64: OpInputs, baseline_err: dict | None = None) -> list[Check]:
    """Compare every output and state tensor by its spec class. Tie-aware ids are judged first; the
    outputs that depend on them are then judged against the reference recomputed with the
    candidate's ids (OpDef.reweigh), so an allowed choice inside the tie band is not punished. Ids
    that fail their check are still reweighed where well-formed (weights right for wrong ids are not
    reported ~1e5x over tolerance); where malformed, the outputs that depend on them fail unjudged."""
    checks = []
    names = list(op.outputs + op.state)
    magnitudes = op.magnitudes(_beside(inputs64, oracle), cand) if op.magnitudes is not None else {}
    unjudged: dict[str, str] = {}        # output -> why it was not judged (its ids are malformed)
    at_failed_ids: dict[str, str] = {}   # output -> the note that it was judged at ids that failed
    for name in [n for n in names if spec.output(n).klass == "tie_aware_ids"]:
        if op.tie_scores is None:
            raise ValueError(f"op {op.name}: output {name} is tie_aware_ids but the OpDef has no tie_scores")
        c = cand[name]
        s64, swd = op.tie_scores(inputs64), op.tie_scores(inputs)
        checks.append(compare.compare_tie_aware_ids(name, c, s64.cpu().double(), swd.cpu(), base[name].shape[-1],
                                                    magnitudes.get(name), spec.output(name).score_k or 1.0))
        if op.reweigh is None:
            continue
        why = compare.malformed_ids(c, tuple(base[name].shape), s64.shape[-1])
        if why:
            unjudged |= {n: f"not judged: the candidate's {name} are malformed ({why}), so no reference "
                         f"{n} exist for them" for n in op.reweigh(inputs, base[name])}
            continue
        oracle = {**oracle, **op.reweigh(inputs64, c.to(next(iter(oracle.values())).device))}
        reweighed = op.reweigh(inputs, c.to(next(iter(base.values())).device))
        base = {**base, **reweighed}
        baseline_err = None
        if not checks[-1].ok:
            at_failed_ids |= {n: f"judged at the candidate's {name}, which failed the {name} check" for n in reweighed}
    for name in names:
        out_spec = spec.output(name)
        c = cand[name]
        if name in unjudged:
            checks.append(Check(f"compare:{name}", False, unjudged[name]))
        elif out_spec.klass == "bitwise":
            checks.append(compare.compare_bitwise(name, c, base[name]))
        elif out_spec.klass == "derived":
            k, floor = out_spec.bounds(base[name].dtype)
            checks.append(compare.compare_derived(name, c, oracle[name], base[name], k, floor,
                                                  (baseline_err or {}).get(name), op.row_ndims.get(name, 1),
                                                  magnitudes.get(name), out_spec.element_floor_for(base[name].dtype)))
        if name in at_failed_ids and checks[-1].name == f"compare:{name}":
            done = checks[-1]
            checks[-1] = Check(done.name, done.ok, f"{done.detail}; {at_failed_ids[name]}", done.metrics, done.worst)
    return checks


def _beside(inputs: OpInputs, oracle: dict) -> OpInputs:
    """The float64 inputs on the oracle's device: the running-error magnitudes (OpDef.magnitudes) are
    a few passes over the largest tensors (a K3 KDA state of 64 rows is 70 M float64 elements), which a
    GPU makes in milliseconds where one CPU thread per worker takes seconds, a dozen times a case."""
    dev = next((t.device for t in oracle.values() if isinstance(t, torch.Tensor)), None)
    return inputs if dev is None else on_device(inputs, dev)


def derived_vacuity(op: OpDef, spec: ToleranceSpec, oracle: dict) -> str | None:
    for name in op.outputs + op.state:
        if spec.output(name).klass == "derived":
            why = compare.vacuous_reason(oracle[name])
            if why:
                return f"{name}: {why}"
    return None


