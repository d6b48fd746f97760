"""The speculative-decoding contract of a whole KDA or MLA layer (references/layers_spec.py), for any
candidate layer: one drive of `steps` verify+accept steps of B sequences with up to n_q draft tokens,
each draft token bringing its own layer input x and block snapshots, the accept lengths drawn as the
op-level contract draws them (verify.spec_decode.drive.draw_counts: all at step 0, none at step 1, then
0, all and in between, ragged n_tokens). The reference for a draft is references.layers.decode_steps,
one token at a time over the batch, in the working dtype (the baseline) and in float64 (the oracle).

A candidate layer is built by `make(kind, weights, layer_idx)` and shows references.layers_spec.SpecLayer's
methods: begin(state, n_q), verify(x, blocks, n_tokens, routing) -> out [B, n_q, D], accept(accepted),
committed() -> {conv_state, recurrent_state} (KDA) or {cache, seq_lens} (MLA), rollback_buffers() (KDA: its
design's, verify/spec_decode/design.py), paged_cache() (MLA: the live cache, block_table, seq_lens), and
optionally fork(). The committed MLA cache is the positions below each sequence's seq_lens; the rest of
its pages is free.

Properties (the op-level contract's, verify/spec_decode/contract.py, at the layer; classes and bounds
from tolerance_specs/kda_layer.toml and mla_layer.toml, nothing loosened):
prefix (1)       After n_tokens drafted and `a` accepted, the first `a` outputs and the committed state are
                 those of the same candidate, forked before the step, verifying only those `a` tokens: bit
                 for bit. Against the float64 decode_steps from the candidate's committed state before the
                 step (the working-dtype decode_steps from it as the baseline): every verified token's
                 output by <kind>_layer prefix_steps, the committed state by conv_state / recurrent_state
                 (KDA) or cache (its committed rows) and seq_lens (bitwise; MLA). The a accepted tokens are
                 a decode steps, and the specs' growth argument (the KDA state is a contraction, the MLA
                 cache write-once) keeps a candidate within k of the baseline per step within k of it.
accept-zero (2)  A sequence that accepts 0 tokens keeps its committed state bit for bit.
growth (3)       After every step, against the float64 decode_steps over every accepted token since the
                 first step (the working-dtype decode_steps over the same tokens as the baseline): the
                 verified tokens' outputs and the committed state by the same classes, at step 64 and on.
poison (4)       A twin runs the same drive while the harness overwrites what a rejected token left:
                 KDA, the design's rollback storage past the accepted prefix (contract.poison); MLA, every
                 cache position at or past seq_lens + accepted of each sequence's pages, NaN; both between
                 verify and accept and after the accept. Its outputs (the next steps' included) and
                 committed state must be the untouched candidate's, bit for bit.
run              The candidate raised, or returned a tensor of the wrong shape or dtype (the drive stops).

Routing: an output row whose expert set differs between the candidate (or the baseline) and the oracle
differs by a whole expert (the layer specs' known limit). Such a row is judged by the tie-aware rule
instead (compare_tie_aware_ids: the candidate's ids inside the tie band of the oracle's scores); a row
outside the band is a violation, one inside it is left out of the output comparison. The attention
state does not depend on the MoE, so no routing choice is carried across steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verify.spec_decode.contract import (ContractReport, Violation, _bitwise, _call, _expect, _fork, _judge, _Judge,
                                         _Stop, poison)
from verify.spec_decode.drive import Drive, as_drafted, at_count, draw_counts

LAYER_KINDS = ("kda", "mla")
PROPERTIES = {
    "prefix": "(1) n_tokens drafted then a accepted = a tokens run alone (bitwise against the layer itself; "
              "kda_layer.toml / mla_layer.toml classes against the float64 decode_steps)",
    "accept-zero": "(2) accepting 0 leaves the committed state bitwise unchanged",
    "growth": "(3) every step within the layer's declared error growth against the float64 decode_steps "
              "over every accepted token",
    "poison": "(4) what a rejected token left (KDA rollback storage, MLA cache slots) is never read afterwards",
    "run": "the layer runs and returns tensors in references.layers_spec's layout",
}


@dataclass(frozen=True)
class LayerDrive(Drive):
    """A layer contract run: Drive's fields, the layer kind and its K3 index (default: DEFAULT_LAYER)."""
    kind: str = "kda"
    layer_idx: int | None = None


# ---- the drive's inputs ------------------------------------------------------------------------

