"""Whole Kimi K3 decoder layers over decode steps: kimi-k3-math.md §3.2 wiring and §7 order.

One layer step for B sequences (one decode token each), composed only of the op references:
  attn side  attn_res_rmsnorm(prefix, 0, blocks, ...)   AttnRes mix over blocks + prefix, input RMSNorm,
             block push when layer_idx % 12 == 0 (the prefix is snapshotted and restarts at 0)
  attention  kda_attention_step | mla_attention_step (partial o_proj sums all-reduced under TP)
  mlp side   attn_res_rmsnorm(prefix, attn, blocks, ...)  prefix += attn, AttnRes mix, post-attention RMSNorm
  mlp        LatentMoE: router_topk, latent down, moe_experts_mxfp4, shared_experts, latent_norm_up;
             layer 0: dense_mlp
  prefix     prefix += mlp (a working-dtype add); the new prefix is the next layer's input h
At layer 0 there are no blocks yet: the attn-side mix over the single source is exactly the identity
(softmax of one score is 1.0), as HF skips it. Everything is dtype-generic: float64 weights and state
give the oracle. Tensor-parallel forms: references.layers_tp.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from references.attn_res import MAX_SOURCES, attn_res_rmsnorm
from references.config import K3Config
from references.kda import kda_attention_step
from references.mla import mla_attention_step
from references.moe import (dense_mlp, latent_norm_up, moe_experts_mxfp4, renormalise, router_choice_scores,
                            router_topk, shared_experts)
from references.primitives import FLOAT_DTYPES, check_tensor, linear
from references.weights import LayerWeights

N_LAYERS = 93
BLOCK_SLOTS = MAX_SOURCES - 1                    # blocks[B, 8, D]


# ---------------------------------------------------------------------------------------------- schedule
def layer_kind_of(layer_idx: int) -> str:
    """K3 0-based schedule: MLA at 3, 7, ..., 87, 91, 92; layer 0 is KDA with the dense MLP ("dense")."""
    check_layer_idx(layer_idx)
    if layer_idx == 0:
        return "dense"
    return "mla" if (layer_idx + 1) % 4 == 0 or layer_idx >= 91 else "kda"


def check_layer_idx(layer_idx) -> None:
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < N_LAYERS:
        raise ValueError(f"layer_idx: {layer_idx!r} is not a K3 layer; use an int in 0..{N_LAYERS - 1}")


def attn_res_layout(layer_idx: int, block_size: int) -> tuple[int, bool]:
    """(blocks before the layer = ceil(l / block_size), block push at this layer = l % block_size == 0)."""
    check_layer_idx(layer_idx)
    return -(-layer_idx // block_size), layer_idx % block_size == 0


# ---------------------------------------------------------------------------------------------- state
@dataclass
class LayerState:
    """Per-sequence state of one layer. prefix/blocks: the AttnRes stream of the token in flight
    (prefix = the layer's input h, the running partial block sum; blocks[:, :n] its block snapshots).
    KDA: conv_state [B,3,C,W-1] wd (past raw q,k,v inputs, oldest first), recurrent_state [B,H,Dh,Dh]
    fp32 (float64 oracle, V-first). MLA: cache [P,page,C] wd (paged latents), block_table [B,pages]
    int32 (-1 = unassigned), seq_lens [B] int32 = tokens already in the cache."""
    prefix: torch.Tensor
    blocks: torch.Tensor
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None
    cache: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None

    def to(self, dtype: torch.dtype) -> "LayerState":
        """Copy with working-dtype tensors in `dtype`; recurrent_state fp32 unless dtype is float64."""
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None or not t.is_floating_point():
                out[f.name] = None if t is None else t.clone()
            else:
                out[f.name] = t.to(state_dtype if f.name == "recurrent_state" else dtype, copy=True)
        return LayerState(**out)

    def clone(self) -> "LayerState":
        return replace(self, **{f.name: getattr(self, f.name).clone() for f in fields(self)
                                if getattr(self, f.name) is not None})


def new_layer_state(kind: str, cfg: K3Config, batch: int, max_tokens: int, dtype: torch.dtype = torch.bfloat16,
                    blocks: torch.Tensor | None = None) -> LayerState:
    """Empty state for `batch` sequences: zero prefix, blocks (given or zero), zero KDA states, or an
    MLA cache with room for max_tokens per sequence (pages assigned in order, one spare page unowned)."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: {batch!r} must be a positive int")
    D = cfg.hidden
    blocks = torch.zeros(batch, BLOCK_SLOTS, D, dtype=dtype) if blocks is None else blocks.to(dtype, copy=True)
    state = LayerState(prefix=torch.zeros(batch, D, dtype=dtype), blocks=blocks)
    if kind in ("kda", "dense"):
        C = cfg.n_heads * cfg.head_dim
        state.conv_state = torch.zeros(batch, 3, C, cfg.conv_kernel - 1, dtype=dtype)
        state.recurrent_state = torch.zeros(batch, cfg.n_heads, cfg.head_dim, cfg.head_dim,
                                            dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    elif kind == "mla":
        pages = -(-max_tokens // cfg.page_size)
        state.cache = torch.zeros(batch * pages + 1, cfg.page_size, cfg.cache_dim, dtype=dtype)
        state.block_table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        state.seq_lens = torch.zeros(batch, dtype=torch.int32)
    else:
        raise ValueError(f"kind: {kind!r} is not a layer kind; use 'kda', 'mla' or 'dense'")
    return state


def next_slots(state: LayerState) -> torch.Tensor:
    """Cache slot of each sequence's next token; raises naming state.block_table if it has no valid page."""
    page, n_pages = state.cache.shape[1], state.cache.shape[0]
    pos = state.seq_lens.long()
    col = pos // page
    if int(col.max()) >= state.block_table.shape[1]:
        b = int(torch.argmax((col >= state.block_table.shape[1]).int()))
        raise ValueError(f"state.block_table: sequence {b} is full ({int(pos[b])} tokens in "
                         f"{state.block_table.shape[1]} pages of {page}); give it more pages")
    pages = state.block_table.long().gather(1, col[:, None]).squeeze(1)
    bad = (pages < 0) | (pages >= n_pages)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"state.block_table: sequence {b} writes position {int(pos[b])} to page {int(pages[b])}, "
                         f"outside the cache of {n_pages} pages; assign it a page in 0..{n_pages - 1}")
    return pages * page + pos % page


# ---------------------------------------------------------------------------------------------- checks
def check_layer_args(weights: LayerWeights, state: LayerState, kind: str) -> tuple[int, K3Config]:
    """Validate before any state is written; returns (B, config)."""
    if not isinstance(weights, LayerWeights):
        raise TypeError(f"weights: expected references.weights.LayerWeights, got {type(weights).__name__}")
    if weights.kind != kind:
        raise ValueError(f"weights: built for a {weights.kind!r} layer, this is a {kind!r} layer")
    if not isinstance(state, LayerState):
        raise TypeError(f"state: expected references.layers.LayerState, got {type(state).__name__}")
    cfg = weights.config
    wd = (weights.dtype,)
    check_tensor("state.prefix", state.prefix, ndim=2, dtypes=wd)
    B = state.prefix.shape[0]
    check_tensor("state.prefix", state.prefix, shape=(B, cfg.hidden))
    check_tensor("state.blocks", state.blocks, shape=(B, BLOCK_SLOTS, cfg.hidden), dtypes=wd)
    if kind in ("kda", "dense"):
        C, Dh = cfg.n_heads * cfg.head_dim, cfg.head_dim
        check_tensor("state.conv_state", state.conv_state, shape=(B, 3, C, cfg.conv_kernel - 1), dtypes=wd)
        check_tensor("state.recurrent_state", state.recurrent_state, shape=(B, cfg.n_heads, Dh, Dh),
                     dtypes=(torch.float64 if weights.dtype == torch.float64 else torch.float32,))
    else:
        check_tensor("state.cache", state.cache, shape=(None, cfg.page_size, cfg.cache_dim), dtypes=wd)
        check_tensor("state.block_table", state.block_table, shape=(B, None), dtypes=(torch.int32, torch.int64))
        check_tensor("state.seq_lens", state.seq_lens, shape=(B,), dtypes=(torch.int32, torch.int64))
    return B, cfg


# ---------------------------------------------------------------------------------------------- sub-layers
def kda_attention(x: torch.Tensor, w: LayerWeights, state: LayerState) -> torch.Tensor:
    cfg = w.config
    return kda_attention_step(x, w["w_in"], w["w_fb"], w["conv_w"], state.conv_state, w["A_log"], w["dt_bias"],
                              w["o_norm_w"], state.recurrent_state, w["w_o"], cfg.n_heads, cfg.gate_lower_bound,
                              cfg.l2_eps, cfg.rms_eps)


def mla_attention(x: torch.Tensor, w: LayerWeights, state: LayerState, slots: torch.Tensor) -> torch.Tensor:
    cfg = w.config
    out = mla_attention_step(x, w["w_qkv_a"], w["q_a_norm_w"], w["kv_a_norm_w"], w["w_q_b"], w["w_uk"], w["w_uv"],
                             w["w_g"], w["w_o"], state.cache, state.block_table, state.seq_lens + 1, slots,
                             cfg.mla_latent_eps, cfg.mla_scale)
    state.seq_lens += 1
    return out


def router_choice(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """The biased choice scores [B,E] (acc) the top-k selected from: what a tie-aware check needs."""
    return router_choice_scores(x, w["w_router"], w["router_bias"])[1]


def route(x: torch.Tensor, w: LayerWeights, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids[B,k] int64, routing weights[B,k] fp32): the router's top-k of the normed x[B,D], or the given
    ids weighted as the router weighs them (renormalise)."""
    cfg = w.config
    if ids is None:
        return router_topk(x, w["w_router"], w["router_bias"], cfg.top_k, cfg.routed_scale)
    s, _ = router_choice_scores(x, w["w_router"], w["router_bias"])
    ids = ids.to(device=x.device, dtype=torch.int64)
    return ids, renormalise(s, ids, cfg.routed_scale)


def latent_moe(x: torch.Tensor, w: LayerWeights, routing: list | None = None,
               ids: torch.Tensor | None = None) -> torch.Tensor:
    """K3 LatentMoE on the normed x[B,D]; appends (ids, choice scores) to `routing` when given. `ids`
    [B,k]: experts to route to in place of the router's top-k, weighted as the router weighs them
    (renormalise): the reference at a candidate's own choice inside a near-tie."""
    cfg = w.config
    ids, route_w = route(x, w, ids)
    if routing is not None:
        routing.append((ids, router_choice(x, w)))
    z = linear(x, w["w_latent_down"])
    y = moe_experts_mxfp4(z, ids, route_w, w["w13_packed"], w["w13_scale"], w["w2_packed"], w["w2_scale"],
                          cfg.situ_beta, cfg.situ_linear_beta)
    shared = shared_experts(x, w["w_shared_gate_up"], w["w_shared_down"], cfg.situ_beta, cfg.situ_linear_beta)
    return latent_norm_up(y, w["latent_norm_w"], w["w_latent_up"], shared, cfg.rms_eps)


def mlp(x: torch.Tensor, w: LayerWeights, routing: list | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    cfg = w.config
    if w.kind == "dense":
        return dense_mlp(x, w["w_dense_gate_up"], w["w_dense_down"], cfg.situ_beta, cfg.situ_linear_beta)
    return latent_moe(x, w, routing, ids)


# ---------------------------------------------------------------------------------------------- one layer step
def attn_side(w: LayerWeights, state: LayerState, layer_idx: int) -> tuple[torch.Tensor, int]:
    """AttnRes mix (attn side) + block push + input RMSNorm -> (normed x, blocks visible to the mlp side)."""
    cfg = w.config
    n_blocks, push = attn_res_layout(layer_idx, cfg.attn_res_block)
    zero = torch.zeros_like(state.prefix)
    x = attn_res_rmsnorm(state.prefix, zero, state.blocks, w["attn_res_norm_w"], w["attn_res_proj_w"],
                         w["input_norm_w"], n_blocks, n_blocks if push else -1, cfg.rms_eps, cfg.rms_eps)
    return x, n_blocks + int(push)


def mlp_side(w: LayerWeights, state: LayerState, attn_out: torch.Tensor, mlp_blocks: int,
             routing: list | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """prefix += attn; AttnRes mix (mlp side) + post-attention RMSNorm; mlp; prefix += mlp. Returns prefix."""
    cfg = w.config
    h = attn_res_rmsnorm(state.prefix, attn_out, state.blocks, w["mlp_res_norm_w"], w["mlp_res_proj_w"],
                         w["post_norm_w"], mlp_blocks, -1, cfg.rms_eps, cfg.rms_eps)
    state.prefix.copy_(state.prefix + mlp(h, w, routing, ids))
    return state.prefix.clone()


def kda_layer(weights: LayerWeights, state: LayerState, layer_idx: int, routing: list | None = None,
              ids: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of a KDA layer (LatentMoE); state.prefix in = h, out = the new prefix (returned).
    ids[B,k]: the experts in place of the router's choice (latent_moe)."""
    check_layer_args(weights, state, "kda")
    check_layer_idx(layer_idx)
    x, mlp_blocks = attn_side(weights, state, layer_idx)
    return mlp_side(weights, state, kda_attention(x, weights, state), mlp_blocks, routing, ids)


def dense_layer0(weights: LayerWeights, state: LayerState) -> torch.Tensor:
    """Layer 0: KDA attention + the dense MLP; no blocks yet, the input h (embedding) becomes block 0."""
    check_layer_args(weights, state, "dense")
    x, mlp_blocks = attn_side(weights, state, 0)
    return mlp_side(weights, state, kda_attention(x, weights, state), mlp_blocks)


def mla_layer(weights: LayerWeights, state: LayerState, layer_idx: int, routing: list | None = None,
              ids: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of a gated MLA layer: the new token's latent is cached at its next slot.
    ids[B,k]: the experts in place of the router's choice (latent_moe)."""
    check_layer_args(weights, state, "mla")
    check_layer_idx(layer_idx)
    slots = next_slots(state)                     # raises before any state is written
    x, mlp_blocks = attn_side(weights, state, layer_idx)
    return mlp_side(weights, state, mla_attention(x, weights, state, slots), mlp_blocks, routing, ids)


# ---------------------------------------------------------------------------------------------- driver
DEFAULT_LAYER = {"kda": 13, "mla": 15, "dense": 0}   # 13: 2 blocks, no push; 15: MLA, 2 blocks


def decode_steps(layer_kind: str, weights: LayerWeights, state: LayerState, x_steps: torch.Tensor,
                 layer_idx: int | None = None, tp: int | None = None, routing: list | None = None,
                 route_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Step B sequences through N decode steps: x_steps[N,B,D] are the layer inputs h (state.prefix is set
    to x_steps[t] before step t; state.blocks stay the token's block snapshots). Returns prefix_out[N,B,D].

    tp=None runs the unsplit layer, tp=T the tensor-parallel form (references.layers_tp). `routing`
    collects (ids[B,k], choice scores[B,E]) per step for MoE layers. route_ids[N,B,k] (unsplit MoE
    layers): each step's experts in place of the router's choice (latent_moe).
    """
    if layer_kind not in DEFAULT_LAYER:
        raise ValueError(f"layer_kind: {layer_kind!r} is unknown; use one of {sorted(DEFAULT_LAYER)}")
    layer_idx = DEFAULT_LAYER[layer_kind] if layer_idx is None else layer_idx
    check_layer_idx(layer_idx)
    if layer_kind_of(layer_idx) != layer_kind:
        raise ValueError(f"layer_idx: K3 layer {layer_idx} is a {layer_kind_of(layer_idx)!r} layer, not "
                         f"{layer_kind!r}; pick one from references.layers.layer_kind_of")
    check_tensor("x_steps", x_steps, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("x_steps", x_steps, shape=(None,) + tuple(state.prefix.shape), dtypes=(state.prefix.dtype,))
    if route_ids is not None:
        if tp is not None or layer_kind == "dense":
            raise ValueError("route_ids: only the unsplit MoE layers ('kda', 'mla') take them")
        check_tensor("route_ids", route_ids, shape=(x_steps.shape[0], x_steps.shape[1], weights.config.top_k),
                     dtypes=(torch.int32, torch.int64))
    if tp is not None:
        from references.layers_tp import layer_step_tp
    outs = []
    for t, x in enumerate(x_steps):
        state.prefix.copy_(x)
        ids = None if route_ids is None else route_ids[t]
        if tp is not None:
            outs.append(layer_step_tp(layer_kind, weights, state, layer_idx, tp, routing))
        elif layer_kind == "kda":
            outs.append(kda_layer(weights, state, layer_idx, routing, ids))
        elif layer_kind == "mla":
            outs.append(mla_layer(weights, state, layer_idx, routing, ids))
        else:
            outs.append(dense_layer0(weights, state))
    return torch.stack(outs)


def stacked_ids(ids: list, x_steps: torch.Tensor) -> torch.Tensor:
    """router_ids[N,B,k] int64 from each step's ids[B,k]; [N,B,0] for the dense layer (no step routed)."""
    if not ids:
        return torch.empty(x_steps.shape[0], x_steps.shape[1], 0, dtype=torch.int64, device=x_steps.device)
    return torch.stack(ids).to(torch.int64)


# ---------------------------------------------------------------------------------------------- registry form
def _flat_state(x_steps, blocks, **state_tensors) -> LayerState:
    check_tensor("x_steps", x_steps, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("blocks", blocks, ndim=3, dtypes=(x_steps.dtype,))
    # prefix and blocks are working copies: the registry's x_steps and blocks are plain inputs
    return LayerState(prefix=torch.zeros_like(x_steps[0]), blocks=blocks.clone(), **state_tensors)


def kda_layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                    **weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry form of decode_steps for a KDA-attention layer: flat tensors in, (prefix_steps[N,B,D],
    router_ids[N,B,k] int64: each step's experts) out; conv_state and recurrent_state updated in place.
    weights: the names of references.weights. Layer 0 is the dense one (its weights: the dense MLP's in
    place of the LatentMoE's; router_ids [N,B,0]). tp > 1: one rank of a T-rank step, its shards and the
    other ranks' partials (references.layers_tp.rank_layer_steps)."""
    from references.config import get_config
    kind = kda_kind_of(layer_idx)
    if tp != 1:
        from references.layers_tp import rank_layer_steps
        return rank_layer_steps(kind, x_steps, blocks, {"conv_state": conv_state, "recurrent_state": recurrent_state},
                                layer_idx, config, tp, weights)
    w = LayerWeights(kind, get_config(config), x_steps.dtype, weights)
    state = _flat_state(x_steps, blocks, conv_state=conv_state, recurrent_state=recurrent_state)
    routing: list = []
    out = decode_steps(kind, w, state, x_steps, layer_idx, routing=routing)
    return out, stacked_ids([ids for ids, _ in routing], x_steps)


def kda_kind_of(layer_idx) -> str:
    """"dense" for layer 0 (KDA attention, dense MLP), else "kda": the kind of a KDA-attention layer."""
    return "dense" if layer_idx == 0 else "kda"


def mla_layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                    **weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Registry form of decode_steps for a gated MLA layer: (prefix_steps[N,B,D], router_ids[N,B,k])
    out; each step's latents are written to cache at the next slot of block_table, seq_lens advanced
    by N (both in place). tp > 1: one rank of a T-rank step (kda_layer_steps)."""
    from references.config import get_config
    if tp != 1:
        from references.layers_tp import rank_layer_steps
        return rank_layer_steps("mla", x_steps, blocks, {"cache": cache, "block_table": block_table,
                                                         "seq_lens": seq_lens}, layer_idx, config, tp, weights)
    w = LayerWeights("mla", get_config(config), x_steps.dtype, weights)
    state = _flat_state(x_steps, blocks, cache=cache, block_table=block_table, seq_lens=seq_lens)
    routing: list = []
    out = decode_steps("mla", w, state, x_steps, layer_idx, routing=routing)
    return out, stacked_ids([ids for ids, _ in routing], x_steps)
