"""Planted bugs in mxfp4_dequant (references.mxfp4:mxfp4_dequant)."""
from __future__ import annotations

import torch

from property_tests.planted._cache import TensorKeyed
from references.mxfp4 import E2M1_LUT, GROUP, out_dtype_of


def _dequant(packed, scale, out_dtype, *, high_nibble_first=False, bias=127, nan_scale=True):
    dtype = out_dtype_of(out_dtype)
    lo, hi = packed & 0xF, packed >> 4
    first, second = (hi, lo) if high_nibble_first else (lo, hi)
    codes = torch.stack([first, second], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])   # 0 rows too
    s = torch.exp2(scale.to(torch.float64) - bias)
    if nan_scale:
        s = torch.where(scale == 0xFF, torch.full_like(s, float("nan")), s)
    return (E2M1_LUT[codes.long()] * s.repeat_interleave(GROUP, dim=1)).to(dtype)


def mxfp4_dequant_control(packed, scale, out_dtype: str = "bfloat16"):
    """No bug: the helper the mxfp4 rows plant theirs in (test_planted_bugs checks it certifies)."""
    return _dequant(packed, scale, out_dtype)


def mxfp4_dequant_drops_column_tail(packed, scale, out_dtype: str = "bfloat16"):
    """Column tiles of 64 (two groups) per thread block, the grid rounded down: a last lone group
    of each row comes back zero (right at every config's I, all multiples of 64)."""
    w = _dequant(packed, scale, out_dtype)
    I = w.shape[1]
    w[:, I // 64 * 64 or I:] = 0
    return w


def mxfp4_dequant_nibble_swap(packed, scale, out_dtype: str = "bfloat16"):
    """Unpacks the HIGH nibble as the even column (the other common packing convention)."""
    return _dequant(packed, scale, out_dtype, high_nibble_first=True)


def mxfp4_dequant_bias_126(packed, scale, out_dtype: str = "bfloat16"):
    """E8M0 exponent bias 126 instead of 127 (every value twice too large)."""
    return _dequant(packed, scale, out_dtype, bias=126)


_DEQUANTIZED = TensorKeyed()


def mxfp4_dequant_memo_output(packed, scale, out_dtype: str = "bfloat16"):
    """Dequantizes each packed weight tensor once and hands back copies of that result afterwards
    (keyed by the tensor object): new codes or scales written into the same tensors are ignored."""
    hit = _DEQUANTIZED.get(packed)
    if hit is None or hit.dtype != out_dtype_of(out_dtype):
        hit = _dequant(packed, scale, out_dtype)
        _DEQUANTIZED.put(packed, hit)
    return hit.clone()


def mxfp4_dequant_fp16_flushes_subnormals(packed, scale, out_dtype: str = "bfloat16"):
    """fp16 output converted with flush-to-zero: results below fp16's smallest normal come back +-0."""
    w = _dequant(packed, scale, out_dtype)
    if w.dtype == torch.float16:
        w = torch.where((w != 0) & (w.abs() < 2.0 ** -14), w * 0, w)
    return w


def mxfp4_dequant_fp16_saturates(packed, scale, out_dtype: str = "bfloat16"):
    """fp16 output converted with saturation (cvt.rn.satfinite): an overflow gives +-65504, not +-inf."""
    w = _dequant(packed, scale, out_dtype)
    if w.dtype == torch.float16:
        w = torch.where(torch.isinf(w), torch.sign(w) * 65504.0, w).to(torch.float16)
    return w


def mxfp4_dequant_returns_one_tuple(packed, scale, out_dtype: str = "bfloat16"):
    """The right w, returned as a tuple of one (a wrapper written for a multi-output op): a caller that
    uses the result as the op's tensor (`w.t()`, `x @ w`) fails."""
    return (_dequant(packed, scale, out_dtype),)
