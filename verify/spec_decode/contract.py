"""The contract every speculative-decoding rollback design through KDA must show its caller, checked on
one drive: `steps` verify+accept steps of B sequences with up to n_q draft tokens each, the accepted
lengths drawn from the seed (every sequence all n_tokens at step 0, none at step 1, then 0, n_tokens
and in between, ragged n_tokens), on the inputs verify.ops.kda builds for kda_decode cases.

Properties (verify/spec_decode/design.py says what a design implements):

prefix (1)       After n_tokens drafted and `a` accepted, the outputs of the first `a` tokens and the
                 committed state are those of the same design, forked before the step, verifying only
                 those `a` tokens (the draft slots past them NaN) and accepting them: bit for bit. And
                 against the float64 oracle (references.kda.kda_decode in float64, one token at a time,
                 from the design's own committed state before the step), by kda_decode's classes and
                 tolerances (tolerance_specs/kda_decode.toml; the baseline is the same reference in the
                 working dtype from the same state): y of every verified token derived, the committed
                 conv_state bitwise, the committed state derived with its running-error magnitude
                 (verify.ops.kda.decode_state_magnitude of the last accepted token). The a accepted
                 tokens are a steps of kda_decode: the baseline carries a steps of rounding as the
                 candidate does, and kda_layer.toml's growth argument (below) keeps a candidate within
                 k of the baseline per step within k of it after a steps; the floor is the last step's.
accept-zero (2)  A sequence that accepts 0 tokens keeps its committed state bit for bit.
growth (3)       Over the whole drive, against the float64 oracle run over the accepted tokens from the
                 first committed state, with the reference in the working dtype over the same tokens as
                 the baseline: after every step the committed recurrent state within kda_layer.toml's
                 recurrent_state bound, the verified tokens' y within kda_decode.toml's y bound, the
                 conv_state bitwise (kda_decode.toml: a copy of raw inputs, which this drive gives
                 exactly). Why a per-step bound holds at step 64: kda_layer.toml's derivation, "Growth
                 over steps": the fp32 state obeys S_t = A_t S_{t-1} + beta k u^T with ||A_t|| <= 1, so
                 a carried error never grows and each step adds one write's relative error; a candidate
                 within k = 4 of the baseline per step (kda_decode.toml) stays within k = 4 of the
                 baseline's own accumulated error at every step (the contraction carries both alike).
                 Nothing is loosened: the same k and floors as the specs, judged by verify.judge.compare;
                 as in judge_outputs, an output's bounds are those of its own dtype (the fp32 state takes
                 recurrent_state's by_dtype.float32: k = 4, 16 ulps of the row maximum).
poison (4)       A second copy of the design runs the same drive while the harness overwrites its
                 declared rollback storage past the accepted prefix (NaN, integer garbage) between its
                 verify and accept and again after the accept: its outputs and committed states must be
                 those of the untouched copy, bit for bit.
run              The design raised, or returned a tensor of the wrong shape or dtype (the drive stops).

Comparisons are verify.judge.compare's (compare_derived, compare_bitwise) with each output's class
and bounds read from tolerance_specs/ as verify.judge.classes.judge_outputs reads them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from verify.spec_decode.design import LAYER
from verify.spec_decode.drive import (Drive, as_drafted, at_count, draft_tokens, draw_counts,  # noqa: F401
                                      last_token_magnitude, reference_draft, start_inputs)

PROPERTIES = {
    "prefix": "(1) n_tokens drafted then a accepted = a tokens run alone (bitwise against the design itself; "
              "kda_decode's classes against the float64 oracle)",
    "accept-zero": "(2) accepting 0 leaves the committed state bitwise unchanged",
    "growth": "(3) every step within the declared error growth against the float64 oracle "
              "(kda_layer.toml recurrent_state, kda_decode.toml y and conv_state)",
    "poison": "(4) rollback storage past the accepted prefix is never read afterwards (poisoned between steps)",
    "run": "the design runs and returns tensors in kda_decode's layout",
}
MAX_REPORTED = 6          # violations kept per property (the rest are counted)
INT_POISON = -0x5A5A5A5


@dataclass(frozen=True)
class Violation:
    prop: str
    step: int
    sequence: int | None
    message: str

    def __str__(self) -> str:
        where = f"step {self.step}" + ("" if self.sequence is None else f" sequence {self.sequence}")
        return f"{self.prop}: {where}: {self.message}"


@dataclass
class Tally:
    checks: int = 0
    violations: int = 0
    worst_ratio: float = 0.0          # largest err / tolerance of the derived comparisons
    worst_step: int | None = None


@dataclass
class ContractReport:
    drive: Drive
    violations: list[Violation] = field(default_factory=list)
    tally: dict[str, Tally] = field(default_factory=lambda: {p: Tally() for p in PROPERTIES})
    steps_run: int = 0

    @property
    def unjudged(self) -> list[str]:
        """Contract properties the drive never checked (it stopped early, or too few steps)."""
        return [p for p, t in self.tally.items() if p != "run" and not t.checks]

    @property
    def ok(self) -> bool:
        return not any(t.violations for t in self.tally.values()) and not self.unjudged

    def add(self, v: Violation) -> None:
        t = self.tally[v.prop]
        t.violations += 1
        if t.violations <= MAX_REPORTED:
            self.violations.append(v)


class _Stop(Exception):
    """The design cannot be driven further (it raised, or broke the layout): already recorded."""


# ---- judging by the specs ------------------------------------------------------------------------

def _judge(op: str, name: str, cand, oracle, base, magnitude=None):
    """One output by its class in tolerance_specs/<op>.toml, as verify.judge.classes.judge_outputs does."""
    from verify.judge import compare
    from verify.model.specs import load_spec
    from verify.ops.registry import get_op

    out = load_spec(op).output(name)
    if out.klass == "bitwise":
        return compare.compare_bitwise(name, cand, base)
    k, floor = out.bounds(base.dtype)
    return compare.compare_derived(name, cand, oracle, base, k, floor, None, get_op(op).row_ndims.get(name, 1),
                                   magnitude, out.element_floor_for(base.dtype))


def _bitwise(cand, ref):
    from verify.judge import compare

    return compare.compare_bitwise("bits", cand, ref)


class _Judge:
    """Judges a quantity over a subset of sequences and records violations by sequence."""

    def __init__(self, report: ContractReport):
        self.report = report

    def rows(self, prop: str, step: int, what: str, seqs: torch.Tensor, run) -> None:
        """run(mask) -> Check over the rows of the sequences where mask; judged on all of `seqs` at once,
        then sequence by sequence to name the ones that fail."""
        if not bool(seqs.any()):
            return
        tally = self.report.tally[prop]
        check = run(seqs)
        tally.checks += 1
        ratio = check.metrics.get("ratio")
        if ratio is not None and ratio > tally.worst_ratio:
            tally.worst_ratio, tally.worst_step = float(ratio), step
        if check.ok:
            return
        named = False
        for b in torch.nonzero(seqs).flatten().tolist():
            one = torch.zeros_like(seqs)
            one[b] = True
            c = run(one)
            if not c.ok:
                named = True
                self.report.add(Violation(prop, step, b, f"{what}: {_describe(c)}"))
        if not named:
            self.report.add(Violation(prop, step, None, f"{what}: {_describe(check)}"))


def _describe(check) -> str:
    m = check.metrics
    if "ratio" in m:
        return f"err/tol {m['ratio']:.3g} ({check.detail})"
    if "mismatches" in m:
        w = check.worst[0] if check.worst else None
        at = "" if w is None else f"; first at {list(w[0])}: {w[1]:.6g} vs {w[2]:.6g}"
        return f"{m['mismatches']} elements differ bitwise{at}"
    return check.detail


# ---- the drive -----------------------------------------------------------------------------------

def _call(report: ContractReport, step: int, what: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:                    # a design that raises fails the run; the message is the report
        report.add(Violation("run", step, None, f"{what} raised {type(e).__name__}: {e}"))
        raise _Stop from None


def _expect(report: ContractReport, step: int, what: str, t, shape, dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        report.add(Violation("run", step, None, f"{what}: expected {tuple(shape)} {dtype}, got {got}"))
        raise _Stop
    return t.detach().clone()


def _committed(report, step, design, what, like_conv, like_state):
    got = _call(report, step, f"{what}.committed()", design.committed)
    if not (isinstance(got, tuple) and len(got) == 2):
        report.add(Violation("run", step, None, f"{what}.committed(): expected (conv_state, state), got "
                                                f"{type(got).__name__}"))
        raise _Stop
    return (_expect(report, step, f"{what}.committed() conv_state", got[0], like_conv.shape, like_conv.dtype),
            _expect(report, step, f"{what}.committed() state", got[1], like_state.shape, like_state.dtype))


def poison(report: ContractReport, step: int, design, extra: torch.Tensor) -> None:
    """Overwrite the design's declared rollback storage at slots >= kept[b] + extra[b] of every sequence."""
    bufs = _call(report, step, "rollback_buffers()", design.rollback_buffers)
    B = extra.shape[0]
    for entry in bufs:
        name, t, kept = entry
        if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == B and isinstance(kept, torch.Tensor)
                and tuple(kept.shape) == (B,)):
            report.add(Violation("run", step, None, f"rollback_buffers(): {name!r} is not a [B={B}, S, ...] tensor "
                                                    f"with kept [B]"))
            raise _Stop
        S = t.shape[1]
        dead = torch.arange(S, device=t.device).view(1, S) >= (kept.to(t.device).long() + extra.to(t.device).long()).view(B, 1)
        dead = dead.view(dead.shape + (1,) * (t.dim() - 2))
        with torch.no_grad():
            if t.is_floating_point() or t.is_complex():
                t.masked_fill_(dead, float("nan"))
            elif t.dtype != torch.bool:
                t.masked_fill_(dead, INT_POISON if t.dtype not in (torch.uint8, torch.int8) else 0x5A)


