"""Comparison by exactness class (shared/OPS.md): bitwise, derived against an fp64 oracle, tie-aware ids."""
from __future__ import annotations

import math

import torch

from verify.model.verdict import Check

_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
_MIN_EXP = {torch.float64: -1022, torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}
N_WORST = 5


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at `magnitude` (float64 tensor), subnormals included."""
    mant = _MANTISSA.get(dtype, 23)
    exp = torch.floor(torch.log2(magnitude.clamp_min(2.0 ** _MIN_EXP.get(dtype, -126))))
    return torch.exp2(exp.clamp_min(_MIN_EXP.get(dtype, -126)) - mant)


def baseline_error(base_rows: torch.Tensor, oracle_rows: torch.Tensor) -> torch.Tensor:
    """|base - oracle| where both are finite, else 0: a non-finite element (the reference overflowed,
    or a NaN row) is no witness of rounding noise. Used unsplit (compare_derived) and split (split.py)."""
    both = torch.isfinite(base_rows) & torch.isfinite(oracle_rows)
    return torch.where(both, (base_rows - oracle_rows).abs(), torch.zeros_like(oracle_rows))


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
    """A derived comparison proves nothing where the oracle has no finite non-zero value. (Non-finite
    oracle elements, e.g. an MXFP4 block under scale byte 0xFF, are judged where they are: the
    candidate must give the same NaN or infinity; the rest of the tensor is judged as usual.)"""
    if not oracle.is_floating_point():
        return None
    o = oracle.detach().to(torch.float64)
    finite = torch.isfinite(o)
    if o.numel() and not finite.any():
        return "oracle output has no finite values"
    if o.numel() and not o[finite].abs().max() > 0:
        return "oracle output is all zeros" if finite.all() else "oracle output is zero wherever it is finite"
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
    worst = _worst(c.to(torch.float64), b.to(torch.float64), None, diff, c.shape)[:bad]   # differing ones only
    return Check(f"compare:{name}", False, f"{bad} of {c.numel()} elements differ from the reference bits",
                 {"mismatches": bad}, worst)


def _median(t: torch.Tensor) -> torch.Tensor:
    """Median of the finite values of t (0 if there are none)."""
    return _quantile(t, 0.5)


def _quantile(t: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile (lower) of the finite values of t (0 if there are none); kthvalue, as
    torch.quantile refuses tensors over 2^24 elements."""
    t = t[torch.isfinite(t)]
    if not t.numel():
        return torch.zeros((), dtype=t.dtype, device=t.device)
    return t.kthvalue(max(1, math.ceil(q * t.numel()))).values       # q = 0.5: torch.median's (lower) median


ELEMENT_QUANTILE = 0.9     # an element's baseline error, one draw often near 0, is at least this quantile
                           # of the tensor's relative errors (the row rule's max over a row, per element)


