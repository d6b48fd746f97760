"""The all-reduce of a tensor-parallel layer step: T ranks' partial results, gathered in rank order,
folded in the declared order.

Every sum across ranks in this project is the same fold (primitives.fold_ranks): rank 0..T-1 left
fold in fp32 (float64 when running as the oracle), rounded once to the partials' dtype. An engine
that all-gathers the partials and folds them itself gets the same bits on every rank, in any
transport (NCCL, peer-to-peer stores); a ring or tree all-reduce sums in another order and does not.
The MoE's latent and shared-experts partials of one rank travel as one [B, L + D] row
(references.layers_tp), so the layer folds their concatenation: elementwise the same fold.
"""
from __future__ import annotations

import torch

from references.primitives import FLOAT_DTYPES, check_tensor, fold_ranks


def allreduce_fold(parts: torch.Tensor) -> torch.Tensor:
    """out[B, N] = the rank-order fold of parts[T, B, N] (T >= 1 partials, dim 0 the rank)."""
    check_tensor("parts", parts, ndim=3, dtypes=FLOAT_DTYPES)
    if parts.shape[0] < 1:
        raise ValueError("parts: needs at least one partial (dim 0 = ranks), got 0")
    out = fold_ranks(parts)
    # one partial already in the accumulation dtype: fold_ranks hands back parts[0] itself
    return out.clone() if parts.shape[0] == 1 else out
