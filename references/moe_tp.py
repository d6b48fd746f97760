"""The LatentMoE's tail on one tensor-parallel rank, after the one all-gather of its partials.

Each rank of T computes its slice of every chosen routed expert (a partial of the latent output y)
and its slice of the shared experts (a partial of their output); the layer gathers both as one
[T, B, L + D] row per rank (references.layers_tp) and every rank then folds them in the declared
order (references.allreduce: rank 0..T-1 in fp32, one rounding), normalises and up-projects the
latent, adds the shared experts' output and the residual prefix:

    out = prefix + latent_norm_up(fold(y_parts), norm_w, w_up, fold(shared_parts), eps)

(both adds in the working dtype, as the layer rounds them). This is the op a fused MoE tail computes
in one launch: the folds, the RMSNorm, the up-projection GEMV and both adds, nothing written but out.
At T = 1 the folds are copies: the unsplit layer's `prefix + latent_norm_up(y, ..., shared, eps)`.
"""
from __future__ import annotations

import torch

from references.allreduce import allreduce_fold
from references.moe import latent_norm_up
from references.primitives import FLOAT_DTYPES, check_tensor


def allreduce_latent_norm_up(prefix: torch.Tensor, y_parts: torch.Tensor, shared_parts: torch.Tensor,
                             norm_w: torch.Tensor, w_up: torch.Tensor, eps: float) -> torch.Tensor:
    """out[B, D] = prefix + latent_norm_up(fold(y_parts[T, B, L]), norm_w, w_up, fold(shared_parts[T, B, D]),
    eps); the T partials of each in rank order (dim 0)."""
    check_tensor("prefix", prefix, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = prefix.shape
    wd = (prefix.dtype,)
    check_tensor("y_parts", y_parts, ndim=3, dtypes=wd)
    T, L = y_parts.shape[0], y_parts.shape[2]
    if T < 1:
        raise ValueError("y_parts: needs at least one partial (dim 0 = ranks), got 0")
    check_tensor("y_parts", y_parts, shape=(T, B, L))
    check_tensor("shared_parts", shared_parts, shape=(T, B, D), dtypes=wd)
    check_tensor("norm_w", norm_w, shape=(L,), dtypes=wd)
    check_tensor("w_up", w_up, shape=(D, L), dtypes=wd)
    return prefix + latent_norm_up(allreduce_fold(y_parts), norm_w, w_up, allreduce_fold(shared_parts), eps)
