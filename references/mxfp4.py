"""MXFP4 (OCP MX v1.0): E2M1 elements, one E8M0 scale byte per 32 input-dim elements.

Layout of compressed-tensors `mxfp4-pack-quantized` (shared/reference/kimi-k3-math.md §5):
packed[o, j] = code[o, 2j] | code[o, 2j+1] << 4 (low nibble = even column); scale[o, g] covers
columns 32g..32g+31; value = E2M1[code] * 2^(scale - 127), scale byte 0xFF = NaN.

Two published quantisation rules are given (which one Moonshot's QAT used is not published):
  quantize_mxfp4_ocp: torchao `to_mx` FLOOR mode, X = 2^(floor(log2 amax) - 2).
  quantize_mxfp4_ct:  compressed-tensors, amax first rounded at 1 mantissa bit (torchao EVEN).
Both cast v / X to E2M1 with round-to-nearest-even and saturate at +-6. They differ at -0: torchao
keeps the sign bit (a negative value that rounds to 0 gives code 0x8), compressed-tensors packs any
zero as code 0x0 (its `x < 0` sign test is false for -0.0).
"""
from __future__ import annotations

import torch

from references.primitives import check_tensor

GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code 0x0..0xF -> value; bit 3 is the sign, so 0x8 is -0.0
E2M1_LUT = torch.tensor(list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES], dtype=torch.float64)
SCALE_BIAS = 127
SCALE_NAN = 0xFF
_OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "float64": torch.float64}


def out_dtype_of(name: str) -> torch.dtype:
    try:
        return _OUT_DTYPES[name]
    except KeyError:
        raise ValueError(f"out_dtype: {name!r} is not supported; use one of {sorted(_OUT_DTYPES)}") from None


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes[O, I] uint8 in 0..15 -> packed[O, I/2] uint8, even column in the low nibble."""
    check_tensor("codes", codes, ndim=2, dtypes=(torch.uint8,))
    if codes.shape[1] % 2:
        raise ValueError(f"codes: the input dim {codes.shape[1]} must be even to pack two nibbles per byte")
    if bool((codes > 0xF).any()):
        raise ValueError("codes: values must be 4-bit codes in 0..15")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed[O, I/2] uint8 -> codes[O, I] uint8 (low nibble = even column)."""
    check_tensor("packed", packed, ndim=2, dtypes=(torch.uint8,))
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float64 powers of two, 0xFF -> NaN (every value exact in float64)."""
    p = torch.exp2(scale.to(torch.float64) - SCALE_BIAS)
    return torch.where(scale == SCALE_NAN, torch.full_like(p, float("nan")), p)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, out_dtype: str = "bfloat16") -> torch.Tensor:
    """packed[O, I/2] uint8, scale[O, I/32] uint8 -> w[O, I] in out_dtype.

    The product E2M1 * 2^(e-127) is exact in float64, so the result is that exact value rounded
    once to out_dtype (RNE; overflow to inf, gradual underflow): bitwise-defined.
    """
    dtype = out_dtype_of(out_dtype)
    check_tensor("packed", packed, ndim=2, dtypes=(torch.uint8,))
    O, I = packed.shape[0], packed.shape[1] * 2
    if I % GROUP:
        raise ValueError(f"packed: input dim {I} (= 2 x {packed.shape[1]}) is not a multiple of the group {GROUP}")
    check_tensor("scale", scale, shape=(O, I // GROUP), dtypes=(torch.uint8,))
    values = E2M1_LUT.to(packed.device)[unpack_fp4(packed).long()]
    return (values * scale_values(scale).repeat_interleave(GROUP, dim=1)).to(dtype)


def _grouped_amax(w: torch.Tensor) -> torch.Tensor:
    check_tensor("w", w, ndim=2)
    if not w.is_floating_point():
        raise TypeError(f"w: dtype {w.dtype} is not floating point")
    if w.shape[1] % GROUP:
        raise ValueError(f"w: input dim {w.shape[1]} is not a multiple of the group {GROUP}")
    g = w.to(torch.float64).reshape(w.shape[0], -1, GROUP)
    return g, g.abs().amax(-1)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) for positive finite float64 x, exactly (frexp, no log rounding)."""
    _, e = torch.frexp(x)
    return e.to(torch.int64) - 1


def _scale_bytes(unbiased_exp: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    # amax 0 -> byte 0 (codes are all 0 anyway); amax NaN -> 0xFF; exponent clamped to E8M0 range
    byte = (unbiased_exp + SCALE_BIAS).clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    byte = torch.where(torch.isnan(amax), torch.full_like(byte, SCALE_NAN), byte)
    return byte.to(torch.uint8)


# Midpoints between neighbouring E2M1 magnitudes. A value exactly on a midpoint goes to the even
# mantissa: down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5 (the `TIES_UP` ones).
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
TIES_UP = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float64)


def e2m1_index(x: torch.Tensor) -> torch.Tensor:
    """Index 0..7 of |x| rounded to the E2M1 magnitudes, ties to even, saturating at 6 (NaN -> 0).

    Same as compressed-tensors cast_to_fp4: <=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5,
    <=2.5 -> 2, <3.5 -> 3, <=5 -> 4, else 6.
    """
    a = x.abs().to(torch.float64)
    idx = torch.bucketize(a, MIDPOINTS, right=False) + torch.isin(a, TIES_UP).to(torch.int64)
    return torch.where(torch.isnan(a), torch.zeros_like(idx), idx)


def _quantize(w: torch.Tensor, unbiased_exp: torch.Tensor, amax: torch.Tensor, signed_zero: bool):
    g = w.to(torch.float64).reshape(w.shape[0], -1, GROUP)
    byte = _scale_bytes(unbiased_exp, amax)
    x = g / scale_values(byte).unsqueeze(-1)      # exact: division by a power of two (NaN for 0xFF)
    idx = e2m1_index(x)                             # NaN groups get codes 0 under the NaN scale
    negative = torch.signbit(g) if signed_zero else (g < 0) & (idx > 0)
    codes = (idx + 8 * negative.to(torch.int64)).to(torch.uint8).reshape(w.shape)
    return pack_fp4(codes), byte


def quantize_mxfp4_ocp(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao `to_mx` FLOOR (OCP MX v1.0 §6.3): X = 2^(floor(log2 amax) - 2), RNE, saturate +-6.

    w[O, I] floating -> (packed[O, I/2] uint8, scale[O, I/32] uint8). Sign bit kept on zeros.
    """
    _, amax = _grouped_amax(w)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    return _quantize(w, _floor_log2(torch.nan_to_num(safe, nan=1.0)) - 2, amax, signed_zero=True)


def quantize_mxfp4_ct(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors MXFP4: amax rounded at 1 mantissa bit (carry when mantissa >= 1.75, i.e.
    `bits + (1 << (mbits - 2))` then mask the exponent), e = floor(log2 amax_r) - 2, then cast_to_fp4.

    w[O, I] floating -> (packed[O, I/2] uint8, scale[O, I/32] uint8). Zeros packed as code 0.
    """
    _, amax = _grouped_amax(w)
    safe = torch.nan_to_num(torch.where(amax > 0, amax, torch.ones_like(amax)), nan=1.0)
    e = _floor_log2(safe)
    mantissa = safe / torch.exp2(e.to(torch.float64))              # in [1, 2), exact
    e = e + (mantissa >= 1.75).to(torch.int64)
    return _quantize(w, e - 2, amax, signed_zero=False)
