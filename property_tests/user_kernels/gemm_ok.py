"""A correct skinny GEMM of one's own (fp32 accumulation, one rounding) and a wrong one (the K tail dropped)."""
from __future__ import annotations

import torch


def skinny_gemm(x, w):
    """One GEMV per row: each row's bits do not depend on its batch position (a blocked GEMM's do)."""
    wf = w.float()
    return torch.stack([wf @ row for row in x.float()]).to(x.dtype)


def skinny_gemm_drops_k_tail(x, w):
    k = x.shape[1] - 16
    return (x[:, :k].float() @ w[:, :k].float().T).to(x.dtype)


def skinny_gemm_batch_variant(x, w):
    """Right values, but a row's bits depend on its batch position: at odd positions its first element
    comes out one ulp up (as another accumulation order in a blocked GEMM rounds it; a cuBLAS-backed
    kernel is batch-variant this way), well inside the tolerance."""
    y = skinny_gemm(x, w)
    y[1::2, 0] = torch.nextafter(y[1::2, 0], torch.full_like(y[1::2, 0], float("inf")))
    return y


def skinny_gemm_row_parity_wrong(x, w):
    """Odd rows of the batch take a path that drops the K tail: wrong at another batch position."""
    y = skinny_gemm(x, w)
    if x.shape[0] > 1:
        k = x.shape[1] - 16
        y[1::2] = (x[1::2, :k].float() @ w[:, :k].float().T).to(x.dtype)
    return y
