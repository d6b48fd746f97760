"""The case context every guard reads: one case's inputs, oracle and baseline, the candidate's launch
and its first call's results, and a memo of what the case's later runs share (other values drawn for
the case and their oracle), so each guard is a small function of this one record. Nothing in it
outlives the case: a guard's verdict depends on the case alone, not on what ran before in the process.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from verify.judge.calls import bitwise_same, on_device, run_plain, to_oracle
from verify.judge.classes import derived_vacuity, judge_outputs
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs
from verify.model.specs import ToleranceSpec
from verify.model.verdict import Check

REFRESH_SEEDS = 2        # other seeds tried for a case with the same shapes and static params


@dataclass
class CaseContext:
    op: OpDef
    spec: ToleranceSpec
    case: Case
    candidate: str                 # the candidate's label
    device: str
    reference: object              # the op's reference function
    inputs: OpInputs               # the case's inputs on the host, working dtypes
    inputs64: OpInputs             # the same upcast to float64 (the oracle's)
    dinputs: OpInputs              # the inputs on the device, once per case
    oracle: dict                   # the reference in float64
    base: dict                     # the reference in the working dtype (the baseline)
    strict: bool = True            # held to the spec's bitwise claims (every kernel but the CPU-BLAS stand-ins)
    strided_run: bool = True       # the strided and misaligned runs (not in the quick profile)
    warmup: bool = False           # guard:warmed_up on this case (the plan marks a few)
    fn: object = None              # the launch judged now (the default, or one declared variant)
    variant: str = ""              # "" or "variant NAME: ", prefixed to the variant's check details
    first_call: object = None      # calls.CallResult of that launch's first guarded call
    kept: list = field(default_factory=list)     # every launch's first results, with a copy (guard:outputs_kept)
    memo: dict = field(default_factory=dict)     # shared by the variants of the case

    @property
    def first(self) -> dict:
        return self.first_call.results

    def for_launch(self, fn, variant: str) -> "CaseContext":
        """The context for one launch of the case: the same inputs, oracle, memo and kept list."""
        return replace(self, fn=fn, variant=variant, first_call=None)

    def judge(self, results: dict, oracle: dict | None = None, base: dict | None = None,
              inputs: OpInputs | None = None, inputs64: OpInputs | None = None) -> list[Check]:
        """Compare results by class, against this case's oracle and baseline unless others are given."""
        return judge_outputs(self.op, self.spec, results, self.oracle if oracle is None else oracle,
                             self.base if base is None else base, inputs or self.inputs, inputs64 or self.inputs64)

    def same_as_first(self, name: str, where: str, results: dict) -> Check:
        """A later run's complete results against the first run's: bit for bit where the spec claims
        determinism and the candidate is held to its claims, else judged like a first call."""
        if self.spec.claims.deterministic and self.strict:
            from verify.judge.invariance import claim_check

            same = bitwise_same(name, self.first, results)
            return claim_check(Check(name, same.ok, f"{where}: {same.detail}", same.metrics, same.worst),
                               lambda: self.judge(results))
        bad = [c for c in self.judge(results) if not c.ok]
        return Check(name, not bad, f"{where}: " + ("; ".join(f"{c.name}: {c.detail}" for c in bad) or "within tolerance"),
                     bad[0].metrics if bad else {}, bad[0].worst if bad else ())

    def on_device(self, values: OpInputs) -> OpInputs:
        """`values` on the case's device, copied once per case: the guards place and compare other
        values device to device, as they do the case's own (the host copy stays the oracle's)."""
        if values is self.inputs:
            return self.dinputs
        held = self.memo.get(("device", id(values)))
        if held is None or held[0] is not values:       # held keeps values alive: its id is not reused
            held = self.memo[("device", id(values))] = (values, on_device(values, self.device))
        return held[1]

    def memoised(self, key: tuple, compute):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def judged_on(self, values: OpInputs, key: tuple | None = None) -> tuple[OpInputs, dict, dict] | None:
        """(float64 inputs, oracle, baseline) of other values for this case, or None where they are
        vacuous. Memoised under `key` (values built once per case share their oracle across variants)."""
        def now():
            v64 = to_oracle(values)
            oracle2 = run_plain(self.reference, self.op, v64, self.device)
            if derived_vacuity(self.op, self.spec, oracle2):
                return None
            return v64, oracle2, run_plain(self.reference, self.op, values, self.device)
        return self.memoised(("judged",) + key, now) if key is not None else now()

    def refreshed(self) -> tuple[int | None, OpInputs] | None:
        """refreshed_inputs of this case, once per case."""
        return self.memoised(("refreshed",), lambda: refreshed_inputs(self.op, self.case, self.inputs))

    @classmethod
    def first_launch(cls, op: OpDef, case: Case, fn, candidate: str, device: str = "cpu", **kw) -> "CaseContext":
        """The context of an unsplit case after the first call of `fn` (for a guard alone: tests, tools)."""
        from verify.judge.calls import guarded_call, on_device
        from verify.judge.candidates import reference_fn
        from verify.judge.guards.outputs import keep
        from verify.model.specs import load_spec

        ref, inputs = reference_fn(op), op.make_inputs(case)
        inputs64 = to_oracle(inputs)
        ctx = cls(op, load_spec(op.name), case, candidate, device, ref, inputs, inputs64, on_device(inputs, device),
                  run_plain(ref, op, inputs64, device), run_plain(ref, op, inputs, device), **kw)
        ctx = ctx.for_launch(fn, "")
        ctx.first_call = guarded_call(fn, op, ctx.dinputs, ctx.base, device)
        ctx.kept.append(keep(op, "", ctx.first))
        return ctx


def refreshed_inputs(op: OpDef, case: Case, first: OpInputs) -> tuple[int | None, OpInputs] | None:
    """(seed, inputs) of another seed of this case with the same tensor shapes, dtypes and params;
    where no seed within REFRESH_SEEDS draws them (an op whose shapes depend on the seed), (None,
    this case's inputs with its float tensors rescaled); None if nothing differs."""
    want = {k: (tuple(v.shape), v.dtype) for k, v in first.tensors.items()}
    for i in range(1, REFRESH_SEEDS + 1):
        seed = (case.seed + 7919 * i) % 2**31
        other = op.make_inputs(replace(case, seed=seed))
        if other.params == first.params and {k: (tuple(v.shape), v.dtype) for k, v in other.tensors.items()} == want:
            if any(not torch.equal(other.tensors[k], first.tensors[k]) for k in want):
                return seed, other
    # shapes drawn from the seed (paged caches, sequence lengths): the same case with every float
    # tensor scaled elementwise by factors in [0.5, 1.5); integer tensors (indices, lengths) kept
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    scaled = {k: (v * (0.5 + torch.rand(v.shape, generator=gen, dtype=torch.float64))).to(v.dtype)
              if v.is_floating_point() and v.numel() else v.clone() for k, v in first.tensors.items()}
    if any(not torch.equal(scaled[k], first.tensors[k]) for k in want):
        return None, OpInputs(scaled, dict(first.params))
    return None
