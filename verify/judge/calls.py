"""One guarded call of a candidate, and the plain runs of trusted functions (the reference).

`Placed` holds one call's tensors: inputs (and state) in canary buffers, poisoned `out=` buffers;
`guarded_call` makes the call and checks what it did (outputs' type, aliasing, canaries, inputs left
unchanged, process state put back). Every guard builds on these.
"""
from __future__ import annotations

import functools
import traceback

import torch

from verify.judge import process_state
from verify.judge.compare import compare_bitwise
from verify.judge import placement as guards
from verify.model.opdef import OpDef, OpInputs
from verify.model.verdict import Check

def on_device(inputs: OpInputs, device) -> OpInputs:
    """The inputs copied to `device` once per case, for the candidate's guarded calls: each call
    places (and afterwards compares) its inputs from these, device to device, instead of copying
    every tensor from the host twice per call. The same tensors on the CPU."""
    if str(device) == "cpu":
        return inputs
    return OpInputs({k: v.to(device) for k, v in inputs.tensors.items()}, dict(inputs.params))


def to_oracle(inputs: OpInputs) -> OpInputs:
    """Exact upcast of every floating tensor to float64; integer tensors unchanged."""
    return OpInputs({k: v.to(torch.float64) if v.is_floating_point() else v.clone() for k, v in inputs.tensors.items()},
                    dict(inputs.params))


def collect(op: OpDef, returned, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = op.outputs
    got = () if not names else ((returned,) if len(names) == 1 and not isinstance(returned, (tuple, list))
                                else tuple(returned))
    results = dict(zip(names, got))
    results.update({s: tensors[s] for s in op.state})
    return results


def run_plain(fn, op: OpDef, inputs: OpInputs, device) -> dict[str, torch.Tensor]:
    """Run a trusted function (the reference) on private copies; return outputs and state after."""
    tensors = {k: v.to(device).clone() for k, v in inputs.tensors.items()}
    return collect(op, fn(**tensors, **inputs.params), tensors)


class CandidateExit(RuntimeError):
    """A candidate raised SystemExit: an in-process run (--no-isolate) judges it a failure and goes on
    instead of ending the whole run with no certificate."""


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {msg[:300]}{where}"


class Placed:
    """One candidate call's tensors: inputs (and state) in canary buffers, poisoned `out=` buffers
    for a destination-passing candidate, and the keyword arguments that pass them. `offset`: the
    inputs' (and state's) views start that many elements past an aligned base; outputs stay aligned."""

    def __init__(self, fn, op: OpDef, inputs: OpInputs, expected: dict[str, torch.Tensor], device,
                 strided: bool = False, offset: int = 0, out_offset: int = 0, use_out: bool = True,
                 owned: bool = False, merged: bool = False):
        self.op, self.device, self.expected = op, device, expected
        self.inputs = {k: guards.place(k, v, device, strided=strided, offset=offset, owned=owned)
                       for k, v in inputs.tensors.items()}
        for group in guards.merge_groups(inputs.tensors, op.state) if merged else ():
            self.inputs.update(guards.place_merged(group, inputs.tensors, device))
        self.outs: dict[str, guards.Guarded] = {}
        self.kwargs = {k: g.view for k, g in self.inputs.items()}
        if use_out and op.outputs and guards.accepts_out(fn):
            self.outs = {n: guards.place(n, expected[n], device, strided=False, poison=True, offset=out_offset)
                         for n in op.outputs}
            self.kwargs["out"] = tuple(self.outs[n].view for n in op.outputs) if len(op.outputs) > 1 \
                else self.outs[op.outputs[0]].view

    def launch(self, fn, params: dict):
        """The candidate on these tensors, with the allocator poisoned, not waited for (the caller
        synchronizes); raises what it raises."""
        guards.poison_allocator([self.expected[n] for n in self.op.outputs], self.device)
        with guards.poisoned_empty():
            try:
                return fn(**self.kwargs, **params)
            except SystemExit as e:      # sys.exit() in a candidate: its verdict, not the end of a
                raise CandidateExit(f"the candidate called sys.exit({e.code!r})") from None   # --no-isolate run

    def call(self, fn, params: dict):
        """launch(), then wait for the device."""
        returned = self.launch(fn, params)
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return returned

    def outputs(self, returned) -> tuple[dict[str, torch.Tensor], list[Check]]:
        """What it returned or wrote, matched to the op's outputs and state; type and aliasing checks."""
        results, checks = guards.check_outputs(self.op, returned, self.expected, self.inputs, self.outs)
        results.update({s: self.inputs[s].view for s in self.op.state})
        return results, checks

    def unwritten(self, results: dict[str, torch.Tensor]) -> list[Check]:
        """Poison left in an output (when every output came back)."""
        if len(results) != len(self.op.outputs) + len(self.op.state):
            return []
        return [guards.check_unwritten({n: results[n] for n in self.op.outputs}, self.expected)]


def guarded_call(fn, op: OpDef, inputs: OpInputs, expected: dict[str, torch.Tensor], device,
                 strided: bool = False, offset: int = 0, out_offset: int = 0, use_out: bool = True,
                 owned: bool = False, merged: bool = False) -> guards.CallResult:
    """Call the candidate once with every tensor in a canary buffer; check what it did."""
    placed = Placed(fn, op, inputs, expected, device, strided, offset, out_offset, use_out, owned, merged)
    before = process_state.process_state(device)
    try:
        returned = placed.call(fn, inputs.params)
    except Exception as e:  # the candidate's own failure is a verdict, never a crash of the run
        process_state.restore_process_state(before, device)
        try:    # a refusal must not hide writes made before it (canaries, inputs), where they can be read
            wrote = guards.check_inputs_and_canaries(op, placed.inputs, inputs.tensors, placed.outs)
        except Exception:       # a sticky device error: the raise is the verdict
            wrote = []
        return guards.CallResult(checks=[c for c in wrote if not c.ok], error=one_line(e))
    changed = process_state.restore_process_state(before, device)
    results, checks = placed.outputs(returned)
    inputs_and_canaries = functools.partial(guards.check_inputs_and_canaries, op, placed.inputs, inputs.tensors,
                                            placed.outs)
    checks += inputs_and_canaries()
    checks.append(process_state.process_state_check(changed))
    return guards.CallResult(results=results, checks=checks + placed.unwritten(results), recheck=inputs_and_canaries)


def call_failures(call: guards.CallResult, first: dict, where: str) -> tuple[list[Check], bool]:
    """A later guarded call's own failed checks (output type, canaries, inputs, process state),
    relabelled with `where`, and whether its results hold every output `first` has (else nothing
    of it can be compared)."""
    bad = [Check(c.name, False, f"{where}: {c.detail}", c.metrics, c.worst) for c in call.checks if not c.ok]
    return bad, all(n in call.results for n in first)


def bitwise_same(tag: str, a: dict, b: dict) -> Check:
    """`b` (a later run's outputs) bit for bit against `a` (the first run's); a failure carries each
    differing output's mismatch count and the worst elements of the first one, as
    (index, this run, first run, None)."""
    diffs = [(n, r) for n in a if not (r := compare_bitwise(n, b[n], a[n])).ok]
    if not diffs:
        return Check(tag, True, "bitwise identical")
    counts = "; ".join(f"{n}: {r.metrics['mismatches']} of {b[n].numel()} elements differ" for n, r in diffs)
    return Check(tag, False, f"outputs differ bitwise from the first run's: {counts}",
                 {"mismatches": sum(r.metrics["mismatches"] for _, r in diffs)}, diffs[0][1].worst)


