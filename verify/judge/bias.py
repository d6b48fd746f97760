"""Systematic error inside the tolerance: a sign test of the candidate's signed errors against the
baseline's, per case and across the cases of an op/candidate pair.

The per-element rule (verify/compare.py) bounds |cand - oracle| by k x the baseline's error + a floor.
A kernel biased well inside that bound passes it: every output 1 % too large (a softmax denominator
missing one of ~100 positions), or truncation where the reference rounds to nearest (half an ulp,
always toward zero). Such a kernel is wrong in a way that adds up across layers and decode steps.

The statistic, calibrated on the baseline (the reference in the working dtype, against the same fp64
oracle). For each element, the candidate's signed error oriented by the oracle's sign,
r_c = sign(o) (c - o), against the baseline's, r_b = sign(o) (b - o); their difference is
d = sign(o) (c - b). Under the null (the candidate's signed errors are distributed like the
baseline's: another summation order, fewer or other roundings to nearest) d is as often positive as
negative. Elements of one row share inputs (a softmax's p, a norm's rsqrt, a GEMM row's x), so their
errors are correlated and are not independent trials; the unit is therefore a judged row (the
comparison's row: OpDef.row_ndims), whose value is the mean of d over its elements in ulps of the
working dtype at the oracle (d / ulp(o), clamped to +-CLAMP_ULPS: an element whose oracle cancels to
near zero has a huge d / ulp either way and must not outweigh its row). Rows of distinct tokens, heads and cases are independent
draws. A two-sided binomial test on the signs of the row means (scipy.stats.binomtest, p = 1/2), over
a case and over every case of the pair, rejects at ALPHA when the mean over the rows is also at
least MIN_EFFECT_ULPS away from zero.

ALPHA = 1e-7: a release certification makes about 20 ops x 2 candidates x 300 cases x 2 outputs,
~2.4e4 per-case tests plus the per-pair totals; by Bonferroni the chance that a correct kernel fails
on any of them by chance is at most ~2.4e4 x 1e-7 = 0.24 %. A case needs >= 25 nonzero rows, all of
one sign, to reject alone (2 x 2^-25 = 6e-8); smaller cases count in the pair's total.
MIN_EFFECT_ULPS = 0.25: with ~1e4 rows the sign test alone resolves biases far below any worth a
verdict, and a legitimate design can carry one: FlashMLA's P rounded to bf16 before P @ V rounds
p ~ 0.999 up to 1 in near one-hot rows, measured +0.11 ulp (60 % of the rows above) on
mla_decode_attn's range_edges draws (2026-12-03, property_tests/legit.py "p_rounded"). Truncation
where the reference rounds to nearest is -0.5 ulp, an output 0.4 % high +0.73 ulp in bf16 (measured
on skinny_gemm, property_tests/planted/bias.py); a quarter ulp sits between with a factor >= 2 each way.
For fp32 outputs the unit is the spec's floor in ulps (unit_ulps), not one ulp: their error is the
accumulation's, not a final rounding.
Measured (property_tests/test_bias.py): every evaluation of property_tests/legit.py (other orders,
fewer roundings, torch's SDPA, split-KV, P rounded) passes; the planted biased GEMMs are rejected.
"""
from __future__ import annotations

import torch

from verify.model.verdict import FAIL, PASS, CaseVerdict, Check

ALPHA = 1e-7
MIN_EFFECT_ULPS = 0.25
CLAMP_ULPS = 1.0
_MANTISSA = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}


def row_signs(cand: torch.Tensor, oracle: torch.Tensor, base: torch.Tensor, row_ndim: int = 1,
              unit_ulps: float = 1.0) -> tuple[int, int, float]:
    """(rows whose mean d / ulp(o) is above zero, rows below, the sum of the row means in ulps), over
    each row's elements where all three are finite and the oracle nonzero; rows without a difference
    count in neither (their mean, 0, in the sum)."""
    from verify.judge.compare import _rows

    dev = oracle.device
    c, o, b = _rows(cand, row_ndim, dev), _rows(oracle, row_ndim, dev), _rows(base, row_ndim, dev)
    ok = torch.isfinite(c) & torch.isfinite(o) & torch.isfinite(b) & (o != 0)
    o1 = torch.where(ok, o, torch.ones_like(o))
    ulp = unit_ulps * torch.pow(2.0, torch.floor(torch.log2(o1.abs())) - (_MANTISSA.get(base.dtype, 24) - 1))
    d = torch.where(ok, torch.sign(o1) * (torch.where(ok, c, o1) - torch.where(ok, b, o1)) / ulp, torch.zeros_like(o))
    d = d.clamp(-CLAMP_ULPS, CLAMP_ULPS)     # a cancelling element (tiny |o|, huge d / ulp) weighs as one ulp
    means = d.sum(-1) / ok.sum(-1).clamp_min(1)
    return int((means > 0).sum()), int((means < 0).sum()), float(means.sum())


