"""Small shared primitives, written in the K3 rounding order. dtype-generic (see package doc)."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype K3 uses for its "fp32" steps: float64 when running as the oracle."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_tensor(name: str, t, *, shape=None, dtypes=None, ndim=None) -> None:
    """Raise a clear error naming the argument. shape entries may be None (any)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not supported; expected one of {[str(d) for d in dtypes]}")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T with fp32 (fp64 for the oracle) accumulation, rounded once to x.dtype."""
    acc = acc_dtype(x)
    return (x.to(acc) @ w.to(acc).T).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: normalise in fp32, cast to x.dtype, multiply by the weight (in x.dtype)."""
    acc = acc_dtype(x)
    x32 = x.to(acc)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * y.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps): eps inside the sqrt (fla use_qk_l2norm_in_kernel)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU(gate) * 25 tanh(up / 25) on x = cat([gate, up], -1), computed in fp32, cast back."""
    d = x.shape[-1] // 2
    acc = acc_dtype(x)
    gate, up = x[..., :d].to(acc), x[..., d:].to(acc)
    a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (a * up).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def fold_ranks(parts) -> torch.Tensor:
    """The declared cross-rank reduction of every split in this project: rank 0..T-1 left fold in
    the acc dtype (fp32; fp64 for the oracle), rounded once to the parts' dtype. `parts` is a list
    of per-rank tensors or a tensor whose dim 0 is the rank."""
    acc = acc_dtype(parts[0])
    total = parts[0].to(acc)
    for r in range(1, len(parts)):
        total = total + parts[r].to(acc)
    return total.to(parts[0].dtype)
