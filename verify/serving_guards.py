"""Guards for the ways a serving engine calls a kernel that one plain call does not
(property_tests/planted/serving.py plants a bug for each):

- guard:partial_refresh: new values written into the interior rows of the inputs only (a weight sync
  streamed in row chunks, one expert reloaded): a memo validated by a fingerprint of some rows, or
  keyed by anything the partial write leaves alone, answers for the old values;
- guard:state_chain: the next call fed the state the previous call wrote, in the same buffers, with
  new step inputs (a decode step): a kernel that keeps a shadow of the state it wrote and trusts it
  when the same bits come back misses what happened to the state in between (a block write);
- guard:out_omitted: a candidate that takes out= called without it (its allocating path);
- guard:owned_inputs: inputs that own their whole storage, with no canary buffer around them (how an
  engine's own allocations look): a kernel that takes such an input for a dead temporary writes into it;
- guard:thread_count: the call at another intra-op thread count (a host split over the threads that
  drops a remainder is exact wherever the count divides the work);
- guard:merged_inputs: inputs of one dtype and leading dims as adjacent column slices of one buffer,
  rows closed by a few spare elements (a merged projection's output, kda_in_proj's q|k|v|g|...): a
  fast path for adjacent slices that assumes the row stride is the sum of their widths reads other
  rows. A refusal that names contiguity or strides is a stated contract, as for strided views.

Each later call must give the first call's results (bitwise where the spec claims determinism and the
candidate is held to its claims) or, for new values, pass the comparison against the reference on them.
"""
from __future__ import annotations

import torch

from verify import guards
from verify.evaluate import (_Placed, _call_failures, _judged_on, _one_line, _same_as_first, case_memo, guarded_call,
                             judge, stale_or_wrong)
from verify.opdef import OpDef, OpInputs
from verify.specs import ToleranceSpec
from verify.verdict import Check

INDEX_DTYPES = (torch.int32, torch.int64)     # indices and lengths: a row-wise mix of two draws is no valid case
OTHER_THREADS = (3, 5)                       # thread counts that divide no power-of-two work split


def _mixed(op: OpDef, first: OpInputs, other: OpInputs) -> tuple[OpInputs, list[str]]:
    """first's values with the interior rows (dim 0, all but the first and last) of every tensor of 3 or
    more rows taken from other; index tensors kept. Returns the mix and the names changed."""
    tensors, changed = {}, []
    for k, v in first.tensors.items():
        v2 = other.tensors[k]
        if v.dim() >= 1 and v.shape[0] >= 3 and v.dtype not in INDEX_DTYPES and not torch.equal(v[1:-1], v2[1:-1]):
            v = v.clone()
            v[1:-1] = v2[1:-1]
            changed.append(k)
        tensors[k] = v
    return OpInputs(tensors, dict(first.params)), changed