def compare_derived(name: str, cand: torch.Tensor, oracle: torch.Tensor, base: torch.Tensor,
                    k: float, floor_ulps: float, baseline_err_rows: torch.Tensor | None = None,
                    row_ndim: int = 1, magnitude: torch.Tensor | None = None,
                    element_floor: float | None = None) -> Check:
    """Per row: |cand - oracle| <= k * E_row + floor_ulps * ulp(M_row), E_row = the baseline's max error
    in the row, or the tensor's median relative baseline error at the row's scale if larger; M_row =
    max |oracle| in the row, or the row's max running-error `magnitude` (OpDef.magnitudes) if larger.

    element_floor (rho, the spec's claim that an element errs on its own scale down to rho x its row's):
    also, for every element, |cand_i - oracle_i| <= k * e_i + floor_ulps * ulp(s_i), s_i = max(|oracle_i|,
    magnitude_i, rho * S_row), S_row the row's floor scale above, e_i = the baseline's error at i, or the
    ELEMENT_QUANTILE of the tensor's relative baseline errors at s_i if larger. The row rule alone lets an element far
    below its row's maximum be zeroed or negated.

    Non-finite values: where the oracle is NaN or infinite the candidate must give the same (NaN, or the
    infinity of the same sign); where the oracle is finite but beyond the working dtype's range, the
    infinity it rounds to is accepted. A baseline element that is non-finite where the oracle is not
    (the reference overflowed) is no witness of rounding noise: it is left out of E, which then falls
    back to the median rule, never to an infinite tolerance."""
    dtype = base.dtype
    dev = oracle.device
    tiny = torch.finfo(torch.float64).tiny
    c, o, b = _rows(cand, row_ndim, dev), _rows(oracle, row_ndim, dev), _rows(base, row_ndim, dev)
    fin_o = torch.isfinite(o)
    o0 = torch.where(fin_o, o, torch.zeros_like(o))
    # the oracle's own non-finite values must be reproduced; the wd's infinity where the oracle overflows it
    same_special = (torch.isnan(o) & torch.isnan(c)) | (~fin_o & (c == o))
    o_wd = o0.to(dtype) if dtype in _MANTISSA else o0
    rounds_to_inf = fin_o & ~torch.isfinite(o_wd) & (c == o_wd.to(torch.float64))
    bad = (~fin_o & ~same_special) | (fin_o & ~torch.isfinite(c) & ~rounds_to_inf)
    err_c = torch.where(fin_o & ~rounds_to_inf & torch.isfinite(c), (c - o0).abs(), torch.zeros_like(o0))
    err_b = baseline_error(b, o)
    if baseline_err_rows is None:
        err_b_rows = err_b.amax(-1)
    else:
        err_b_rows = baseline_err_rows.to(dev, torch.float64)
        err_b_rows = torch.where(torch.isfinite(err_b_rows), err_b_rows, torch.zeros_like(err_b_rows))
    scale = o0.abs().amax(-1)
    # A row's baseline error is one draw of the reference's rounding noise and can be ~0 by luck; the
    # reference's error for a row is at least the tensor's typical (median) relative error at its scale.
    if err_b_rows.numel() > 1:
        typical = _median(torch.where(scale > 0, err_b_rows / scale.clamp_min(tiny), torch.nan))
        err_b_rows = torch.maximum(err_b_rows, typical * scale)
    mag = None
    if magnitude is not None:
        mag = _rows(magnitude, row_ndim, dev).abs()
        mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
    floor_scale = scale if mag is None else torch.maximum(scale, mag.amax(-1))
    tol = k * err_b_rows + floor_ulps * ulp(floor_scale, dtype)
    excess = err_c / tol[:, None].clamp_min(1e-300)
    if element_floor is not None:
        m = o0.abs() if mag is None else torch.maximum(o0.abs(), mag)
        m = torch.maximum(m, element_floor * floor_scale[:, None])
        typical_e = (_quantile(torch.where(m > 0, err_b / m.clamp_min(tiny), torch.nan), ELEMENT_QUANTILE)
                     if m.numel() > 1 else 0.0)
        tol_e = k * torch.maximum(err_b, typical_e * m) + floor_ulps * ulp(m, dtype)
        excess = torch.maximum(excess, err_c / tol_e.clamp_min(1e-300))
    excess = torch.where(bad, torch.full_like(excess, float("inf")), excess)
    ratio = excess.amax(-1) if excess.numel() else excess.sum(-1)
    rel = err_c / o0.abs().clamp_min(tiny)
    metrics = {
        "max_abs": float(err_c.max()) if err_c.numel() else 0.0,
        "max_rel": float(rel.max()) if rel.numel() else 0.0,
        "max_ulp": float((err_c / ulp(o0.abs(), dtype)).max()) if err_c.numel() else 0.0,
        "rel_l2": float((torch.where(fin_o, c, o0) - o0).nan_to_num(posinf=0.0, neginf=0.0).norm()
                        / o0.norm().clamp_min(1e-300)),
        "baseline_max_abs": float(err_b_rows.max()) if err_b_rows.numel() else 0.0,
        "ratio": float(ratio.max()) if ratio.numel() else 0.0,     # worst err / tolerance; > 1 fails
    }
    ok = bool((ratio <= 1.0).all())
    if ok:
        return Check(f"compare:{name}", True, f"within tolerance (worst {metrics['ratio']:.3g} of it)", metrics)
    bad_rows = int((ratio > 1.0).sum())
    worst = _worst(c, o, b, excess, tuple(cand.shape) if cand.dim() > 1 else (c.numel(),))
    rule = "k*baseline+floor" + ("" if element_floor is None else f" per row and per element (element floor {element_floor:g} of the row)")
    detail = (f"{bad_rows} of {c.shape[0]} rows exceed {rule} (k={k}, floor={floor_ulps} ulp); "
              f"max abs err {metrics['max_abs']:.3g} vs baseline {metrics['baseline_max_abs']:.3g}")
    n_nonfinite = int((bad & fin_o).sum())
    if n_nonfinite:
        detail = f"{n_nonfinite} non-finite values where the oracle is finite; " + detail
    n_special = int((bad & ~fin_o).sum())
    if n_special:
        detail = f"{n_special} values differ where the oracle is NaN or infinite; " + detail
    return Check(f"compare:{name}", False, detail, metrics, worst)


def tie_band(scores64: torch.Tensor, scores_wd: torch.Tensor, kth: torch.Tensor,
             magnitude: torch.Tensor | None = None, score_k: float = 1.0) -> torch.Tensor:
    """Scores' own rounding error near the k-th place: 2 score_k x the working-precision error (a
    winner's and a loser's score each err by up to score_k x the baseline's) + 2 fp32 ulps, or 4 fp32
    ulps of the row's largest running-error magnitude if larger (any summation order errs by ulps of a
    score's terms, which the one baseline draw can miss)."""
    err = (scores_wd.to(torch.float64) - scores64).abs().amax(-1)
    band = 2 * score_k * err + 2 * ulp(kth.abs(), torch.float32)
    if magnitude is not None:
        band = torch.maximum(band, 4 * ulp(magnitude.detach().cpu().to(torch.float64).amax(-1), torch.float32))
    return band