def _case(drive: LayerDrive):
    from verify.model.case import Case

    return Case(op=f"{drive.kind}_layer", seed=drive.seed, batch=drive.batch, config=drive.config, dtype=drive.dtype)


def layer_start(drive: LayerDrive):
    """(weights in the working dtype, the first committed LayerState) from the seed: references.weights'
    layer, verify.ops.layers' warm KDA state or paged MLA context with room for every draft of the drive."""
    from references.config import get_config
    from references.layers import BLOCK_SLOTS, LayerState
    from references.weights import make_layer_weights
    from verify.ops.common_splits import activation, working_dtype
    from verify.ops.kda import starting_state
    from verify.ops.layers import mla_paged_state

    case, cfg, B = _case(drive), get_config(drive.config), drive.batch
    wd, dev = working_dtype(case), torch.device(drive.device)
    weights = make_layer_weights(drive.kind, cfg, drive.seed, wd)
    weights = type(weights)(weights.kind, weights.config, weights.dtype, {n: t.to(dev) for n, t in weights.tensors.items()})
    stream = dict(prefix=torch.zeros(B, cfg.hidden, dtype=wd, device=dev),
                  blocks=torch.zeros(B, BLOCK_SLOTS, cfg.hidden, dtype=wd, device=dev))
    if drive.kind == "kda":
        C = cfg.n_heads * cfg.head_dim
        state = LayerState(**stream, conv_state=activation(case, "conv_state", (B, 3, C, cfg.conv_kernel - 1), wd,
                                                           dist="normal").to(dev),
                           recurrent_state=starting_state(case, B, cfg.n_heads, cfg.head_dim).to(dev))
    else:
        paged = mla_paged_state(case, drive.steps * drive.n_q + drive.n_q)
        state = LayerState(**stream, **{n: t.to(dev) for n, t in paged.items()})
    return weights, state


def layer_draft(drive: LayerDrive, step: int, hidden: int, wd: torch.dtype) -> dict[str, torch.Tensor]:
    """Step `step`'s draft: x [B, n_q, D] (each token's layer input) and blocks [B, n_q, 8, D] (its block
    snapshots, per block scale 2^-2..2^2 as verify.ops.layers draws them), from (seed, step) alone."""
    from references.layers import BLOCK_SLOTS

    g = torch.Generator().manual_seed(drive.seed * 1_000_003 + 7 + step)
    B, n = drive.batch, drive.n_q
    x = torch.randn(B, n, hidden, generator=g, dtype=torch.float64)
    scales = torch.exp2(torch.randint(-2, 3, (B, n, BLOCK_SLOTS, 1), generator=g).double())
    blocks = torch.randn(B, n, BLOCK_SLOTS, hidden, generator=g, dtype=torch.float64) * scales
    return {"x": x.to(wd).to(drive.device), "blocks": blocks.to(wd).to(drive.device)}


# ---- the reference over a draft ------------------------------------------------------------------

