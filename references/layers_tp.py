"""Tensor-parallel form of a whole K3 layer step, T ranks simulated in one process (kimi-k3-math.md §1.2,
§2.2, §4.2: the vLLM NVIDIA splits).

Per rank, from the op-level shard rules:
  KDA attention   by head (references.kda_tp): in_proj columns, conv/gate/state heads, o_proj rows
  MLA attention   by head (references.mla.mla_attention_step_tp); qkv_a and the latent cache replicated
  AttnRes, norms, router, latent down/norm/up   replicated (every rank computes the same bits)
  routed experts  intermediate dim: w1/w3 rows and w2 columns, moe_tp_shard_width(I, T) per rank,
                  zero-padded (vLLM pads 3072/T up to 256)
  shared experts, dense MLP   gate/up rows (column-parallel), down columns (row-parallel)
All-reduces are rank 0..T-1 left folds in fp32 (float64 for the oracle), rounded once to the working
dtype: the attention partials inside allreduce_attn_res_rmsnorm, the MoE latent and shared partials
(K3 reduces their concatenation in one all-reduce: elementwise the same fold).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from references.attn_res import allreduce_attn_res_rmsnorm, fold_partials
from references.config import K3Config
from references.kda import kda_attention_step
from references.kda_tp import (combine_kda_attention_step, shard_decode_tensors, shard_in_proj_weights,
                                shard_kda_attention_step)
from references.layers import (LayerState, attn_side, check_layer_args, check_layer_idx, kda_attention,
                               mla_attention, next_slots, route, router_choice)
from references.mla import mla_attention_step_tp, shard_heads
from references.moe import (dense_mlp, latent_norm_up, moe_experts_mxfp4, moe_tp_shard_width, router_topk,
                            shared_experts)
from references.mxfp4 import GROUP
from references.primitives import check_tensor, linear
from references.weights import LayerWeights


def check_tp(T, cfg: K3Config) -> None:
    if not isinstance(T, int) or T < 1 or cfg.n_heads % T:
        raise ValueError(f"T: {T!r} does not divide n_heads={cfg.n_heads}; pick a T in the divisors of "
                         f"{cfg.n_heads} (K3: 1, 2, 4, 8, 16)")


# ---------------------------------------------------------------------------------------------- attention
def kda_attention_tp(x: torch.Tensor, w: LayerWeights, state: LayerState, T: int) -> torch.Tensor:
    """Per-rank KDA attention on head shards -> partial o_proj outputs [T,B,D]; state updated by head."""
    cfg = w.config
    tensors = {"x": x, "conv_state": state.conv_state, "state": state.recurrent_state,
               **{n: w[n] for n in ("w_in", "w_fb", "conv_w", "A_log", "dt_bias", "o_norm_w", "w_o")}}
    params = {"n_heads": cfg.n_heads, "lower_bound": cfg.gate_lower_bound, "l2_eps": cfg.l2_eps,
              "norm_eps": cfg.rms_eps}
    per_rank = []
    for t, p in shard_kda_attention_step(tensors, params, T):
        out = kda_attention_step(**t, **p)
        per_rank.append({"out": out, "conv_state": t["conv_state"], "state": t["state"]})
    combined = combine_kda_attention_step(per_rank)
    state.conv_state.copy_(combined["conv_state"])
    state.recurrent_state.copy_(combined["state"])
    return torch.stack([r["out"] for r in per_rank])


def mla_attention_tp(x: torch.Tensor, w: LayerWeights, state: LayerState, slots: torch.Tensor, T: int) -> torch.Tensor:
    """MLA attention by head -> the per-rank partial o_proj outputs [T,B,D]; the cache (replicated)
    written once, seq_lens advanced."""
    cfg = w.config
    out = mla_attention_step_tp(x, w["w_qkv_a"], w["q_a_norm_w"], w["kv_a_norm_w"], w["w_q_b"], w["w_uk"], w["w_uv"],
                                w["w_g"], w["w_o"], state.cache, state.block_table, state.seq_lens + 1, slots,
                                cfg.mla_latent_eps, cfg.mla_scale, T, return_partials=True)
    state.seq_lens += 1
    return out


# ---------------------------------------------------------------------------------------------- mlp shards
def _pad_dim(t: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim)


def shard_routed_experts(w: LayerWeights, T: int) -> list[dict[str, torch.Tensor]]:
    """Rank r: w1/w3 rows and w2 columns [r*Ir, (r+1)*Ir) of the zero-padded intermediate dim.
    Zero packed bytes are E2M1 zeros, so padded rows/columns contribute exactly 0."""
    inter = w.config.moe_inter
    width = moe_tp_shard_width(inter, T)
    pad = width * T - inter
    w1p, w3p = _pad_dim(w["w13_packed"][:, :inter], 1, pad), _pad_dim(w["w13_packed"][:, inter:], 1, pad)
    w1s, w3s = _pad_dim(w["w13_scale"][:, :inter], 1, pad), _pad_dim(w["w13_scale"][:, inter:], 1, pad)
    w2p, w2s = _pad_dim(w["w2_packed"], 2, pad // 2), _pad_dim(w["w2_scale"], 2, pad // GROUP)
    shards = []
    for r in range(T):
        rows, half, groups = (slice(r * width, (r + 1) * width), slice(r * width // 2, (r + 1) * width // 2),
                              slice(r * width // GROUP, (r + 1) * width // GROUP))
        shards.append({"w13_packed": torch.cat([w1p[:, rows], w3p[:, rows]], 1).contiguous(),
                       "w13_scale": torch.cat([w1s[:, rows], w3s[:, rows]], 1).contiguous(),
                       "w2_packed": w2p[:, :, half].contiguous(), "w2_scale": w2s[:, :, groups].contiguous()})
    return shards


def shard_gated_mlp(w_gate_up: torch.Tensor, w_down: torch.Tensor, T: int, name: str) -> list[tuple]:
    """Column-parallel [gate; up] rows, row-parallel down columns: rank r owns inter slice r of T."""
    inter = w_down.shape[1]
    if inter % T:
        raise ValueError(f"T: {T} does not divide the {name} intermediate size {inter}")
    n = inter // T
    return [(torch.cat([w_gate_up[r * n:(r + 1) * n], w_gate_up[inter + r * n:inter + (r + 1) * n]]).contiguous(),
             w_down[:, r * n:(r + 1) * n].contiguous()) for r in range(T)]


def latent_moe_tp(x: torch.Tensor, w: LayerWeights, T: int, routing: list | None = None,
                  partials: list | None = None) -> torch.Tensor:
    cfg = w.config
    ids, route_w = router_topk(x, w["w_router"], w["router_bias"], cfg.top_k, cfg.routed_scale)   # replicated
    if routing is not None:
        routing.append((ids, router_choice(x, w)))
    z = linear(x, w["w_latent_down"])                                                              # replicated
    latent_parts = [moe_experts_mxfp4(z, ids, route_w, s["w13_packed"], s["w13_scale"], s["w2_packed"],
                                      s["w2_scale"], cfg.situ_beta, cfg.situ_linear_beta)
                    for s in shard_routed_experts(w, T)]
    shared_parts = [shared_experts(x, gu, d, cfg.situ_beta, cfg.situ_linear_beta)
                    for gu, d in shard_gated_mlp(w["w_shared_gate_up"], w["w_shared_down"], T, "shared expert")]
    if partials is not None:
        partials.append(torch.cat([torch.stack(latent_parts), torch.stack(shared_parts)], -1))
    y = fold_partials(torch.stack(latent_parts))
    shared = fold_partials(torch.stack(shared_parts))
    return latent_norm_up(y, w["latent_norm_w"], w["w_latent_up"], shared, cfg.rms_eps)


def dense_mlp_tp(x: torch.Tensor, w: LayerWeights, T: int, partials: list | None = None) -> torch.Tensor:
    cfg = w.config
    parts = torch.stack([shared_experts(x, gu, d, cfg.situ_beta, cfg.situ_linear_beta)
                         for gu, d in shard_gated_mlp(w["w_dense_gate_up"], w["w_dense_down"], T, "dense MLP")])
    if partials is not None:
        partials.append(parts)
    return fold_partials(parts)


# ---------------------------------------------------------------------------------------------- layer step
def layer_step_tp(kind: str, weights: LayerWeights, state: LayerState, layer_idx: int, T: int,
                  routing: list | None = None, partials: list | None = None) -> torch.Tensor:
    """One decode step of a `kind` layer ("kda", "mla", "dense") on T simulated ranks; same contract as
    references.layers.kda_layer / mla_layer / dense_layer0 (state in place, returns the new prefix).
    `partials` collects what each all-reduce folds: the attention partials [T,B,D], then the MLP's
    ([T,B,L+D]: latent and shared-experts partials side by side; [T,B,D] for the dense MLP)."""
    _, cfg = check_layer_args(weights, state, kind)
    check_layer_idx(layer_idx)
    check_tp(T, cfg)
    slots = next_slots(state) if kind == "mla" else None
    x, mlp_blocks = attn_side(weights, state, layer_idx)
    deltas = mla_attention_tp(x, weights, state, slots, T) if kind == "mla" else kda_attention_tp(x, weights, state, T)
    if partials is not None:
        partials.append(deltas)
    h = allreduce_attn_res_rmsnorm(state.prefix, deltas, state.blocks, weights["mlp_res_norm_w"],
                                   weights["mlp_res_proj_w"], weights["post_norm_w"], mlp_blocks, -1,
                                   cfg.rms_eps, cfg.rms_eps)
    m = dense_mlp_tp(h, weights, T, partials) if kind == "dense" else latent_moe_tp(h, weights, T, routing, partials)
    state.prefix.copy_(state.prefix + m)
    return state.prefix.clone()


# ---------------------------------------------------------------------------------------------- one rank
# One rank of a T-rank layer step in one process: what a rank computes, with the partials of the other
# ranks given (`peer_attn`, `peer_mlp`: what its all-reduces receive). Its weights and state are rank
# 0's shards, which are an unsplit layer of `rank_config`: the layer step of that config with each
# all-reduce folding [own, peers...] in rank order. Given the true partials of ranks 1..T-1 it is
# layer_step_tp bit for bit (property_tests/test_layer_rank.py); the bench times K3 per-rank shapes
# through it, where the peers stand in for what the collective brings.
PEER_TENSORS = ("peer_attn", "peer_mlp")


def split_rank_tensors(tensors: dict[str, torch.Tensor], tp: int, steps: int | None = None,
                       batch: int | None = None) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A one-rank registry call's tensors -> (the rank's weights, (peer_attn, peer_mlp)): each peer tensor
    [N, T-1, B, *] (N steps and B rows checked where given); a missing one is a TypeError naming it."""
    missing = [n for n in PEER_TENSORS if n not in tensors]
    if missing:
        raise TypeError(f"tp={tp}: one rank's layer step needs {', '.join(missing)} (the other ranks' partials)")
    for n in PEER_TENSORS:
        check_tensor(n, tensors[n], ndim=4, shape=(steps, None, batch, None))
        if tensors[n].shape[1] != tp - 1:
            raise ValueError(f"{n}: dim 1 holds the other {tp - 1} ranks' partials at tp={tp}, got "
                             f"{tensors[n].shape[1]}")
    return ({n: t for n, t in tensors.items() if n not in PEER_TENSORS},
            (tensors["peer_attn"], tensors["peer_mlp"]))


