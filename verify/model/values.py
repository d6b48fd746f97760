"""Value distributions for drawn inputs. All draws go through a seeded CPU torch.Generator."""
from __future__ import annotations

import torch

DISTS = ("normal", "heavy_tailed", "outliers", "zero_rows", "wide_range", "small_rows", "mxfp4_grid", "near_ties",
         "order_sensitive", "range_edges", "nonfinite")
GENERIC_DISTS = ("normal", "heavy_tailed", "outliers", "zero_rows", "wide_range", "small_rows")
# Declared by the ops whose reference gives every input a defined result (no selection over scores):
# range_edges (rows at the edges of the working dtype's exponent range) and nonfinite (NaN and
# infinities in some rows). Not by router_topk and the ops that route (a top-k over NaN scores has no
# declared choice) nor by those whose float inputs are weights to quantize (mxfp4).
EDGE_DISTS = ("range_edges", "nonfinite")

# range_edges: each row (dim 0) is the normal draw times 2^k, k drawn per row from three classes: 0,
# huge and tiny. For the 8-bit-exponent working dtypes (bf16, fp32) huge is 2^16..2^20 and tiny
# 2^-30..2^-20: beyond fp16's largest finite value (65504) and below its smallest subnormal (2^-24),
# so a kernel that stages bf16 values, products or sums in fp16 overflows or flushes them (the fp16
# range is where half of today's GPU code lives; wide_range stays inside it). For fp16 itself huge is
# 2^8..2^12 (a 3-sigma value stays below 65504) and tiny 2^-20..2^-16 (subnormals). Powers of two keep
# each row exact in the working dtype, as in small_rows.
RANGE_EDGE_K = {"wide_exponent": ((16, 20), (-30, -20)), "float16": ((8, 12), (-20, -16))}

# nonfinite: rows (dim 0) classed finite / NaN / +inf / -inf from a per-case generator shared by all
# of a case's tensors (row_classes), so a finite row stays finite in every input and its outputs are
# judged as usual; each tensor puts one special value at a position of its own in each non-finite row
# with probability 1/2 (its own draw), so in an op with several inputs a row mixes special and finite
# tensors (AttnRes: NaN in some sources of a row, not in all). The oracle (the reference in fp64 on the same inputs) says where NaN and infinities must come
# out: a kernel that drops NaN (fmaxf in a max, a clamp, a skipped element, nan_to_num) or turns an
# infinity into NaN where the reference does not is wrong there.
NONFINITE_CLASSES = ("finite", "nan", "+inf", "-inf")
NONFINITE_SALT = 0x4E614E          # the row classes' generator salt (with the case seed)

