"""Comparison by exactness class (shared/OPS.md): bitwise, derived against an fp64 oracle, tie-aware ids."""
from __future__ import annotations

import torch

from verify.verdict import Check

_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
_MIN_EXP = {torch.float64: -1022, torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}
N_WORST = 5


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at `magnitude` (float64 tensor), subnormals included."""
    mant = _MANTISSA.get(dtype, 23)
    exp = torch.floor(torch.log2(magnitude.clamp_min(2.0 ** _MIN_EXP.get(dtype, -126))))
    return torch.exp2(exp.clamp_min(_MIN_EXP.get(dtype, -126)) - mant)


def _rows(t: torch.Tensor, row_ndim: int = 1, device=None) -> torch.Tensor:
    """Rows to judge, in float64 on `device` (the oracle's: judging stays where the tensors are; a
    GPU judges a 170 MB state in milliseconds where a CPU takes seconds): the last `row_ndim` dims
    flattened (elements that share one scale)."""
    t = t.detach().to(t.device if device is None else device, torch.float64)
    if t.dim() <= row_ndim:
        return t.reshape(1, -1)
    return t.reshape(-1, int(torch.tensor(t.shape[-row_ndim:]).prod()))


def _worst(c: torch.Tensor, o: torch.Tensor, b: torch.Tensor | None, err: torch.Tensor, shape) -> tuple:
    """The N_WORST largest errors (NaN counts as infinite), ties broken by the lower flat index, so
    the report is the same whichever device judged (topk's order among equal values is not)."""
    flat = torch.nan_to_num(err.reshape(-1), nan=float("inf"))
    n = min(N_WORST, flat.numel())
    if n == 0:
        return ()
    kth = torch.topk(flat, n).values[-1]
    above = torch.nonzero(flat > kth).reshape(-1)
    tied = torch.nonzero(flat == kth).reshape(-1)[: n - above.numel()]
    picked = torch.cat([above, tied]).tolist()
    vals = flat[torch.tensor(picked, device=flat.device)].tolist()
    out = []
    for _, i in sorted(zip((-v for v in vals), picked)):
        where = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), tuple(shape))) if shape else ()
        out.append((where, float(c.reshape(-1)[i]), float(o.reshape(-1)[i]),
                    None if b is None else float(b.reshape(-1)[i])))
    return tuple(out)


def vacuous_reason(oracle: torch.Tensor) -> str | None:
    """A derived comparison proves nothing on an all-zero or non-finite oracle."""
    if not oracle.is_floating_point():
        return None
    o = oracle.detach().to(torch.float64)
    if not torch.isfinite(o).all():
        return "oracle output has non-finite values"
    if o.numel() and not o.abs().max() > 0:
        return "oracle output is all zeros"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_floating_point():
        size = t.element_size()
        as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[size]
        return t.view(as_int)
    return t


def compare_bitwise(name: str, cand: torch.Tensor, base: torch.Tensor) -> Check:
    """Identical bits; NaNs compared as NaN whatever their payload."""
    b = base.detach()
    c = cand.detach().to(b.device)
    if c.is_floating_point():
        cn, bn = torch.isnan(c), torch.isnan(b)
        same = (_bits(c) == _bits(b)) | (cn & bn)
    else:
        same = c == b
    bad = int((~same).sum())
    if bad == 0:
        return Check(f"compare:{name}", True, "bitwise identical", {"mismatches": 0})
    diff = (~same).to(torch.float64)
    worst = _worst(c.to(torch.float64), b.to(torch.float64), None, diff, c.shape)
    return Check(f"compare:{name}", False, f"{bad} of {c.numel()} elements differ from the reference bits",
                 {"mismatches": bad}, worst)