def _fork(design):
    fork = getattr(design, "fork", None)
    return fork() if callable(fork) else copy.deepcopy(design)


def check_contract(factory, drive: Drive) -> ContractReport:
    """Drive a fresh design from `factory()` (and a poisoned twin) over `drive`; every property's checks
    and violations. `factory` is a callable returning a design (verify.spec_decode.design)."""
    report = ContractReport(drive)
    dev = torch.device(drive.device)
    start = start_inputs(drive)
    layer = {n: start.tensors[n].to(dev) for n in LAYER}
    params = dict(start.params)
    conv0, state0 = start.tensors["conv_state"].to(dev), start.tensors["state"].to(dev)
    ref = _Reference(layer, {n: v.double() for n, v in layer.items()}, params)
    begin = dict(conv_state=conv0, state=state0, **layer, **params, n_q=drive.n_q)
    try:
        design = _call(report, 0, "the design factory", factory)
        twin = _call(report, 0, "the design factory", factory)
        for d in (design, twin):
            _call(report, 0, "begin()", d.begin, **{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                    for k, v in begin.items()})
        traj = {"wd": (conv0.clone(), state0.clone()), "64": (conv0.double(), state0.double())}
        judge = _Judge(report)
        for step in range(drive.steps):
            run = _drive_step(report, step, drive, design, twin, traj["wd"])
            _judge_poison(judge, run)
            _judge_prefix(judge, run, ref)
            _judge_accept_zero(judge, run)
            traj = _judge_growth(judge, run, ref, traj)
            report.steps_run = step + 1
    except _Stop:
        pass
    return report