@dataclass(frozen=True)
class RefDraft:
    """decode_steps over a draft's slots: outputs [B, n_q, D] (slots past the run zero), the routing of
    every slot run, and the committed state after `count` tokens of each sequence (`at`)."""
    kind: str
    out: torch.Tensor
    routing: list
    states: dict            # KDA: name -> [T + 1, B, ...] after t tokens; MLA: the cache after T, seq_lens before

    def at(self, count: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "kda":
            return {n: at_count(s, count) for n, s in self.states.items()}
        return {"cache": self.states["cache"], "seq_lens": self.states["seq_lens"] + count.to(self.states["seq_lens"].dtype)}


def reference_draft(kind: str, weights, layer_idx: int, committed: dict, block_table, draft: dict,
                    slots: int) -> RefDraft:
    """references.layers.decode_steps one token at a time over the batch from `committed`, the first `slots`
    draft slots (every sequence steps them all; a sequence's result is read at its own count)."""
    from references.layers import LayerState, decode_steps

    x, blocks = draft["x"], draft["blocks"]
    wd = x.dtype
    state = LayerState(prefix=torch.zeros_like(x[:, 0]), blocks=blocks[:, 0].clone(),
                       **{n: t.clone() for n, t in committed.items()},
                       **({"block_table": block_table} if kind == "mla" else {}))
    state = state.to(wd)
    out, routing = torch.zeros_like(x), []
    snaps = {n: [getattr(state, n).clone()] for n in ("conv_state", "recurrent_state")} if kind == "kda" else {}
    seq_lens = None if kind == "kda" else state.seq_lens.clone()
    for t in range(slots):
        state.blocks = blocks[:, t].clone()
        out[:, t] = decode_steps(kind, weights, state, x[:, t].unsqueeze(0), layer_idx, routing=routing)[0]
        for n, s in snaps.items():
            s.append(getattr(state, n).clone())
    if kind == "kda":
        states = {n: torch.stack(s + [s[-1]] * (x.shape[1] - slots)) for n, s in snaps.items()}
    else:
        states = {"cache": state.cache, "seq_lens": seq_lens}
    return RefDraft(kind, out, routing, states)


def committed_rows(kind: str, state: dict, block_table, lens: torch.Tensor, mask: torch.Tensor, name: str):
    """The committed part of `name` for the sequences in mask: KDA tensors' rows; the MLA cache's rows at
    positions 0..lens[b]-1 of each sequence (its pages in block_table), concatenated."""
    t = state[name]
    if kind == "kda" or name != "cache":
        return t[mask]
    page, flat = t.shape[1], t.reshape(-1, t.shape[-1])
    rows = []
    for b in torch.nonzero(mask).flatten().tolist():
        pos = torch.arange(int(lens[b]), device=t.device)
        rows.append(flat[block_table[b].long()[pos // page] * page + pos % page])
    return torch.cat(rows) if rows else flat[:0]


def poison_cache(cache: torch.Tensor, block_table: torch.Tensor, start: torch.Tensor) -> None:
    """NaN into every cache position at or past start[b] of each sequence's own pages (-1: none)."""
    page, B, pages = cache.shape[1], block_table.shape[0], block_table.shape[1]
    pos = torch.arange(pages * page, device=cache.device).view(1, -1)
    ids = block_table.long()[:, pos.flatten() // page]                      # [B, pages * page]
    dead = (pos >= start.to(cache.device).long().view(B, 1)) & (ids >= 0)
    flat = cache.view(-1, cache.shape[-1])
    with torch.no_grad():
        flat[(ids * page + pos % page)[dead]] = float("nan")


# ---- one step ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _StepRun:
    step: int
    draft: dict
    n_tokens: torch.Tensor
    accepted: torch.Tensor
    before: dict            # the candidate's committed state before the step
    out: torch.Tensor
    routing: list
    after: dict
    out_poisoned: torch.Tensor
    after_poisoned: dict
    out_alone: torch.Tensor
    after_alone: dict

    def slots(self, count: torch.Tensor) -> torch.Tensor:
        n_q = self.out.shape[1]
        return torch.arange(n_q, device=self.out.device).view(1, n_q) < count.view(-1, 1)


def _committed(report, step, layer, who: str, like: dict) -> dict:
    got = _call(report, step, f"{who}committed()", layer.committed)
    if not isinstance(got, dict) or set(got) != set(like):
        report.add(Violation("run", step, None, f"{who}committed(): expected a dict of {sorted(like)}, got "
                                                f"{type(got).__name__}"))
        raise _Stop
    return {n: _expect(report, step, f"{who}committed() {n}", got[n], like[n].shape, like[n].dtype) for n in like}


def _poison_rejected(report, step, layer, kind: str, extra: torch.Tensor) -> None:
    if kind == "kda":
        poison(report, step, layer, extra)
    else:
        cache, table, seq_lens = _call(report, step, "paged_cache()", layer.paged_cache)
        poison_cache(cache, table, seq_lens + extra.to(seq_lens.dtype))


def _drive_step(report, step, drive, layer, twin, like) -> _StepRun:
    draft = layer_draft(drive, step, like["hidden"], like["wd"])
    n_tokens, accepted = (x.to(drive.device) for x in draw_counts(drive, step))
    shape = tuple(draft["x"].shape)

    def verify(c, who, n, routing=None):
        out = _call(report, step, f"{who}verify()", c.verify, **as_drafted(draft, n), n_tokens=n.clone(),
                    routing=routing)
        return _expect(report, step, f"{who}verify() out", out, shape, like["wd"])

    state_like = like["state"]
    before = _committed(report, step, layer, "", state_like)
    alone = _call(report, step, "fork", _fork, layer)
    routing: list = []
    out = verify(layer, "", n_tokens, routing)
    _call(report, step, "accept()", layer.accept, accepted.clone())
    after = _committed(report, step, layer, "", state_like)

    out_p = verify(twin, "twin: ", n_tokens)
    _poison_rejected(report, step, twin, drive.kind, accepted)          # between verify and accept
    _call(report, step, "twin: accept()", twin.accept, accepted.clone())
    _poison_rejected(report, step, twin, drive.kind, torch.zeros_like(accepted))   # after the accept
    after_p = _committed(report, step, twin, "twin: ", state_like)

    n_alone = accepted.clamp(min=1)                                     # a = 0 rows are not judged
    out_a = verify(alone, "fork: ", n_alone)
    _call(report, step, "fork: accept()", alone.accept, accepted.clone())
    after_a = _committed(report, step, alone, "fork: ", state_like)
    return _StepRun(step, draft, n_tokens, accepted, before, out, routing, after, out_p, after_p, out_a, after_a)


# ---- judging -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Layer:
    kind: str
    layer_idx: int
    weights: object
    weights64: object
    block_table: torch.Tensor | None

    def draft(self, committed: dict, draft: dict, slots: int, f64: bool = False) -> RefDraft:
        if f64:
            return reference_draft(self.kind, self.weights64, self.layer_idx,
                                   {n: t.double() if t.is_floating_point() else t for n, t in committed.items()},
                                   self.block_table, {n: t.double() for n, t in draft.items()}, slots)
        return reference_draft(self.kind, self.weights, self.layer_idx, committed, self.block_table, draft, slots)


def _routing_rows(judge: _Judge, prop: str, r: _StepRun, base: RefDraft, oracle: RefDraft, top_k: int) -> torch.Tensor:
    """[B, n_q] bool: the verified rows whose expert set matches the oracle's in both the candidate and the
    baseline. The other rows are judged by the tie-aware rule (candidate's ids against the oracle's scores)."""
    live = r.slots(r.n_tokens)
    same = live.clone()
    for t, ((ids_c, _), (ids_b, choice_b), (ids_o, choice_o)) in enumerate(zip(r.routing, base.routing, oracle.routing)):
        sc, sb, so = (torch.sort(i.long(), dim=-1).values for i in (ids_c, ids_b, ids_o))
        flipped = ((sc != so).any(-1) | (sb != so).any(-1)) & live[:, t]
        same[:, t] &= ~flipped
        judge.rows(prop, r.step, f"draft slot {t}: router ids of a row whose expert set differs from the float64 "
                   "oracle's, against its tie band", flipped,
                   lambda m, ids_c=ids_c, choice_o=choice_o, choice_b=choice_b: _tie_aware(ids_c[m], choice_o[m],
                                                                                             choice_b[m], top_k))
    return same


def _tie_aware(ids, choice64, choice_wd, k):
    from verify.judge.compare import compare_tie_aware_ids

    return compare_tie_aware_ids("router_ids", ids.cpu(), choice64.double().cpu(), choice_wd.cpu(), k)


def _judge_against(judge: _Judge, prop: str, r: _StepRun, L: _Layer, base: RefDraft, oracle: RefDraft,
                   what: str, top_k: int) -> None:
    """The verified outputs and the committed state after the accepted tokens against oracle (base: baseline)."""
    op, a = f"{L.kind}_layer", r.accepted
    rows = _routing_rows(judge, prop, r, base, oracle, top_k)
    judge.rows(prop, r.step, f"output of the verified tokens vs {what} ({op} prefix_steps)", rows.any(-1),
               lambda m: _judge(op, "prefix_steps", r.out[m][rows[m]], oracle.out[m][rows[m]], base.out[m][rows[m]]))
    want, want64 = base.at(a), oracle.at(a)
    every = torch.ones_like(a, dtype=torch.bool)
    if L.kind == "kda":
        for n in ("conv_state", "recurrent_state"):
            judge.rows(prop, r.step, f"committed {n} vs {what} after the accepted tokens ({op} {n})", every,
                       lambda m, n=n: _judge(op, n, r.after[n][m], want64[n][m], want[n][m]))
        return
    lens = want["seq_lens"]
    judge.rows(prop, r.step, f"committed seq_lens vs {what} after the accepted tokens ({op} seq_lens)", every,
               lambda m: _judge(op, "seq_lens", r.after["seq_lens"][m], want64["seq_lens"][m], want["seq_lens"][m]))
    judge.rows(prop, r.step, f"committed cache rows vs {what} after the accepted tokens ({op} cache)", lens > 0,
               lambda m: _judge(op, "cache", *(committed_rows("mla", s, L.block_table, lens, m, "cache")
                                               for s in (r.after, want64, want))))


def _same_state(judge: _Judge, prop: str, step: int, what: str, L: _Layer, got: dict, want: dict, lens, seqs) -> None:
    """Bitwise equality of the committed state of the sequences in seqs (MLA: seq_lens and the rows below lens)."""
    for n in got:
        judge.rows(prop, step, f"committed {n} {what}", seqs,
                   lambda m, n=n: _bitwise(committed_rows(L.kind, got, L.block_table, lens, m, n),
                                           committed_rows(L.kind, want, L.block_table, lens, m, n)))


def _judge_step(judge: _Judge, r: _StepRun, L: _Layer, traj: dict, top_k: int) -> dict:
    every, some, a = torch.ones_like(r.accepted, dtype=torch.bool), r.accepted > 0, r.accepted
    live, kept = r.slots(r.n_tokens), r.slots(a)
    lens = r.after["seq_lens"] if L.kind == "mla" else None
    # (4) poison
    judge.rows("poison", r.step, "output with rejected storage poisoned vs left alone", every,
               lambda m: _bitwise(r.out_poisoned[m][live[m]], r.out[m][live[m]]))
    _same_state(judge, "poison", r.step, "with rejected storage poisoned vs left alone", L, r.after_poisoned,
                r.after, lens, every)
    # (2) accept-zero
    _same_state(judge, "accept-zero", r.step, "after accepting 0 tokens vs before the step", L, r.after, r.before,
                lens, a == 0)
    # (1) prefix: against the fork, then against the float64 decode_steps from the committed state
    judge.rows("prefix", r.step, "output of the accepted tokens vs the layer run on them alone", some,
               lambda m: _bitwise(r.out[m][kept[m]], r.out_alone[m][kept[m]]))
    _same_state(judge, "prefix", r.step, "vs the layer run on its accepted tokens alone", L, r.after, r.after_alone,
                lens, some)
    slots = int(r.n_tokens.max())
    base, oracle = L.draft(r.before, r.draft, slots), L.draft(r.before, r.draft, slots, f64=True)
    _judge_against(judge, "prefix", r, L, base, oracle, "the float64 decode_steps from the committed state", top_k)
    # (3) growth: against the runs over every accepted token since the first step
    same_start = all(torch.equal(traj["wd"][n], r.before[n]) for n in r.before)
    base_t = base if same_start else L.draft(traj["wd"], r.draft, slots)
    oracle_t = L.draft(traj["64"], r.draft, slots, f64=True)
    _judge_against(judge, "growth", r, L, base_t, oracle_t, "the float64 decode_steps over every accepted token",
                   top_k)
    return {"wd": base_t.at(a), "64": oracle_t.at(a)}


# ---- the contract ------------------------------------------------------------------------------

def reference_layer(design_factory=None):
    """make(kind, weights, layer_idx) for references.layers_spec.SpecLayer, its KDA attention through a fresh
    design from design_factory() (default: the reference checkpoints design)."""
    from references.layers_spec import SpecLayer

    def make(kind, weights, layer_idx):
        return SpecLayer(kind, weights, layer_idx, design_factory() if kind == "kda" and design_factory else None)

    return make


def check_layer_contract(make, drive: LayerDrive) -> ContractReport:
    """Drive a candidate from make(kind, weights, layer_idx) (and a poisoned twin) over `drive`; every
    property's checks and violations (the report's tally keys are PROPERTIES')."""
    from references.layers import DEFAULT_LAYER

    if drive.kind not in LAYER_KINDS:
        raise ValueError(f"kind: {drive.kind!r} has no layer contract; use one of {LAYER_KINDS}")
    report = ContractReport(drive)
    weights, start = layer_start(drive)
    idx = DEFAULT_LAYER[drive.kind] if drive.layer_idx is None else drive.layer_idx
    L = _Layer(drive.kind, idx, weights, weights.to(torch.float64), start.block_table)
    names = ("conv_state", "recurrent_state") if drive.kind == "kda" else ("cache", "seq_lens")
    committed0 = {n: getattr(start, n) for n in names}
    like = {"state": committed0, "hidden": weights.config.hidden, "wd": weights.dtype}
    try:
        layer = _call(report, 0, "the layer factory", make, drive.kind, weights, idx)
        twin = _call(report, 0, "the layer factory", make, drive.kind, weights, idx)
        for c in (layer, twin):
            _call(report, 0, "begin()", c.begin, start.clone(), drive.n_q)
        traj = {"wd": {n: t.clone() for n, t in committed0.items()},
                "64": {n: t.double() if t.is_floating_point() else t.clone() for n, t in committed0.items()}}
        judge = _Judge(report)
        for step in range(drive.steps):
            run = _drive_step(report, step, drive, layer, twin, like)
            traj = _judge_step(judge, run, L, traj, weights.config.top_k)
            report.steps_run = step + 1
    except _Stop:
        pass
    return report
