"""Routing inside whole-layer cases: a layer's router_ids are judged tie-aware against the oracle's
trajectory, and its prefix_steps against the reference routed to the candidate's own ids. A candidate
that takes the other side of a near-tie (as a correct kernel whose last-bit differences move the
router's input across it does) passes; the same swap where the scores are far apart fails."""
from __future__ import annotations

import torch

from property_tests.harness_case import judge_case
from property_tests.planted.layers import routed_to
from references.layers import kda_kind_of
from verify.judge.compare import tie_band
from verify.model.case import Case
from verify.model.opdef import OpInputs
from verify.model.verdict import PASS
from verify.ops.layers import STATE_TENSORS, make_kda_layer_inputs, step_choices

SWAPPED: list[tuple[int, int]] = []        # (step, sequence) rows the last candidate call swapped


def _swap_kth(tensors: dict, params: dict, near: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference layer with the k-th and (k+1)-th experts swapped where the float64 scores of
    this call's own inputs put them inside the tie band (near=True: of a candidate held to the op's
    score error alone, score_k = 1, narrower than the spec's), or at the row where they are farthest
    apart (near=False). State tensors updated in place, as the registry form does."""
    wide = OpInputs({n: t.double() if t.is_floating_point() else t.clone() for n, t in tensors.items()},
                    dict(params))
    s64 = torch.stack([c for _, c in step_choices(wide)])

    def pick(ids: torch.Tensor, s_wd: torch.Tensor) -> torch.Tensor:
        k = ids.shape[-1]
        srt = s64.sort(-1, descending=True)
        gap = srt.values[..., k - 1] - srt.values[..., k]
        band = tie_band(s64.reshape(-1, s64.shape[-1]), s_wd.reshape(-1, s64.shape[-1]),
                        srt.values[..., k - 1].reshape(-1)).view(gap.shape)
        rows = torch.nonzero(gap < band) if near else torch.nonzero(gap == gap.max())[:1]
        chosen = ids.clone()
        SWAPPED.clear()
        for t, b in rows.tolist():
            kth, nxt = int(srt.indices[t, b, k - 1]), int(srt.indices[t, b, k])
            if kth in chosen[t, b].tolist() and nxt not in chosen[t, b].tolist():
                chosen[t, b][chosen[t, b] == kth] = nxt
                order = s64[t, b, chosen[t, b]].sort(descending=True, stable=True).indices
                chosen[t, b] = chosen[t, b][order]           # the declared slot order, by the oracle's scores
                SWAPPED.append((t, b))
        return chosen

    state = {n: tensors[n] for n in STATE_TENSORS["kda"]}
    weights = {n: v for n, v in tensors.items() if n not in (*state, "x_steps", "blocks")}
    return routed_to(kda_kind_of(params["layer_idx"]), tensors["x_steps"], tensors["blocks"], state,
                     params["layer_idx"], params["config"], weights, pick)


def kda_layer_takes_the_other_side_of_near_ties(x_steps, blocks, conv_state, recurrent_state, layer_idx: int,
                                                config: str, **weights):
    tensors = {"x_steps": x_steps, "blocks": blocks, "conv_state": conv_state, "recurrent_state": recurrent_state,
               **weights}
    return _swap_kth(tensors, {"layer_idx": layer_idx, "config": config}, near=True)


def kda_layer_swaps_the_widest_gap(x_steps, blocks, conv_state, recurrent_state, layer_idx: int, config: str,
                                   **weights):
    tensors = {"x_steps": x_steps, "blocks": blocks, "conv_state": conv_state, "recurrent_state": recurrent_state,
               **weights}
    return _swap_kth(tensors, {"layer_idx": layer_idx, "config": config}, near=False)


def _case(seed: int) -> Case:
    """A small bf16 case of 16 steps at layer 13."""
    return Case(op="kda_layer", seed=seed, batch=4, config="small", extra=(("layer_idx", 13), ("steps", 16)))


def test_a_near_tie_taken_the_other_way_certifies():
    """Non-vacuous: the candidate's first call swaps at least one row, so its ids and its prefix differ
    from the reference's there by a whole expert; the harness accepts both."""
    for seed in range(40):
        case = _case(seed)
        inputs = make_kda_layer_inputs(case)
        kda_layer_takes_the_other_side_of_near_ties(**{n: t.clone() for n, t in inputs.tensors.items()},
                                                    **inputs.params)
        if SWAPPED:
            break
    else:
        raise AssertionError("no near-tie in 40 seeds: the test would be vacuous")
    v = judge_case(case, f"{__file__}:kda_layer_takes_the_other_side_of_near_ties", device="cpu")
    assert v.status == PASS, f"seed {seed}, swapped {SWAPPED}: {v.stage}: {v.reason}"


def test_the_same_swap_far_from_a_tie_fails():
    v = judge_case(_case(0), f"{__file__}:kda_layer_swaps_the_widest_gap", device="cpu")
    assert v.status != PASS and v.stage == "compare:router_ids" and "missing certain winners" in v.reason, v.reason


def test_a_rank_step_reweighed_at_its_own_ids_is_the_reference():
    """layer_reweigh's rank form (tp > 1: rank 0's steps with its peers' partials): at the reference's own
    ids it gives the reference's prefix_steps bitwise; at ids with one row's k-th expert swapped for
    another it differs at that step and later, not before."""
    from references.layers import kda_layer_steps
    from verify.ops.layers import layer_reweigh

    case = Case(op="kda_layer", seed=3, batch=2, config="small", extra=(("layer_idx", 13), ("steps", 4), ("tp", 2)))
    inputs = make_kda_layer_inputs(case)
    ref = kda_layer_steps(**{n: t.clone() for n, t in inputs.tensors.items()}, **inputs.params)
    prefix, ids = ref
    assert torch.equal(layer_reweigh(inputs, ids)["prefix_steps"], prefix)
    other = ids.clone()
    spare = next(e for e in range(64) if e not in ids[2, 1].tolist())
    other[2, 1, -1] = spare
    moved = layer_reweigh(inputs, other)["prefix_steps"]
    assert torch.equal(moved[:2], prefix[:2]) and not torch.equal(moved[2], prefix[2])