@dataclass(frozen=True)
class _Reference:
    layer: dict
    layer64: dict
    params: dict

    def draft(self, conv, state, tokens, n_tokens, f64: bool = False):
        if f64:
            return reference_draft(self.layer64, self.params, conv.double(), state.double(),
                                   {k: v.double() for k, v in tokens.items()}, n_tokens)
        return reference_draft(self.layer, self.params, conv, state, tokens, n_tokens)


@dataclass(frozen=True)
class _StepRun:
    """What one step showed: the draft, and the design's, its poisoned twin's and its fork's answers."""
    step: int
    tokens: dict
    n_tokens: torch.Tensor
    accepted: torch.Tensor
    before: tuple           # the design's committed (conv_state, state) before the step
    y: torch.Tensor         # its verify's outputs [B, n_q, C]
    after: tuple            # its committed state after the accept
    y_poisoned: torch.Tensor
    after_poisoned: tuple   # the twin's, its rollback storage poisoned past the accepted prefix
    y_alone: torch.Tensor
    after_alone: tuple      # the fork's, verifying only the accepted tokens (max(a, 1)) and accepting them

    @property
    def live(self) -> torch.Tensor:
        """[B, n_q]: the verified slots."""
        n_q = self.y.shape[1]
        return torch.arange(n_q, device=self.y.device).view(1, n_q) < self.n_tokens.view(-1, 1)

    @property
    def kept(self) -> torch.Tensor:
        """[B, n_q]: the accepted slots."""
        n_q = self.y.shape[1]
        return torch.arange(n_q, device=self.y.device).view(1, n_q) < self.accepted.view(-1, 1)


