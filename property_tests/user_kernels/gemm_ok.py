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
