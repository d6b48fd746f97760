"""Tensor-parallel and expert-parallel splits of the MoE ops (kimi-k3-math §4.2). No OPS here.

router_topk:       replicated (vLLM GateLinear); the scores-split-by-expert-range + gather form is
                   references.moe.router_topk_scores_split (its own test).
moe_experts_mxfp4: TP over the intermediate dim: each rank holds w1/w3 rows and w2 columns of its
                   slice (width moe_tp_shard_width, zero-padded), returns a partial latent y_r [B,L]
                   in wd; partials are all-reduced by the declared fold. EP: experts split by range,
                   ids of other ranks' experts become -1 (padding), same fold.
shared_experts:    column (gate/up rows) then row (down columns): partial [B,D] per rank, same fold.
"""
from __future__ import annotations

import torch

from references.moe import expert_ranges, moe_tp_shard_width
from references.mxfp4 import GROUP, SCALE_BIAS
from verify.model.opdef import OpInputs, RankShard, SplitRule
from verify.ops.common_splits import FOLD_ORDER, check_divides, check_tp, sum_outputs_combine

_EXPERT_WEIGHTS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def _pad_dim(t: torch.Tensor, dim: int, size: int, fill: int) -> torch.Tensor:
    """Pad t along dim to size with a constant byte: packed 0 = two +0 codes; scale 127 = 2^0."""
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype)], dim=dim)


def shard_moe_intermediate(inputs: OpInputs, T: int) -> list[RankShard]:
    t = inputs.tensors
    check_tp(T)
    inter = t["w13_packed"].shape[1] // 2
    width = moe_tp_shard_width(inter, T)
    padded = width * T
    # w13 rows are [w1 (gate); w3 (up)]: slice both halves the same way, keep [gate_r; up_r] per rank
    gate_p, up_p = (_pad_dim(h, 1, padded, 0) for h in t["w13_packed"].split(inter, dim=1))
    gate_s, up_s = (_pad_dim(h, 1, padded, SCALE_BIAS) for h in t["w13_scale"].split(inter, dim=1))
    w2_p = _pad_dim(t["w2_packed"], 2, padded // 2, 0)
    w2_s = _pad_dim(t["w2_scale"], 2, padded // GROUP, SCALE_BIAS)
    shards = []
    for r in range(T):
        rows = slice(r * width, (r + 1) * width)
        shard = {k: v.clone() for k, v in t.items() if k not in _EXPERT_WEIGHTS}
        shard["w13_packed"] = torch.cat([gate_p[:, rows], up_p[:, rows]], dim=1).contiguous()
        shard["w13_scale"] = torch.cat([gate_s[:, rows], up_s[:, rows]], dim=1).contiguous()
        shard["w2_packed"] = w2_p[:, :, r * width // 2:(r + 1) * width // 2].contiguous()
        shard["w2_scale"] = w2_s[:, :, r * width // GROUP:(r + 1) * width // GROUP].contiguous()
        shards.append(RankShard(shard, dict(inputs.params)))
    return shards


def shard_moe_experts(inputs: OpInputs, T: int) -> list[RankShard]:
    t = inputs.tensors
    ids = t["ids"]
    shards = []
    for lo, hi in expert_ranges(t["w13_packed"].shape[0], T):
        shard = {k: t[k][lo:hi].clone() for k in _EXPERT_WEIGHTS}
        local = (ids >= lo) & (ids < hi)
        shard["ids"] = torch.where(local, ids - lo, torch.full_like(ids, -1))
        shard["z"], shard["weights"] = t["z"].clone(), t["weights"].clone()
        shards.append(RankShard(shard, dict(inputs.params)))
    return shards


def shard_shared_experts(inputs: OpInputs, T: int) -> list[RankShard]:
    t = inputs.tensors
    inter = t["w_down"].shape[1]
    check_divides(T, inter, "shared intermediate (columns of w_down)")
    n = inter // T
    gate, up = t["w_gate_up"].split(inter, dim=0)
    return [RankShard({"x": t["x"].clone(),
                       "w_gate_up": torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]).contiguous(),
                       "w_down": t["w_down"][:, r * n:(r + 1) * n].contiguous()}, dict(inputs.params))
            for r in range(T)]


MOE_EXPERTS_TP_SPLIT = SplitRule(kind="partial_sum", shard=shard_moe_intermediate,
                                 combine=sum_outputs_combine(("y",)), reduction_order=FOLD_ORDER,
                                 order_sensitive=True)
MOE_EXPERTS_EP_SPLIT = SplitRule(kind="experts", shard=shard_moe_experts,
                                 combine=sum_outputs_combine(("y",)), reduction_order=FOLD_ORDER,
                                 order_sensitive=True)
SHARED_EXPERTS_SPLIT = SplitRule(kind="partial_sum", shard=shard_shared_experts,
                                 combine=sum_outputs_combine(("y",)), reduction_order=FOLD_ORDER,
                                 order_sensitive=True)