def _drive_step(report, step, drive, design, twin, like) -> _StepRun:
    dev = torch.device(drive.device)
    tokens = {k: v.to(dev) for k, v in draft_tokens(drive, step).items()}
    n_tokens, accepted = (x.to(dev) for x in draw_counts(drive, step))
    shape_y, wd = (drive.batch, drive.n_q, tokens["q_raw"].shape[-1]), like[0].dtype

    def verify(d, who, n):
        y = _call(report, step, f"{who}verify()", d.verify, **as_drafted(tokens, n), n_tokens=n.clone())
        return _expect(report, step, f"{who}verify() y", y, shape_y, wd)

    before = _committed(report, step, design, "design", *like)
    alone = _call(report, step, "fork", _fork, design)
    y = verify(design, "", n_tokens)
    _call(report, step, "accept()", design.accept, accepted.clone())
    after = _committed(report, step, design, "design", *like)

    y_p = verify(twin, "", n_tokens)
    poison(report, step, twin, accepted)                         # between verify and accept: past kept + a
    _call(report, step, "accept()", twin.accept, accepted.clone())
    poison(report, step, twin, torch.zeros_like(accepted))       # after the accept: past kept
    after_p = _committed(report, step, twin, "poisoned twin", *like)

    n_alone = accepted.clamp(min=1)                              # a verify holds >= 1 token; a = 0 rows unjudged
    y_a = verify(alone, "fork: ", n_alone)
    _call(report, step, "fork: accept()", alone.accept, accepted.clone())
    after_a = _committed(report, step, alone, "fork", *like)
    return _StepRun(step, tokens, n_tokens, accepted, before, y, after, y_p, after_p, y_a, after_a)


STATES = ("conv_state", "state")


def _judge_poison(judge: _Judge, r: _StepRun) -> None:
    """(4) the poisoned twin answers as the untouched design, bit for bit."""
    every, live = torch.ones_like(r.accepted, dtype=torch.bool), r.live
    judge.rows("poison", r.step, "y with the rollback storage poisoned vs left alone", every,
               lambda m: _bitwise(r.y_poisoned[m][live[m]], r.y[m][live[m]]))
    for i, what in enumerate(STATES):
        judge.rows("poison", r.step, f"committed {what} with the rollback storage poisoned vs left alone", every,
                   lambda m, i=i: _bitwise(r.after_poisoned[i][m], r.after[i][m]))