def rank_config(cfg: K3Config, T: int) -> K3Config:
    """The config whose unsplit layer has one rank's shapes: n_heads / T heads, the routed experts'
    zero-padded shard width, the shared and dense intermediate sizes over T."""
    check_tp(T, cfg)
    for name in ("shared_inter", "dense_inter"):
        if getattr(cfg, name) % T:
            raise ValueError(f"T: {T} does not divide {name}={getattr(cfg, name)}")
    return replace(cfg, n_heads=cfg.n_heads // T, moe_inter=moe_tp_shard_width(cfg.moe_inter, T),
                   shared_inter=cfg.shared_inter // T, dense_inter=cfg.dense_inter // T)


def _kda_head_shard(given: dict, cfg: K3Config, T: int, rank: int) -> dict:
    """Rank `rank`'s head slice of the KDA per-head tensors in `given` (weights or state), by
    references.kda_tp.shard_decode_tensors; the ones it needs and `given` lacks stand in on the meta
    device (shapes only) and are left out of the result."""
    H, Dh, W = cfg.n_heads, cfg.head_dim, cfg.conv_kernel
    meta = {"state": (1, H, Dh, Dh), "conv_state": (1, 3, H * Dh, W - 1), "conv_w": (3, H * Dh, W), "A_log": (H,),
            "o_norm_w": (Dh,)}
    full = {**{n: torch.empty(shape, device="meta") for n, shape in meta.items()}, **given}
    rank_part = shard_decode_tensors(full, T)[rank]
    return {n: rank_part[n] for n in given}


def shard_weights(kind: str, weights: dict, cfg: K3Config, wd: torch.dtype, T: int, rank: int) -> dict:
    """Rank `rank`'s weights under the names of the unsplit layer (replicated ones as they are)."""
    check_tp(T, cfg)
    w = dict(weights)
    H = cfg.n_heads
    if kind in ("kda", "dense"):
        w.update(shard_in_proj_weights(weights["w_in"], weights["w_fb"], H, T)[rank])
        per_head = _kda_head_shard({n: weights[n] for n in ("conv_w", "A_log", "dt_bias")}, cfg, T, rank)
        w.update({n: per_head[n] for n in ("conv_w", "A_log", "dt_bias")})
        w["w_o"] = torch.chunk(weights["w_o"], T, dim=1)[rank].contiguous()
    else:
        for name in ("w_q_b", "w_uk", "w_uv", "w_g"):
            w[name] = shard_heads(weights[name], H, T, 0, name)[rank].contiguous()
        w["w_o"] = shard_heads(weights["w_o"], H, T, 1, "w_o")[rank].contiguous()
    if kind == "dense":
        w["w_dense_gate_up"], w["w_dense_down"] = shard_gated_mlp(weights["w_dense_gate_up"], weights["w_dense_down"],
                                                                  T, "dense MLP")[rank]
        return w
    w.update(shard_routed_experts(LayerWeights(kind, cfg, wd, weights), T)[rank])
    w["w_shared_gate_up"], w["w_shared_down"] = shard_gated_mlp(weights["w_shared_gate_up"],
                                                                weights["w_shared_down"], T, "shared expert")[rank]
    return w


def shard_state(kind: str, state: dict, cfg: K3Config, T: int, rank: int) -> dict:
    """Rank `rank`'s state: the KDA (and dense) conv and recurrent state by head (copies); the MLA cache replicated
    (a copy per rank), block_table and seq_lens as they are (copies)."""
    if kind == "mla":
        return {n: t.clone() for n, t in state.items()}
    per_head = _kda_head_shard({"state": state["recurrent_state"], "conv_state": state["conv_state"]}, cfg, T, rank)
    return {"conv_state": per_head["conv_state"], "recurrent_state": per_head["state"]}


def join_state(kind: str, per_rank: list[dict]) -> dict:
    """The unsplit state from the ranks' (rank order): KDA by head; MLA rank 0's replica."""
    if kind == "mla":
        return dict(per_rank[0])
    return {"conv_state": torch.cat([s["conv_state"] for s in per_rank], 2),
            "recurrent_state": torch.cat([s["recurrent_state"] for s in per_rank], 1)}


def _fold_with_peers(own: torch.Tensor, peers: torch.Tensor) -> torch.Tensor:
    return torch.cat([own.unsqueeze(0), peers.to(own.dtype)])


def layer_step_rank(kind: str, weights: LayerWeights, state: LayerState, layer_idx: int, peer_attn: torch.Tensor,
                    peer_mlp: torch.Tensor, routing: list | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rank 0's decode step: weights and state its shards (weights.config = rank_config), peer_attn
    [T-1,B,D] and peer_mlp [T-1,B,M] the partials ranks 1..T-1 contribute to the two all-reduces
    (M = L + D: latent and shared-experts partials side by side; D for the dense MLP). State in place;
    returns the new prefix (every rank's). ids[B,k]: the experts in place of the router's choice
    (references.layers.route)."""
    _, cfg = check_layer_args(weights, state, kind)
    check_layer_idx(layer_idx)
    B, D = state.prefix.shape
    M = D if kind == "dense" else cfg.latent + D
    check_tensor("peer_attn", peer_attn, shape=(None, B, D), dtypes=(state.prefix.dtype,))
    check_tensor("peer_mlp", peer_mlp, shape=(peer_attn.shape[0], B, M), dtypes=(state.prefix.dtype,))
    slots = next_slots(state) if kind == "mla" else None
    x, mlp_blocks = attn_side(weights, state, layer_idx)
    own = mla_attention(x, weights, state, slots) if kind == "mla" else kda_attention(x, weights, state)
    h = allreduce_attn_res_rmsnorm(state.prefix, _fold_with_peers(own, peer_attn), state.blocks,
                                   weights["mlp_res_norm_w"], weights["mlp_res_proj_w"], weights["post_norm_w"],
                                   mlp_blocks, -1, cfg.rms_eps, cfg.rms_eps)
    if kind == "dense":
        own_m = dense_mlp(h, weights["w_dense_gate_up"], weights["w_dense_down"], cfg.situ_beta, cfg.situ_linear_beta)
        m = fold_partials(_fold_with_peers(own_m, peer_mlp))
    else:
        ids, route_w = route(h, weights, ids)
        if routing is not None:
            routing.append((ids, router_choice(h, weights)))
        z = linear(h, weights["w_latent_down"])
        y = moe_experts_mxfp4(z, ids, route_w, weights["w13_packed"], weights["w13_scale"], weights["w2_packed"],
                              weights["w2_scale"], cfg.situ_beta, cfg.situ_linear_beta)
        shared = shared_experts(h, weights["w_shared_gate_up"], weights["w_shared_down"], cfg.situ_beta,
                                cfg.situ_linear_beta)
        both = fold_partials(_fold_with_peers(torch.cat([y, shared], -1), peer_mlp))
        m = latent_norm_up(both[:, :cfg.latent], weights["latent_norm_w"], weights["w_latent_up"],
                           both[:, cfg.latent:], cfg.rms_eps)
    state.prefix.copy_(state.prefix + m)
    return state.prefix.clone()


def rank_layer_steps(kind: str, x_steps: torch.Tensor, blocks: torch.Tensor, state: dict[str, torch.Tensor],
                     layer_idx: int, config: str, tp: int, tensors: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry form of layer_step_rank over N steps (the layer references' `tp` > 1 form): tensors hold
    rank 0's weights and peer_attn [N,T-1,B,D], peer_mlp [N,T-1,B,M] (each step's peer partials);
    state (rank 0's) updated in place. -> (prefix_steps[N,B,D], router_ids[N,B,k])."""
    from references.config import get_config
    from references.layers import _flat_state, stacked_ids

    cfg = rank_config(get_config(config), tp)
    weights, (peer_attn, peer_mlp) = split_rank_tensors(tensors, tp, x_steps.shape[0], x_steps.shape[1])
    w = LayerWeights(kind, cfg, x_steps.dtype, weights)
    st = _flat_state(x_steps, blocks, **state)
    check_tensor("x_steps", x_steps, ndim=3, shape=(None,) + tuple(st.prefix.shape))
    routing: list = []
    out = rank_steps(kind, w, st, x_steps, layer_idx, peer_attn, peer_mlp, routing)
    return out, stacked_ids([ids for ids, _ in routing], x_steps)


def rank_steps(kind: str, weights: LayerWeights, state: LayerState, x_steps: torch.Tensor, layer_idx: int,
               peer_attn: torch.Tensor, peer_mlp: torch.Tensor, routing: list | None = None,
               route_ids: torch.Tensor | None = None) -> torch.Tensor:
    """layer_step_rank over N steps (state.prefix set to x_steps[t] before step t, state in place):
    peer_attn [N,T-1,B,D], peer_mlp [N,T-1,B,M]; route_ids[N,B,k] each step's experts in place of the
    router's choice. -> prefix_steps[N,B,D]."""
    outs = []
    for t, x in enumerate(x_steps):
        state.prefix.copy_(x)
        outs.append(layer_step_rank(kind, weights, state, layer_idx, peer_attn[t], peer_mlp[t], routing,
                                    None if route_ids is None else route_ids[t]))
    return torch.stack(outs)