def verdict_of(pos: int, neg: int, mean_ulps: float) -> tuple[bool, float]:
    """(ok, p-value) of a two-sided sign test on row counts, failing only at a mean bias of at least
    MIN_EFFECT_ULPS."""
    from scipy.stats import binomtest

    n = pos + neg
    if n == 0:
        return True, 1.0
    p = binomtest(pos, n, 0.5).pvalue
    return not (p < ALPHA and abs(mean_ulps) >= MIN_EFFECT_ULPS), p


def _detail(where: str, pos: int, neg: int, p: float, mean_ulps: float) -> str:
    n = pos + neg
    side = "above" if pos > neg else "below"
    return (f"{where}: the signed errors are biased: {max(pos, neg)} of {n} rows err {side} the baseline's "
            f"(oriented by the oracle's sign), by {mean_ulps:+.2f} ulp on average; p = {p:.2g} < {ALPHA:g} in a "
            f"two-sided sign test and |bias| >= {MIN_EFFECT_ULPS} ulp, though every element may be inside the "
            "tolerance")


def unit_ulps(out_spec, dtype: torch.dtype) -> float:
    """The bias's unit in ulps of the working dtype: one ulp for 16-bit outputs (whose error is the final
    rounding); for fp32 outputs the spec's floor (their error is the accumulation's, tens of ulps
    between legitimate orders, and a GPU's approximate exp2 moves every element by an ulp or two)."""
    return max(1.0, out_spec.bounds(dtype)[1]) if dtype in (torch.float32, torch.float64) else 1.0


def _rows_of(t: torch.Tensor, row_ndim: int) -> int:
    n = 1
    for size in t.shape[:-row_ndim] if t.dim() > row_ndim else ():
        n *= size
    return n


def case_checks(op, spec, cand: dict, oracle: dict, base: dict) -> list[Check]:
    """One `bias:<output>` check per derived output of a case (not for ops judged at the candidate's
    ids, whose baseline is recomputed for them)."""
    if op.reweigh is not None:
        return []
    checks = []
    for name in op.outputs + op.state:
        if spec.output(name).klass != "derived" or name not in cand:
            continue
        pos, neg, total = row_signs(cand[name], oracle[name], base[name], op.row_ndims.get(name, 1),
                                    unit_ulps(spec.output(name), base[name].dtype))
        rows = max(1, _rows_of(cand[name], op.row_ndims.get(name, 1)))
        ok, p = verdict_of(pos, neg, total / rows)
        checks.append(Check(f"bias:{name}", ok, "no bias against the baseline's signed errors" if ok
                            else _detail("in this case", pos, neg, p, total / rows),
                            {"rows_above": pos, "rows_below": neg, "rows": rows, "ulps_sum": total, "p": p}))
    return checks


def pair_failure(op_name: str, label: str, seen) -> CaseVerdict | None:
    """The pair's verdict on its cases together: the row counts and ulp sums of every passing case's
    bias checks summed per output. A failure names the case that leans the most."""
    totals: dict[str, list[float]] = {}
    lean: dict[str, tuple[float, str]] = {}
    for v in seen:
        if v.status != PASS:
            continue
        for c in v.checks:
            m = c.metrics
            if c.name.startswith("bias:") and "rows_above" in m:
                t = totals.setdefault(c.name, [0, 0, 0, 0.0])
                t[0] += m["rows_above"]
                t[1] += m["rows_below"]
                t[2] += m.get("rows", 0)
                t[3] += m.get("ulps_sum", 0.0)
                if abs(m.get("ulps_sum", 0.0)) > abs(lean.get(c.name, (0.0, ""))[0]):
                    lean[c.name] = (m.get("ulps_sum", 0.0), v.case)
    for name, (pos, neg, rows, total) in totals.items():
        mean = total / max(1, rows)
        ok, p = verdict_of(int(pos), int(neg), mean)
        if not ok:
            cases = sum(1 for v in seen if v.status == PASS)
            detail = _detail(f"over the pair's {cases} passing cases", int(pos), int(neg), p, mean)
            return CaseVerdict(op_name, label, lean.get(name, (0.0, ""))[1], FAIL, name, detail,
                               (Check(name, False, detail, {"rows_above": pos, "rows_below": neg, "rows": rows,
                                                            "ulps_sum": total, "p": p}),))
    return None
