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

from verify.spec_decode.design import LAYER, TOKEN_INPUTS

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
class Drive:
    """One contract run: what the harness drives the design over (all of it from `seed`)."""
    config: str = "tiny"
    dtype: str = "bfloat16"
    batch: int = 4
    n_q: int = 8
    steps: int = 64
    seed: int = 0
    device: str = "cpu"


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


# ---- drawing -------------------------------------------------------------------------------------

def _case(drive: Drive, seed: int):
    from verify.model.case import Case

    return Case(op="kda_decode", seed=seed, batch=drive.batch, config=drive.config, dtype=drive.dtype)


def start_inputs(drive: Drive):
    """The layer weights, scalars and first committed state: the kda_decode case of `seed`."""
    from verify.ops.kda import make_kda_decode_inputs

    return make_kda_decode_inputs(_case(drive, drive.seed))


def draft_tokens(drive: Drive, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s n_q draft tokens [B, n_q, ...]: token t is the token inputs of the kda_decode case of
    its own seed (the same token whatever n_q)."""
    from verify.ops.kda import make_kda_decode_inputs

    per = [make_kda_decode_inputs(_case(drive, drive.seed * 1_000_003 + 1 + 64 * step + t)).tensors
           for t in range(drive.n_q)]
    return {n: torch.stack([p[n] for p in per], dim=1) for n in TOKEN_INPUTS}


def draw_counts(drive: Drive, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_tokens, accepted) [B] int32 for `step`: all drafted and accepted at step 0, none accepted at
    step 1; then n_tokens = n_q half the time (else 1..n_q) and accepted 0, n_tokens or in between."""
    B, n = drive.batch, drive.n_q
    g = torch.Generator().manual_seed(drive.seed * 7919 + step)
    if step == 0:
        return torch.full((B,), n, dtype=torch.int32), torch.full((B,), n, dtype=torch.int32)
    n_tokens = torch.where(torch.rand(B, generator=g) < 0.5, torch.full((B,), n),
                           torch.randint(1, n + 1, (B,), generator=g)).to(torch.int32)
    if step == 1:
        return n_tokens, torch.zeros(B, dtype=torch.int32)
    kind = torch.randint(0, 4, (B,), generator=g)
    between = (torch.rand(B, generator=g) * (n_tokens + 1).double()).floor().to(torch.int32)
    accepted = torch.where(kind == 0, 0, torch.where(kind == 1, n_tokens, between)).to(torch.int32)
    return n_tokens, accepted


def _past(tokens: dict, n_tokens: torch.Tensor) -> dict:
    """The draft as a design sees it: the slots past each sequence's n_tokens hold no token (NaN)."""
    n_q = next(iter(tokens.values())).shape[1]
    dead = torch.arange(n_q, device=n_tokens.device).view(1, n_q) >= n_tokens.view(-1, 1)
    return {k: v.masked_fill(dead.view(dead.shape + (1,) * (v.dim() - 2)), float("nan")) for k, v in tokens.items()}


# ---- the reference over a draft ------------------------------------------------------------------

def reference_draft(layer: dict, params: dict, conv: torch.Tensor, state: torch.Tensor, tokens: dict,
                    n_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """references.kda.kda_decode once per draft slot over the batch from (conv, state); a sequence
    keeps its state past its n_tokens. Returns y [B, n_q, C] and the conv and recurrent states after t
    tokens for t = 0..n_q, stacked [n_q + 1, B, ...]. Float64 tensors give the oracle."""
    from references.kda import kda_decode

    n_q = tokens["q_raw"].shape[1]
    B = conv.shape[0]
    ys, convs, states = [], [conv], [state]
    for t in range(n_q):
        cs, st = convs[-1].clone(), states[-1].clone()
        ys.append(kda_decode(**{n: tokens[n][:, t] for n in TOKEN_INPUTS}, **layer, conv_state=cs, state=st,
                             **params))
        live = (n_tokens > t).view(B, 1, 1, 1)
        convs.append(torch.where(live, cs, convs[-1]))
        states.append(torch.where(live, st, states[-1]))
    return torch.stack(ys, 1), torch.stack(convs), torch.stack(states)


def _at(stacked: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Row b of stacked[count[b]] ([n_q + 1, B, ...] -> [B, ...])."""
    return stacked[count.long(), torch.arange(stacked.shape[1], device=stacked.device)]


def _last_token_magnitude(layer64: dict, params: dict, tokens64: dict, convs64, states64, accepted) -> torch.Tensor:
    """decode_state_magnitude of each sequence's last accepted token (from the state before it): the
    floor scale kda_decode's spec judges that token's new state by (rows with a = 0 are not used)."""
    from verify.model.opdef import OpInputs
    from verify.ops.kda import decode_state_magnitude

    last = (accepted.long() - 1).clamp(min=0)
    rows = torch.arange(last.shape[0], device=last.device)
    t = {n: tokens64[n][rows, last] for n in TOKEN_INPUTS}
    t.update(layer64, conv_state=_at(convs64, last), state=_at(states64, last))
    return decode_state_magnitude(OpInputs(t, params))["state"]


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
    layer64 = {n: v.double() for n, v in layer.items()}
    wd = conv0.dtype
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
            _one_step(report, judge, step, design, twin, traj, layer, layer64, params, drive, dev, wd)
            report.steps_run = step + 1
    except _Stop:
        pass
    return report


def _one_step(report, judge, step, design, twin, traj, layer, layer64, params, drive, dev, wd):
    B, n_q = drive.batch, drive.n_q
    tokens = {k: v.to(dev) for k, v in draft_tokens(drive, step).items()}
    n_tokens, accepted = (x.to(dev) for x in draw_counts(drive, step))
    conv0, state0 = traj["wd"]
    C = tokens["q_raw"].shape[-1]

    before = _committed(report, step, design, "design", conv0, state0)
    alone = _call(report, step, "fork", _fork, design)
    y = _expect(report, step, "verify() y", _call(report, step, "verify()", design.verify, **_past(tokens, n_tokens),
                                                  n_tokens=n_tokens.clone()), (B, n_q, C), wd)
    _call(report, step, "accept()", design.accept, accepted.clone())
    after = _committed(report, step, design, "design", conv0, state0)

    # (4) the twin, its rollback storage poisoned before and after its accept
    y_p = _expect(report, step, "verify() y", _call(report, step, "verify()", twin.verify, **_past(tokens, n_tokens),
                                                    n_tokens=n_tokens.clone()), (B, n_q, C), wd)
    poison(report, step, twin, accepted)
    _call(report, step, "accept()", twin.accept, accepted.clone())
    poison(report, step, twin, torch.zeros_like(accepted))
    after_p = _committed(report, step, twin, "poisoned twin", conv0, state0)
    all_seqs = torch.ones(B, dtype=torch.bool, device=dev)
    live = torch.arange(n_q, device=dev).view(1, n_q) < n_tokens.view(B, 1)          # [B, n_q] verified slots
    judge.rows("poison", step, "y with the rollback storage poisoned vs left alone", all_seqs,
               lambda m: _bitwise(y_p[m][live[m]], y[m][live[m]]))
    for i, what in enumerate(("conv_state", "state")):
        judge.rows("poison", step, f"committed {what} with the rollback storage poisoned vs left alone", all_seqs,
                   lambda m, i=i: _bitwise(after_p[i][m], after[i][m]))

    # (1) against the design itself: the accepted tokens alone, from the same committed state
    some = accepted > 0
    n_alone = accepted.clamp(min=1)
    y_a = _expect(report, step, "verify() y (accepted tokens alone)",
                  _call(report, step, "verify() of the accepted tokens alone", alone.verify,
                        **_past(tokens, n_alone), n_tokens=n_alone), (B, n_q, C), wd)
    _call(report, step, "accept() of the accepted tokens alone", alone.accept, accepted.clone())
    after_a = _committed(report, step, alone, "fork", conv0, state0)
    kept = torch.arange(n_q, device=dev).view(1, n_q) < accepted.view(B, 1)
    judge.rows("prefix", step, "y of the accepted tokens vs the design run on them alone", some,
               lambda m: _bitwise(y[m][kept[m]], y_a[m][kept[m]]))
    for i, what in enumerate(("conv_state", "state")):
        judge.rows("prefix", step, f"committed {what} vs the design run on its accepted tokens alone", some,
                   lambda m, i=i: _bitwise(after[i][m], after_a[i][m]))

    # (1) against the float64 oracle from the design's own committed state, kda_decode's classes
    tok64 = {k: v.double() for k, v in tokens.items()}
    y_b, conv_b, st_b = reference_draft(layer, params, before[0], before[1], tokens, n_tokens)
    y_o, conv_o, st_o = reference_draft(layer64, params, before[0].double(), before[1].double(), tok64, n_tokens)
    judge.rows("prefix", step, "y of the verified tokens vs the float64 oracle (kda_decode y)", all_seqs,
               lambda m: _judge("kda_decode", "y", y[m][live[m]], y_o[m][live[m]], y_b[m][live[m]]))
    judge.rows("prefix", step, "committed conv_state vs the reference after the accepted tokens (kda_decode conv_state)",
               some, lambda m: _judge("kda_decode", "conv_state", after[0][m], _at(conv_o, accepted)[m],
                                      _at(conv_b, accepted)[m]))
    if bool(some.any()):
        mag = _last_token_magnitude(layer64, params, tok64, conv_o, st_o, accepted)
        judge.rows("prefix", step, "committed state vs the float64 oracle after the accepted tokens (kda_decode state)",
                   some, lambda m: _judge("kda_decode", "state", after[1][m], _at(st_o, accepted)[m],
                                          _at(st_b, accepted)[m], mag[m]))

    # (2) accepting nothing changes nothing
    none = accepted == 0
    for i, what in enumerate(("conv_state", "state")):
        judge.rows("accept-zero", step, f"committed {what} after accepting 0 tokens vs before the step", none,
                   lambda m, i=i: _bitwise(after[i][m], before[i][m]))

    # (3) against the float64 oracle over every accepted token since the first step
    (cw, sw), (c64, s64) = traj["wd"], traj["64"]
    ty_b, tconv_b, tst_b = reference_draft(layer, params, cw, sw, tokens, n_tokens)
    ty_o, tconv_o, tst_o = reference_draft(layer64, params, c64, s64, tok64, n_tokens)
    traj["wd"] = (_at(tconv_b, accepted), _at(tst_b, accepted))
    traj["64"] = (_at(tconv_o, accepted), _at(tst_o, accepted))
    judge.rows("growth", step, "y of the verified tokens vs the float64 run of every accepted token (kda_decode y)",
               all_seqs, lambda m: _judge("kda_decode", "y", y[m][live[m]], ty_o[m][live[m]], ty_b[m][live[m]]))
    judge.rows("growth", step, "committed conv_state vs the reference run of every accepted token (kda_decode conv_state)",
               all_seqs, lambda m: _judge("kda_decode", "conv_state", after[0][m], traj["64"][0][m], traj["wd"][0][m]))
    judge.rows("growth", step, "committed state vs the float64 run of every accepted token (kda_layer recurrent_state)",
               all_seqs, lambda m: _judge("kda_layer", "recurrent_state", after[1][m], traj["64"][1][m],
                                          traj["wd"][1][m]))


def contract_violations(factory, **drive) -> list[Violation]:
    """The violations of check_contract(factory, Drive(**drive)) (at most MAX_REPORTED per property)."""
    return check_contract(factory, Drive(**drive)).violations
