"""Planted bugs in the whole-layer ops (references/layers.py)."""
from __future__ import annotations

import torch

from references.config import get_config
from references.layers import LayerState, decode_steps, kda_kind_of, kda_layer_steps, mla_layer_steps
from references.weights import LayerWeights


def kda_layer_state_not_stored(x_steps, blocks, conv_state, recurrent_state, layer_idx: int, config: str,
                               tp: int = 1, **weights):
    """Keeps the KDA recurrent state in a scratch copy across the steps and never stores it back."""
    return kda_layer_steps(x_steps, blocks, conv_state, recurrent_state.clone(), layer_idx, config, tp, **weights)


def mla_layer_seq_lens_not_advanced(x_steps, blocks, cache, block_table, seq_lens, layer_idx: int, config: str,
                                    tp: int = 1, **weights):
    """Advances a private copy of seq_lens: the caller's lengths never grow past the cached tokens."""
    return mla_layer_steps(x_steps, blocks, cache, block_table, seq_lens.clone(), layer_idx, config, tp, **weights)


def kda_layer_state_reset_every_3_steps(x_steps, blocks, conv_state, recurrent_state, layer_idx: int,
                                        config: str, tp: int = 1, **weights):
    """Runs the steps in chunks of 3 and zeroes the recurrent state between chunks."""
    outs, ids = [], []
    for i in range(0, x_steps.shape[0], 3):
        if i:
            recurrent_state.zero_()
        out, chosen = kda_layer_steps(x_steps[i:i + 3], blocks, conv_state, recurrent_state, layer_idx, config,
                                      tp, **weights)
        outs.append(out)
        ids.append(chosen)
    return torch.cat(outs), torch.cat(ids)


def _unsplit(tp: int) -> None:
    if tp != 1:
        raise ValueError(f"tp={tp}: this planted bug reroutes the unsplit layer only")


def routed_to(kind: str, x_steps, blocks, state: dict, layer_idx: int, config: str, weights: dict, pick):
    """The reference layer routed to pick(ids[N,B,k] its router chose, choice scores[N,B,E]) at every
    step, state updated in place: (prefix_steps, the picked ids). The unsplit layer only (tp = 1)."""
    w = LayerWeights(kind, get_config(config), x_steps.dtype, weights)

    def fresh():
        return LayerState(prefix=torch.zeros_like(x_steps[0]), blocks=blocks.clone(), **{n: t.clone() for n, t in state.items()})
    routing: list = []
    decode_steps(kind, w, fresh(), x_steps, layer_idx, routing=routing)
    ids = pick(torch.stack([i for i, _ in routing]), torch.stack([c for _, c in routing]))
    run = fresh()
    out = decode_steps(kind, w, run, x_steps, layer_idx, route_ids=ids)
    for n, t in state.items():
        t.copy_(getattr(run, n))
    return out, ids


def kda_layer_reports_previous_step_ids(x_steps, blocks, conv_state, recurrent_state, layer_idx: int,
                                        config: str, tp: int = 1, **weights):
    """Routes right but reports each step's ids one step late (a router-ids buffer read before the
    step's router writes it; step 0 reports the last step's)."""
    out, ids = kda_layer_steps(x_steps, blocks, conv_state, recurrent_state, layer_idx, config, tp, **weights)
    return out, ids.roll(1, dims=0)


def mla_layer_routes_k_plus_1(x_steps, blocks, cache, block_table, seq_lens, layer_idx: int, config: str,
                              tp: int = 1, **weights):
    """Routes each token to its (k+1)-th best expert in place of its k-th (a top-k that skips one), and
    reports the ids it used."""
    def pick(ids, choice):
        k = ids.shape[-1]
        order = torch.sort(choice, dim=-1, descending=True, stable=True).indices
        return torch.cat([order[..., :k - 1], order[..., k:k + 1]], dim=-1)
    _unsplit(tp)
    return routed_to("mla", x_steps, blocks, {"cache": cache, "block_table": block_table, "seq_lens": seq_lens},
                     layer_idx, config, weights, pick)


def kda_layer_routes_neighbour(x_steps, blocks, conv_state, recurrent_state, layer_idx: int, config: str,
                               tp: int = 1, **weights):
    """Routes each token with its neighbour's expert ids (sequence b uses b+1's) and reports the ids
    its router chose: the outputs are not those of the reported experts."""
    kind = kda_kind_of(layer_idx)
    if kind == "dense":
        return kda_layer_steps(x_steps, blocks, conv_state, recurrent_state, layer_idx, config, tp, **weights)
    chosen = {}

    def pick(ids, choice):
        chosen["ids"] = ids
        return ids.roll(1, dims=1)
    _unsplit(tp)
    out, _ = routed_to(kind, x_steps, blocks, {"conv_state": conv_state, "recurrent_state": recurrent_state},
                       layer_idx, config, weights, pick)
    return out, chosen["ids"]
