"""Planted bugs in the routed experts under expert parallelism (moe_experts_mxfp4_ep): the slips of a
kernel whose ranks see mostly padding slots."""
from __future__ import annotations

import torch

from references.moe import moe_experts_mxfp4 as _ref


def moe_experts_mxfp4_ep_control(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """The reference through the same argument path as the bugs below (their bug-free twin)."""
    return _ref(z, ids.clone(), weights.clone(), w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                situ_linear_beta)


def moe_experts_mxfp4_ep_renormalised(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Rescales each token's routing weights to their full sum over the slots it holds (a kernel that
    renormalises per rank): right while every slot is local, wrong under EP."""
    valid = ids >= 0
    held = torch.where(valid, weights, torch.zeros_like(weights)).sum(-1, keepdim=True)
    scale = torch.where(held > 0, weights.sum(-1, keepdim=True) / held.clamp_min(1e-30), torch.ones_like(held))
    return _ref(z, ids, weights * scale, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta)


def moe_experts_mxfp4_ep_padding_as_expert_0(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                             situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Clamps ids to >= 0 before the lookup: a padding slot runs the rank's first expert with its weight."""
    return _ref(z, ids.clamp_min(0), weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                situ_linear_beta)


def moe_experts_mxfp4_ep_empty_row_nan(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                       situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """A token with no slot on the rank gets 0 / 0 from a per-row normalisation: a NaN row, not zeros."""
    y = _ref(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta)
    empty = ~(ids >= 0).any(-1)
    y[empty] = float("nan")
    return y