# small_rows: row r is normal times 2^-k_r, k_r uniform over SMALL_ROW_K (one row kept at 2^0 when there
# are two or more). Powers of two keep each row's values exact (the working-dtype rounding commutes with
# the scale), and the range puts row norms across the regimes where a normalisation's eps matters:
#   RMSNorm, mean x^2 = 2^-2k: eps 1e-5 at k ~ 8.3, eps 1e-6 at k ~ 10;
#   kda's q/k L2 norm after the W = 4 conv (weights N(0, 1/W)) and SiLU (~x/2 near 0):
#   sum q^2 ~ Dh 2^-2k / 4 = l2_eps (1e-6) at k ~ 11 (Dh 16), 11.5 (Dh 32), 12.5 (Dh 128);
# k = 4..6 are small but eps-insensitive rows, k = 13..14 rows where eps dominates the norm.
# Representability: bf16 and fp32 have fp32's exponent range, so every row is exact. fp16's smallest
# normal is 2^-14 (6.1e-5) and its subnormals reach 2^-24 (6e-8): at k >= 11 a row's smaller elements are
# fp16 subnormals with fewer significant bits, and at k = 14 about half the row is subnormal and the
# elements below 2^-10 of the row's scale round to 0 (not the whole row: zero_rows covers that). The
# reference and the oracle see the same rounded inputs, so judging stays self-consistent; a kernel
# that flushes fp16 subnormal inputs (or squares x in fp16: 2^-28 underflows) is wrong on these rows.
SMALL_ROW_K = (4, 14)

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def draw(gen: torch.Generator, shape, dist: str = "normal", *, scale: float = 1.0,
         dtype: torch.dtype = torch.float32, row_seed: int | None = None,
         range_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Draw a tensor of `shape` from distribution `dist`, scaled by `scale`, rounded to `dtype`.

    Distributions that need a per-row meaning (zero_rows, small_rows, range_edges, nonfinite) treat
    dim 0 as rows. nonfinite draws its row classes from the case seed `row_seed` (the same for every
    tensor of the case with as many rows), else from `gen`. range_edges takes its exponents for
    `range_dtype` (default `dtype`: a tensor drawn in fp64 for an fp16 case passes fp16). near_ties and order_sensitive fall back to normal
    here; ops that use them build them themselves.
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
        neg = torch.rand(shape, generator=gen) < 0.5          # -0.0 and +0.0: a bitwise copy keeps the sign
        # exact zeros inside the other rows too, half of them at the row's first element: a kernel that
        # takes a row (or tile) for zero from one element, or skips zero elements wrongly, is seen
        sparse = torch.rand(shape, generator=gen) < 0.25
        if shape[-1] > 0:
            sparse[..., 0] |= torch.rand(shape[:-1], generator=gen) < 0.5
        sparse[rows] = True
        x = torch.where(sparse, torch.where(neg, -0.0, 0.0).to(torch.float64), x)
    elif dist == "small_rows" and len(shape) >= 1 and shape[0] > 0:
        x = x * _per_row(row_scales(gen, shape[0]), shape)
    elif dist == "wide_range":
        x = x * torch.exp2(torch.randint(-12, 13, shape, generator=gen).to(torch.float64))
    elif dist == "range_edges" and len(shape) >= 1 and shape[0] > 0:
        x = x * _per_row(range_edge_scales(gen, shape[0], range_dtype or dtype), shape)
    elif dist == "nonfinite" and len(shape) >= 1 and shape[0] > 0 and x.numel():
        rows = row_classes(gen if row_seed is None else generator(row_seed, NONFINITE_SALT), shape[0])
        x = place_nonfinite(gen, x, rows)
    elif dist == "mxfp4_grid":
        idx = torch.randint(0, 8, shape, generator=gen)
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        x = _E2M1[idx] * sign * 0.5
    return (x * scale).to(dtype)


def _per_row(scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """One scale per row (dim 0) of a tensor of `shape`, viewed to broadcast over the other dims."""
    return scales.view((shape[0],) + (1,) * (len(shape) - 1))


def row_scales(gen: torch.Generator, n_rows: int) -> torch.Tensor:
    """small_rows' fp64 per-row scales 2^-k, k uniform over SMALL_ROW_K; one row (drawn) keeps scale 1
    when n_rows >= 2, so a case also holds an ordinary row beside its small ones. Ops whose rows span
    several tensors (kda_decode: q/k/v and their conv window) draw one set and apply it to each."""
    lo, hi = SMALL_ROW_K
    k = torch.randint(lo, hi + 1, (int(n_rows),), generator=gen)
    if n_rows >= 2:
        k[torch.randint(0, int(n_rows), (1,), generator=gen)] = 0
    return torch.exp2(-k.to(torch.float64))


def range_edge_scales(gen: torch.Generator, n_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """range_edges' fp64 per-row scales: 2^0, 2^huge or 2^tiny (RANGE_EDGE_K for the dtype) in turn
    from a drawn start, so any two rows hold two classes and three rows all of them."""
    (h0, h1), (t0, t1) = RANGE_EDGE_K["float16" if dtype == torch.float16 else "wide_exponent"]
    start = int(torch.randint(0, 3, (1,), generator=gen))
    huge = torch.randint(h0, h1 + 1, (int(n_rows),), generator=gen)
    tiny = torch.randint(t0, t1 + 1, (int(n_rows),), generator=gen)
    cls = (torch.arange(int(n_rows)) + start) % 3
    k = torch.where(cls == 0, 0, torch.where(cls == 1, huge, tiny))
    return torch.exp2(k.to(torch.float64))


def row_classes(gen: torch.Generator, n_rows: int) -> torch.Tensor:
    """nonfinite's row classes, indices into NONFINITE_CLASSES: each row finite with probability 1/2,
    else NaN, +inf or -inf alike; with two rows or more at least one finite and one non-finite row (a
    case judges both); a single row is always non-finite (a finite one-row case of this dist would
    count as drawn and keep the dist sweep from running the dist with specials)."""
    n = int(n_rows)
    cls = torch.where(torch.rand(n, generator=gen) < 0.5, 0, torch.randint(1, 4, (n,), generator=gen))
    if n == 1:
        cls[0] = int(torch.randint(1, 4, (1,), generator=gen))
    elif n >= 2:
        pick = torch.randperm(n, generator=gen)[:2]
        cls[pick[0]] = 0
        if not bool((cls != 0).any()):
            cls[pick[1]] = int(torch.randint(1, 4, (1,), generator=gen))
    return cls


def place_nonfinite(gen: torch.Generator, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (fp64, rows along dim 0) with one NaN / +inf / -inf, as `rows` classes each row, at a drawn
    position of that row, in each non-finite row with probability 1/2 (in one of them, drawn, where that draw hit none)."""
    if rows.numel() != x.shape[0]:
        raise ValueError(f"nonfinite: {rows.numel()} row classes for a tensor of {x.shape[0]} rows")
    flat = x.reshape(x.shape[0], -1).clone()
    col = torch.randint(0, flat.shape[1], (flat.shape[0],), generator=gen)
    special = torch.tensor([0.0, float("nan"), float("inf"), float("-inf")], dtype=torch.float64)
    hit = (rows != 0) & (torch.rand(flat.shape[0], generator=gen) < 0.5)
    if not bool(hit.any()) and bool((rows != 0).any()):     # one of the non-finite rows at least
        broken = torch.nonzero(rows != 0).reshape(-1)
        hit[broken[int(torch.randint(0, broken.numel(), (1,), generator=gen))]] = True
    flat[torch.nonzero(hit).reshape(-1), col[hit]] = special[rows[hit]]
    return flat.reshape(x.shape)


SEED_MODULUS = 2**63 - 1          # torch.Generator.manual_seed's range; a case seed is below it


def generator(seed: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + salt) % SEED_MODULUS)
    return g