def compare_derived(name: str, cand: torch.Tensor, oracle: torch.Tensor, base: torch.Tensor,
                    k: float, floor_ulps: float, baseline_err_rows: torch.Tensor | None = None,
                    row_ndim: int = 1, magnitude: torch.Tensor | None = None) -> Check:
    """Per row: |cand - oracle| <= k * E_row + floor_ulps * ulp(M_row), E_row = the baseline's max error
    in the row, or the tensor's median relative baseline error at the row's scale if larger; M_row =
    max |oracle| in the row, or the row's max running-error `magnitude` (OpDef.magnitudes) if larger."""
    dtype = base.dtype
    dev = oracle.device
    c, o, b = _rows(cand, row_ndim, dev), _rows(oracle, row_ndim, dev), _rows(base, row_ndim, dev)
    err_c = (c - o).abs()
    err_b_rows = (b - o).abs().amax(-1) if baseline_err_rows is None else baseline_err_rows.to(dev, torch.float64)
    scale = o.abs().amax(-1)
    # A row's baseline error is one draw of the reference's rounding noise and can be ~0 by luck; the
    # reference's error for a row is at least the tensor's typical (median) relative error at its scale.
    if err_b_rows.numel() > 1:
        typical = (err_b_rows / scale.clamp_min(torch.finfo(torch.float64).tiny)).median()
        err_b_rows = torch.maximum(err_b_rows, typical * scale)
    floor_scale = scale if magnitude is None else torch.maximum(scale, _rows(magnitude, row_ndim, dev).amax(-1))
    tol = k * err_b_rows + floor_ulps * ulp(floor_scale, dtype)
    nonfinite = ~torch.isfinite(c)
    row_err = torch.where(nonfinite, torch.full_like(c, float("inf")), err_c).amax(-1)
    ratio = row_err / tol.clamp_min(torch.finfo(torch.float64).tiny)
    rel = err_c / o.abs().clamp_min(torch.finfo(torch.float64).tiny)
    metrics = {
        "max_abs": float(err_c.max()) if err_c.numel() else 0.0,
        "max_rel": float(rel.max()) if rel.numel() else 0.0,
        "max_ulp": float((err_c / ulp(o.abs(), dtype)).max()) if err_c.numel() else 0.0,
        "rel_l2": float((c - o).norm() / o.norm().clamp_min(1e-300)),
        "baseline_max_abs": float(err_b_rows.max()) if err_b_rows.numel() else 0.0,
        "ratio": float(ratio.max()) if ratio.numel() else 0.0,     # worst err / tolerance; > 1 fails
    }
    ok = bool((ratio <= 1.0).all()) and not bool(nonfinite.any())
    if ok:
        return Check(f"compare:{name}", True, f"within tolerance (worst {metrics['ratio']:.3g} of it)", metrics)
    bad_rows = int((ratio > 1.0).sum())
    excess = torch.where(nonfinite, torch.full_like(c, float("inf")), err_c / tol[:, None].clamp_min(1e-300))
    worst = _worst(c, o, b, excess, tuple(cand.shape) if cand.dim() > 1 else (c.numel(),))
    detail = (f"{bad_rows} of {c.shape[0]} rows exceed k*baseline+floor (k={k}, floor={floor_ulps} ulp); "
              f"max abs err {metrics['max_abs']:.3g} vs baseline {metrics['baseline_max_abs']:.3g}")
    if nonfinite.any():
        detail = f"{int(nonfinite.sum())} non-finite values where the oracle is finite; " + detail
    return Check(f"compare:{name}", False, detail, metrics, worst)


def tie_band(scores64: torch.Tensor, scores_wd: torch.Tensor, kth: torch.Tensor,
             magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """Scores' own rounding error near the k-th place: 2x the working-precision error + 2 fp32 ulps,
    or 4 fp32 ulps of the row's largest running-error magnitude if larger (any summation order errs by
    ulps of a score's terms, which the one baseline draw can miss)."""
    err = (scores_wd.to(torch.float64) - scores64).abs().amax(-1)
    band = 2 * err + 2 * ulp(kth.abs(), torch.float32)
    if magnitude is not None:
        band = torch.maximum(band, 4 * ulp(magnitude.detach().cpu().to(torch.float64).amax(-1), torch.float32))
    return band


def compare_tie_aware_ids(name: str, ids: torch.Tensor, scores64: torch.Tensor, scores_wd: torch.Tensor,
                          k: int, magnitude: torch.Tensor | None = None) -> Check:
    """Selected sets must match wherever the k-th and (k+1)-th scores differ by more than the band."""
    ids = ids.detach().cpu().to(torch.int64)
    B, E = scores64.shape
    if ids.shape != (B, k):
        return Check(f"compare:{name}", False, f"ids shape {tuple(ids.shape)}, expected {(B, k)}")
    if ((ids < 0) | (ids >= E)).any():
        return Check(f"compare:{name}", False, f"ids outside [0, {E})")
    srt = scores64.sort(-1, descending=True).values
    kth, next_ = srt[:, k - 1], srt[:, k] if k < E else torch.full((B,), -float("inf"), dtype=torch.float64)
    band = tie_band(scores64, scores_wd, kth, magnitude)
    bad_rows, ties = [], 0
    for r in range(B):
        chosen = set(ids[r].tolist())
        if len(chosen) != k:
            bad_rows.append((r, "duplicate ids"))
            continue
        must = set(torch.nonzero(scores64[r] > next_[r] + band[r]).flatten().tolist())
        may = set(torch.nonzero(scores64[r] >= kth[r] - band[r]).flatten().tolist())
        ties += int(len(may) > k)
        if not must <= chosen:
            bad_rows.append((r, f"missing certain winners {sorted(must - chosen)[:4]}"))
        elif not chosen <= may:
            bad_rows.append((r, f"chose certain losers {sorted(chosen - may)[:4]}"))
        else:
            # Exact ties (identical scores in exact arithmetic, e.g. duplicated experts) tie in any
            # arithmetic: there the declared tie-break decides, lower id first.
            tied = torch.nonzero(scores64[r] == kth[r]).flatten().tolist()
            picked = [e for e in tied if e in chosen]
            if 0 < len(picked) < len(tied) and picked != tied[:len(picked)]:
                bad_rows.append((r, f"exact tie at the k-th score broken against the declared lower-id rule: "
                                    f"chose {picked[:4]} of tied {tied[:8]}"))
    metrics = {"rows": B, "rows_in_tie_band": ties, "bad_rows": len(bad_rows)}
    if not bad_rows:
        return Check(f"compare:{name}", True, f"sets match ({ties} rows inside the tie band)", metrics)
    r, why = bad_rows[0]
    return Check(f"compare:{name}", False, f"{len(bad_rows)} of {B} rows select a different set; row {r}: {why}",
                 metrics, ((r,), why, None, None))
