"""Skinny GEMM (M = 1..64 decode tokens): o_proj, g_proj, latent down/up, dense MLP projections."""
from __future__ import annotations

import torch

from references.primitives import FLOAT_DTYPES, check_tensor, linear


def skinny_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[M,K] wd, w[N,K] wd -> y[M,N] wd = x @ w.T, accumulated in acc (fp32), rounded once."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w", w, shape=(None, x.shape[1]), dtypes=(x.dtype,))
    return linear(x, w)
