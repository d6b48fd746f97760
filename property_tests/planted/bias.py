"""Biased kernels whose every element is inside the per-element tolerance: rejected only by the
sign test of verify/judge/bias.py (stage bias:<output>)."""
from __future__ import annotations

import torch



def _gemv_rows(x, w) -> torch.Tensor:
    """fp32 x @ w.T one row at a time (bits independent of the row's batch position)."""
    wf = w.float()
    return torch.stack([wf @ row for row in x.float()])


def skinny_gemm_scaled_high(x, w):
    """Every output 0.4 % too large (a scale folded in with a rounded constant, a normaliser short by
    0.4 %): about half a bf16 ulp, inside the element tolerance."""
    return (_gemv_rows(x, w) * 1.004).to(x.dtype)


def _truncate(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype rounding toward zero (the bits below the target mantissa dropped)."""
    r = y.to(dtype)
    up = (r.float().abs() > y.abs()) & torch.isfinite(y)
    return torch.where(up, torch.nextafter(r, torch.zeros_like(r)), r)


def skinny_gemm_truncates(x, w):
    """fp32 accumulation, then the result truncated to the working dtype where the reference rounds
    to nearest: half an ulp toward zero on average, inside the element tolerance."""
    return _truncate(_gemv_rows(x, w), x.dtype)
