"""Value distributions for drawn inputs. All draws go through a seeded CPU torch.Generator."""
from __future__ import annotations

import torch

DISTS = ("normal", "heavy_tailed", "outliers", "zero_rows", "wide_range", "mxfp4_grid", "near_ties",
         "order_sensitive")
GENERIC_DISTS = ("normal", "heavy_tailed", "outliers", "zero_rows", "wide_range")

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def draw(gen: torch.Generator, shape, dist: str = "normal", *, scale: float = 1.0,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Draw a tensor of `shape` from distribution `dist`, scaled by `scale`, rounded to `dtype`.

    Distributions that need a per-row meaning (zero_rows) treat dim 0 as rows.
    near_ties and order_sensitive fall back to normal here; ops that use them build them themselves.
    """
    shape = tuple(int(s) for s in shape)
    if dist not in DISTS:
        raise ValueError(f"dist={dist!r} is unknown; choose one of {DISTS}")
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dist == "heavy_tailed":
        # Student-t with 3 degrees of freedom: finite variance, frequent large values.
        chi = torch.randn((3,) + shape, generator=gen, dtype=torch.float64).pow(2).sum(0) / 3
        x = x / chi.sqrt().clamp_min(1e-3) / 1.7
    elif dist == "outliers":
        mask = torch.rand(shape, generator=gen, dtype=torch.float64) < 0.01
        x = torch.where(mask, x * 64.0, x)
    elif dist == "zero_rows" and len(shape) >= 1 and shape[0] > 0:
        rows = torch.rand(shape[0], generator=gen) < 0.3
        rows[torch.randint(0, shape[0], (1,), generator=gen)] = True
        x[rows] = 0.0
    elif dist == "wide_range":
        x = x * torch.exp2(torch.randint(-12, 13, shape, generator=gen).to(torch.float64))
    elif dist == "mxfp4_grid":
        idx = torch.randint(0, 8, shape, generator=gen)
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        x = _E2M1[idx] * sign * 0.5
    return (x * scale).to(dtype)


def generator(seed: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + salt) % (2**63 - 1))
    return g