def _second_call(name, op, spec, fn, placed: _Placed, values: OpInputs, judged, device, where: str) -> Check:
    """Call again on what `placed` now holds (`values`), outputs poisoned; judge against `judged`."""
    inputs64_2, oracle2, base2 = judged
    placed.expected = base2                   # what poison is read against: these values' reference
    for g in placed.outs.values():
        g.view.fill_(guards.poison_value(g.view.dtype))
    try:
        returned = placed.call(fn, values.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return Check(name, False, f"{where}: the call raised {_one_line(e)}")
    results, out_checks = placed.outputs(returned)
    bad = [c for c in out_checks + placed.unwritten(results) if not c.ok]
    bad = bad or [c for c in judge(op, spec, results, oracle2, base2, values, inputs64_2) if not c.ok]
    if bad:
        return stale_or_wrong(name, op, spec, fn, values, judged, device, bad, where, where)
    return Check(name, True, f"{where}: judged like a first call")


def partial_refresh_check(op: OpDef, spec: ToleranceSpec, fn, inputs: OpInputs, found, device) -> Check:
    """guard:partial_refresh (module doc). `found`: evaluate.refreshed_inputs(...)."""
    name = "guard:partial_refresh"
    if found is None:
        return Check(name, True, "not run: no other values with this case's shapes could be drawn")
    mixed, changed = case_memo(("mixed", op.name, id(inputs), id(found[1])), (inputs, found[1]),
                               lambda: _mixed(op, inputs, found[1]))
    if not changed:
        return Check(name, True, "not run: no tensor of 3 or more rows to rewrite in part")
    judged = _judged_on(op, spec, mixed, device)
    if judged is None:
        return Check(name, True, "not run: the partly rewritten case is vacuous")
    placed = _Placed(fn, op, inputs, judged[2], device)
    try:
        placed.call(fn, inputs.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return Check(name, False, f"the first call raised {_one_line(e)}")
    for k, g in placed.inputs.items():
        if k in op.state:                      # the first call moved the state: the mix's, whole
            g.view.data.copy_(mixed.tensors[k].to(device))
        elif k in changed:                     # rows 1..n-2 only, as a streamed weight sync writes
            g.view.data[1:-1].copy_(mixed.tensors[k][1:-1].to(device))
    return _second_call(name, op, spec, fn, placed, mixed, judged, device,
                        f"new values written into rows 1..n-2 of {', '.join(changed)} after a first call")


def state_chain_check(op: OpDef, spec: ToleranceSpec, fn, inputs: OpInputs, base: dict, found, device) -> Check:
    """guard:state_chain (module doc): the second call's reference runs from the state the candidate's
    first call wrote, so the step is judged alone. `base`: the case's baseline (the outputs' shapes);
    `found`: evaluate.refreshed_inputs(...)."""
    name = "guard:state_chain"
    if not op.state:
        return Check(name, True, "not run: the op keeps no state")
    if found is None:
        return Check(name, True, "not run: no other step inputs with this case's shapes could be drawn")
    step2 = found[1]
    placed = _Placed(fn, op, inputs, base, device)
    try:
        placed.call(fn, inputs.params)
    except Exception as e:  # the candidate's own failure is a verdict
        return Check(name, False, f"the first call raised {_one_line(e)}")
    chained = OpInputs({k: placed.inputs[k].view.detach().cpu().clone() if k in op.state else step2.tensors[k]
                        for k in inputs.tensors}, dict(step2.params))
    try:
        judged = _judged_on(op, spec, chained, device)
    except (ValueError, RuntimeError, IndexError) as e:    # a step the reference refuses (a full cache)
        return Check(name, True, f"not run: the reference refuses the chained step ({_one_line(e)})")
    if judged is None:
        return Check(name, True, "not run: the chained step is vacuous")
    for k, g in placed.inputs.items():
        if k not in op.state:
            g.view.copy_(step2.tensors[k].to(device))
    return _second_call(name, op, spec, fn, placed, chained, judged, device,
                        "a second step on the state the first call wrote, in the same buffers")


def call_form_checks(op: OpDef, spec: ToleranceSpec, fn, dinputs: OpInputs, base: dict, first: dict, oracle: dict,
                     inputs: OpInputs, inputs64: OpInputs, device, strict: bool) -> list[Check]:
    """guard:out_omitted, guard:owned_inputs and guard:thread_count (module doc): each must give the first
    call's results."""
    checks = []
    if op.outputs and guards.accepts_out(fn):
        checks += _form_run("guard:out_omitted", "a call without out=", op, spec, fn, dinputs, base, first, oracle,
                            inputs, inputs64, device, strict, use_out=False)
    checks += _form_run("guard:owned_inputs", "inputs that own their whole storage", op, spec, fn, dinputs, base,
                        first, oracle, inputs, inputs64, device, strict, owned=True)
    if guards.merge_groups(dinputs.tensors, op.state):
        checks += _form_run("guard:merged_inputs", "inputs side by side in one buffer (a merged projection's output)",
                            op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict,
                            refusals=("contiguous", "stride"), merged=True)
    prev = torch.get_num_threads()
    threads = OTHER_THREADS[0] if prev != OTHER_THREADS[0] else OTHER_THREADS[1]
    torch.set_num_threads(threads)
    try:
        checks += _form_run("guard:thread_count", f"{threads} intra-op threads (the process runs {prev})", op, spec,
                            fn, dinputs, base, first, oracle, inputs, inputs64, device, strict)
    finally:
        torch.set_num_threads(prev)
    return checks


def _form_run(name, where, op, spec, fn, dinputs, base, first, oracle, inputs, inputs64, device, strict,
              refusals: tuple[str, ...] = (), **call) -> list[Check]:
    run = guarded_call(fn, op, dinputs, base, device, **call)
    checks, complete = _call_failures(run, first, where)
    if run.error and not checks and any(w in run.error.lower() for w in refusals):
        return [Check(name, True, f"{where}: refused: {run.error}")]
    if run.error:
        return checks + [Check(name, False, f"{where}: raised {run.error}")]
    if not complete:
        return checks + [Check(name, False, f"{where}: the outputs are incomplete")]
    return checks + [_same_as_first(name, where, run.results, first, op, spec, strict, oracle, base, inputs, inputs64)]