def _judge_prefix(judge: _Judge, r: _StepRun, ref: _Reference) -> None:
    """(1) against the design itself (its fork on the accepted tokens alone, bitwise) and against the
    float64 oracle from its own committed state (kda_decode's classes)."""
    some, kept, live, a = r.accepted > 0, r.kept, r.live, r.accepted
    judge.rows("prefix", r.step, "y of the accepted tokens vs the design run on them alone", some,
               lambda m: _bitwise(r.y[m][kept[m]], r.y_alone[m][kept[m]]))
    for i, what in enumerate(STATES):
        judge.rows("prefix", r.step, f"committed {what} vs the design run on its accepted tokens alone", some,
                   lambda m, i=i: _bitwise(r.after[i][m], r.after_alone[i][m]))
    y_b, conv_b, st_b = ref.draft(*r.before, r.tokens, r.n_tokens)
    y_o, conv_o, st_o = ref.draft(*r.before, r.tokens, r.n_tokens, f64=True)
    judge.rows("prefix", r.step, "y of the verified tokens vs the float64 oracle (kda_decode y)",
               torch.ones_like(some), lambda m: _judge("kda_decode", "y", r.y[m][live[m]], y_o[m][live[m]],
                                                       y_b[m][live[m]]))
    judge.rows("prefix", r.step, "committed conv_state vs the reference after the accepted tokens (kda_decode "
               "conv_state)", some, lambda m: _judge("kda_decode", "conv_state", r.after[0][m], at_count(conv_o, a)[m],
                                                     at_count(conv_b, a)[m]))
    if bool(some.any()):
        mag = last_token_magnitude(ref.layer64, ref.params, {k: v.double() for k, v in r.tokens.items()}, conv_o,
                                    st_o, a)
        judge.rows("prefix", r.step, "committed state vs the float64 oracle after the accepted tokens (kda_decode "
                   "state)", some, lambda m: _judge("kda_decode", "state", r.after[1][m], at_count(st_o, a)[m],
                                                    at_count(st_b, a)[m], mag[m]))


def _judge_accept_zero(judge: _Judge, r: _StepRun) -> None:
    """(2) a sequence that accepted nothing has the bits it had before the step."""
    for i, what in enumerate(STATES):
        judge.rows("accept-zero", r.step, f"committed {what} after accepting 0 tokens vs before the step",
                   r.accepted == 0, lambda m, i=i: _bitwise(r.after[i][m], r.before[i][m]))


def _judge_growth(judge: _Judge, r: _StepRun, ref: _Reference, traj: dict) -> dict:
    """(3) against the float64 run of every accepted token since the first step, the reference in the
    working dtype over the same tokens as the baseline; returns both runs advanced by this step."""
    every, live, a = torch.ones_like(r.accepted, dtype=torch.bool), r.live, r.accepted
    y_b, conv_b, st_b = ref.draft(*traj["wd"], r.tokens, r.n_tokens)
    y_o, conv_o, st_o = ref.draft(*traj["64"], r.tokens, r.n_tokens, f64=True)
    (cb, sb), (co, so) = (at_count(conv_b, a), at_count(st_b, a)), (at_count(conv_o, a), at_count(st_o, a))
    judge.rows("growth", r.step, "y of the verified tokens vs the float64 run of every accepted token (kda_decode y)",
               every, lambda m: _judge("kda_decode", "y", r.y[m][live[m]], y_o[m][live[m]], y_b[m][live[m]]))
    judge.rows("growth", r.step, "committed conv_state vs the reference run of every accepted token (kda_decode "
               "conv_state)", every, lambda m: _judge("kda_decode", "conv_state", r.after[0][m], co[m], cb[m]))
    judge.rows("growth", r.step, "committed state vs the float64 run of every accepted token (kda_layer "
               "recurrent_state)", every, lambda m: _judge("kda_layer", "recurrent_state", r.after[1][m], so[m], sb[m]))
    return {"wd": (cb, sb), "64": (co, so)}


def contract_violations(factory, **drive) -> list[Violation]:
    """The violations of check_contract(factory, Drive(**drive)) (at most MAX_REPORTED per property)."""
    return check_contract(factory, Drive(**drive)).violations
