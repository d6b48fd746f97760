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

import torch

from references.attn_res import allreduce_attn_res_rmsnorm, fold_partials
from references.config import K3Config
from references.kda import kda_attention_step
from references.kda_tp import combine_kda_attention_step, shard_kda_attention_step
from references.layers import (LayerState, attn_side, check_layer_args, check_layer_idx, next_slots,
                               router_choice)
from references.mla import mla_attention_step_tp
from references.moe import (latent_norm_up, moe_experts_mxfp4, moe_tp_shard_width, router_topk,
                            shared_experts)
from references.mxfp4 import GROUP
from references.primitives import linear
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
    """MLA attention by head; the reference folds the T partials itself -> [1,B,D] (one reduced delta)."""
    cfg = w.config
    out = mla_attention_step_tp(x, w["w_qkv_a"], w["q_a_norm_w"], w["kv_a_norm_w"], w["w_q_b"], w["w_uk"], w["w_uv"],
                                w["w_g"], w["w_o"], state.cache, state.block_table, state.seq_lens + 1, slots,
                                cfg.mla_latent_eps, cfg.mla_scale, T)
    state.seq_lens += 1
    return out.unsqueeze(0)


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


def latent_moe_tp(x: torch.Tensor, w: LayerWeights, T: int, routing: list | None = None) -> torch.Tensor:
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
    y = fold_partials(torch.stack(latent_parts))
    shared = fold_partials(torch.stack(shared_parts))
    return latent_norm_up(y, w["latent_norm_w"], w["w_latent_up"], shared, cfg.rms_eps)


def dense_mlp_tp(x: torch.Tensor, w: LayerWeights, T: int) -> torch.Tensor:
    cfg = w.config
    parts = [shared_experts(x, gu, d, cfg.situ_beta, cfg.situ_linear_beta)
             for gu, d in shard_gated_mlp(w["w_dense_gate_up"], w["w_dense_down"], T, "dense MLP")]
    return fold_partials(torch.stack(parts))


# ---------------------------------------------------------------------------------------------- layer step
def layer_step_tp(kind: str, weights: LayerWeights, state: LayerState, layer_idx: int, T: int,
                  routing: list | None = None) -> torch.Tensor:
    """One decode step of a `kind` layer ("kda", "mla", "dense") on T simulated ranks; same contract as
    references.layers.kda_layer / mla_layer / dense_layer0 (state in place, returns the new prefix)."""
    _, cfg = check_layer_args(weights, state, kind)
    check_layer_idx(layer_idx)
    check_tp(T, cfg)
    slots = next_slots(state) if kind == "mla" else None
    x, mlp_blocks = attn_side(weights, state, layer_idx)
    deltas = mla_attention_tp(x, weights, state, slots, T) if kind == "mla" else kda_attention_tp(x, weights, state, T)
    h = allreduce_attn_res_rmsnorm(state.prefix, deltas, state.blocks, weights["mlp_res_norm_w"],
                                   weights["mlp_res_proj_w"], weights["post_norm_w"], mlp_blocks, -1,
                                   cfg.rms_eps, cfg.rms_eps)
    m = dense_mlp_tp(h, weights, T) if kind == "dense" else latent_moe_tp(h, weights, T, routing)
    state.prefix.copy_(state.prefix + m)
    return state.prefix.clone()