def malformed_ids(ids: torch.Tensor, shape: tuple, n_choices: int) -> str | None:
    """Why `ids` name no selection that outputs could be recomputed for (an integer tensor of `shape`,
    every id in [0, n_choices), no id twice in a row), or None where they do."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        return f"dtype {ids.dtype}, not an integer dtype"
    if tuple(ids.shape) != tuple(shape):
        return f"shape {tuple(ids.shape)}, expected {tuple(shape)}"
    if ids.numel() == 0:
        return None
    ids = ids.detach().cpu().to(torch.int64).reshape(-1, shape[-1] if shape else 1)
    outside = (ids < 0) | (ids >= n_choices)
    if outside.any():
        r, i = (int(v) for v in torch.nonzero(outside)[0])
        return f"{int(outside.sum())} ids outside [0, {n_choices}), first at row {r} slot {i}: {int(ids[r, i])}"
    srt = ids.sort(-1).values
    twice = (srt[:, 1:] == srt[:, :-1]).any(-1)
    if twice.any():
        r = int(torch.nonzero(twice)[0])
        return f"{int(twice.sum())} rows name an id twice, first row {r}: {ids[r].tolist()[:8]}"
    return None


def _out_of_order(row: list[int], scores: torch.Tensor, band: float) -> str:
    """Why a row's ids are not in the declared order ('' when they are): a later slot's score above an
    earlier one's by more than the band, or equal scores with the higher id first."""
    for j in range(len(row) - 1):
        a, b = float(scores[row[j]]), float(scores[row[j + 1]])
        if b > a + band or (a == b and row[j] > row[j + 1]):
            return (f"ids out of the declared order (descending score, equal scores lower id first): slot {j} holds "
                    f"expert {row[j]} (score {a:.6g}), slot {j + 1} expert {row[j + 1]} (score {b:.6g})")
    return ""


def compare_tie_aware_ids(name: str, ids: torch.Tensor, scores64: torch.Tensor, scores_wd: torch.Tensor,
                          k: int, magnitude: torch.Tensor | None = None, score_k: float = 1.0) -> Check:
    """Selected sets must match wherever the k-th and (k+1)-th scores differ by more than the band, and
    each row lists its ids in the declared order: descending score (the MoE combine sums in slot
    order), two slots swapped only where their scores lie within the band of each other, and equal
    scores in exact arithmetic ordered lower id first. ids[..., k] and scores[..., E] share their
    leading dims (a layer's [steps, batch]): each leading index is one selection, reported by its index."""
    ids = ids.detach().cpu()
    lead, E = tuple(scores64.shape[:-1]), scores64.shape[-1]
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        return Check(f"compare:{name}", False, f"ids dtype {ids.dtype}, not an integer dtype")
    if tuple(ids.shape) != lead + (k,):
        return Check(f"compare:{name}", False, f"ids shape {tuple(ids.shape)}, expected {lead + (k,)}")
    if k == 0:
        return Check(f"compare:{name}", True, "no ids to judge (k = 0)", {"rows": math.prod(lead)})
    ids = ids.to(torch.int64).reshape(-1, k)
    scores64 = scores64.detach().cpu().to(torch.float64).reshape(-1, E)
    scores_wd = scores_wd.detach().cpu().reshape(-1, E)
    if magnitude is not None:
        magnitude = magnitude.detach().cpu().reshape(-1, E)
    B = scores64.shape[0]
    if ((ids < 0) | (ids >= E)).any():
        return Check(f"compare:{name}", False, f"ids outside [0, {E})")
    srt = scores64.sort(-1, descending=True).values
    kth, next_ = srt[:, k - 1], srt[:, k] if k < E else torch.full((B,), -float("inf"), dtype=torch.float64)
    band = tie_band(scores64, scores_wd, kth, magnitude, score_k)
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
            else:
                why = _out_of_order(ids[r].tolist(), scores64[r], float(band[r]))
                if why:
                    bad_rows.append((r, why))
    metrics = {"rows": B, "rows_in_tie_band": ties, "bad_rows": len(bad_rows)}
    if not bad_rows:
        return Check(f"compare:{name}", True, f"sets match ({ties} rows inside the tie band)", metrics)
    r, why = bad_rows[0]
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(r), lead)) if len(lead) > 1 else (r,)
    where = f"row {r}" if len(lead) == 1 else f"row {at}"
    return Check(f"compare:{name}", False, f"{len(bad_rows)} of {B} rows select a different set; {where}: {why}",
                 metrics, (at, why, None, None))
