"""verify/model/values.py's distributions: small_rows (rows scaled by their own power of two into the regimes
where a normalisation's eps matters) and the dist sweep that makes every certification draw each of
an op's dists."""
from __future__ import annotations

import math

import pytest
import torch

from verify.model.case import Case
from verify.model.profile import PROFILES, Profile
from verify.plan.draw import dist_sweep_cases
from verify.ops.registry import get_op
from verify.model.values import DISTS, GENERIC_DISTS, SMALL_ROW_K, draw, generator, row_scales

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _row_k(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row of x, the k with x = ref * 2^-k (rows of a small_rows draw against the same normal draw)."""
    ratio = (x.double().abs().sum(-1) / ref.double().abs().sum(-1))
    return -torch.log2(ratio)


def test_small_rows_is_generic():
    assert "small_rows" in DISTS and "small_rows" in GENERIC_DISTS
    assert get_op("kda_decode").dists[:len(GENERIC_DISTS)] == GENERIC_DISTS
    assert "small_rows" in get_op("mla_qkv_a").dists and "small_rows" in get_op("attn_res_rmsnorm").dists


def test_small_rows_scales_whole_rows_by_powers_of_two():
    shape = (64, 3, 40)
    x = draw(generator(5, 1), shape, "small_rows", dtype=torch.float64)
    ref = torch.randn(shape, generator=generator(5, 1), dtype=torch.float64)   # the normal draw beneath
    k = _row_k(x.flatten(1), ref.flatten(1))
    assert torch.equal(k, k.round()), "each row is the normal draw times an exact power of two"
    for r in range(shape[0]):
        assert torch.equal(x[r], ref[r] * 2.0 ** -float(k[r].round()))
    lo, hi = SMALL_ROW_K
    ks = set(int(v) for v in k.round())
    assert ks <= {0} | set(range(lo, hi + 1))
    assert sum(v == 0 for v in k.round().tolist()) == 1, "exactly one ordinary row beside the small ones"
    assert min(ks - {0}) <= 5 and max(ks) >= 13, f"64 rows should span the range, got {sorted(ks)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_rows_norms_span_the_eps_regimes(dtype):
    """Row mean squares reach RMSNorm's eps (1e-5 / 1e-6) and below, and no row is zero (zero_rows'
    job), in every working dtype: fp16 makes the smallest rows partly subnormal, never all zero."""
    D = 256
    x = draw(generator(11), (400, D), "small_rows", dtype=dtype).double()
    ms = x.pow(2).mean(-1)
    assert bool((ms > 0).all()), "small_rows must not produce zero rows"
    assert bool(torch.isfinite(x).all())
    for eps in (1e-5, 1e-6):
        near = ((ms > eps / 10) & (ms < eps * 10)).sum()
        assert int(near) >= 20, f"only {int(near)} of 400 rows have mean x^2 within 10x of {eps}"
    assert float(ms.min()) < 1e-8 and float(ms.max()) > 1e-3
    if dtype == torch.float16:
        tiny = x[ms < 2.0 ** -26]                   # k = 13..14 rows
        assert tiny.numel() and bool((tiny.abs() < 2.0 ** -14).any()), "fp16's smallest rows hold subnormals"


def test_small_rows_reproducible_and_seeded():
    a = draw(generator(3, 9), (16, 32), "small_rows", dtype=torch.bfloat16)
    b = draw(generator(3, 9), (16, 32), "small_rows", dtype=torch.bfloat16)
    c = draw(generator(4, 9), (16, 32), "small_rows", dtype=torch.bfloat16)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_small_rows_edge_shapes():
    assert draw(generator(0), (0, 4), "small_rows").shape == (0, 4)
    one = draw(generator(0), (1, 8), "small_rows", dtype=torch.float64)
    k = _row_k(one, torch.randn((1, 8), generator=generator(0), dtype=torch.float64))
    assert SMALL_ROW_K[0] <= float(k[0]) <= SMALL_ROW_K[1], "a single row is always a small one"
    assert row_scales(generator(0), 0).numel() == 0


@pytest.mark.parametrize("config", ["tiny", "small"])
def test_kda_decode_small_rows_reach_l2_eps_after_the_conv(config):
    """kda_decode's small_rows case scales q/k/v and their conv window by one scale per (batch, head),
    so the L2 norm's sum k^2 after conv + SiLU lands near l2_eps = 1e-6 for some rows."""
    from references.primitives import silu
    op = get_op("kda_decode")
    inputs = op.make_inputs(Case("kda_decode", 7, 4, config, "bfloat16", "small_rows"))
    t = {n: v.double() for n, v in inputs.tensors.items()}
    B, H, _, Dh = t["state"].shape
    for i, name in ((0, "q_raw"), (1, "k_raw")):
        window = torch.cat([t["conv_state"][:, i], t[name].unsqueeze(-1)], dim=-1)
        x = silu((window * t["conv_w"][i]).sum(-1)).view(B, H, Dh)
        ss = x.pow(2).sum(-1)
        near = ((ss > 1e-7) & (ss < 1e-5)).sum()
        assert int(near) >= 5, f"{name}: only {int(near)} of {B * H} (b, h) rows have sum x^2 near 1e-6"
        assert float(ss.max()) > 1.0, "the ordinary row stays O(1)"
    # the rows line up: raw input and its window share the (b, h) scale
    per_bh = lambda v: v.abs().view(B, H, -1).amax(-1)
    ratio = per_bh(t["conv_state"][:, 1].reshape(B, -1)) / per_bh(t["k_raw"])
    assert float(ratio.log2().abs().max()) < 4, "conv window and raw input scaled together per (b, h)"
    other = op.make_inputs(Case("kda_decode", 7, 4, config, "bfloat16", "normal"))
    assert float(other.tensors["k_raw"].abs().amax()) > 0.5


def test_dist_sweep_lists_every_dist_whatever_the_draw_reached():
    op = get_op("kda_decode")
    cases = dist_sweep_cases(op, PROFILES["ci"], 0)
    assert [c.dist for c in cases] == list(op.dists)
    assert all(c.tp == 1 and c.batch == 8 for c in cases) and len({c.seed for c in cases}) == len(cases)
    assert dist_sweep_cases(op, PROFILES["quick"], 0) == []        # quick stays within its budget
    off = Profile("x", 4, ("tiny",), 16, False, False, True, dist_sweep=False)
    assert dist_sweep_cases(op, off, 0) == []
    assert math.isclose(len(dist_sweep_cases(op, PROFILES["release"], 0)), len(op.dists))


def test_zero_rows_hold_both_signed_zeros():
    """zero_rows' rows are +0.0 and -0.0 (a bitwise copy that canonicalises -0.0 must show), in every
    float dtype, and the other rows are untouched draws."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = draw(generator(3), (6, 64), "zero_rows", dtype=dtype)
        zero = (x == 0).all(1)
        assert zero.any() and not zero.all()
        z = x[zero]
        assert torch.signbit(z).any() and (~torch.signbit(z)).any(), dtype


def test_batch_sweep_hits_the_dispatch_boundaries():
    """Every profile but quick runs M = 1, 2, 3, each power of two and the one above, and the largest
    two, unsplit, at the profile's largest config; seeds apart from the other sweeps'."""
    from verify.plan.draw import batch_sweep_cases, sweep_batches
    assert sweep_batches(64) == [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 63, 64]
    assert sweep_batches(16) == [1, 2, 3, 4, 5, 6, 8, 9, 12, 15, 16] and sweep_batches(1) == [1]
    gemm = get_op("skinny_gemm")
    cases = batch_sweep_cases(gemm, PROFILES["release"], 0)
    assert [c.batch for c in cases] == sweep_batches(64)
    assert {(c.config, c.tp, c.dtype) for c in cases} == {("k3", 1, gemm.dtypes[0])}
    assert all(400 <= c.seed < 500 for c in cases)
    assert {c.config for c in batch_sweep_cases(gemm, PROFILES["ci"], 0)} == {"small"}
    assert batch_sweep_cases(gemm, PROFILES["quick"], 0) == []
    kda = get_op("kda_decode")                                  # capped by the op's own max batch
    assert max(c.batch for c in batch_sweep_cases(kda, PROFILES["release"], 0)) == min(kda.max_batch, 64)


@pytest.mark.parametrize("op_name,names", [
    ("router_topk", ("routed_scale",)), ("attn_res_rmsnorm", ("eps", "norm_eps")),
    ("kda_decode", ("lower_bound", "l2_eps", "norm_eps")), ("latent_norm_up", ("eps",)),
    ("mla_decode_attn", ("scale",)), ("shared_experts", ("situ_beta", "situ_linear_beta")),
    ("moe_experts_mxfp4", ("situ_beta", "situ_linear_beta"))])
def test_scalar_params_vary_over_seeds(op_name, names):
    """An op's scalar parameters are drawn per case (the config's value among others), each on its own,
    so a kernel that bakes one in or swaps two is wrong on some case; a knob pins one."""
    op = get_op(op_name)
    seen = {n: set() for n in names}
    pairs = set()
    for seed in range(40):
        p = op.make_inputs(Case(op_name, seed, 2, "tiny", op.dtypes[0], "normal")).params
        for n in names:
            seen[n].add(p[n])
        pairs.add(tuple(p[n] for n in names))
    assert all(len(v) >= 2 for v in seen.values()), seen
    if len(names) > 1:
        assert any(len(set(pr)) > 1 for pr in pairs)               # the two eps differ on some cases
    pinned = op.make_inputs(Case(op_name, 5, 2, "tiny", op.dtypes[0], "normal", 1, ((names[0], 0.25),))).params
    assert pinned[names[0]] == 0.25


def test_legal_edge_inputs_are_drawn():
    """Inputs a kernel may mishandle though they are legal: expert ids of -1 (padding; in some cases a
    whole row, never token 0's or the last token's slot 0) with weights summing to a drawn
    routed_scale; cache-write padding slots below -1; a layer's decode steps other than 3."""
    moe = get_op("moe_experts_mxfp4")
    cases = [moe.make_inputs(Case("moe_experts_mxfp4", s, 8, "tiny", "bfloat16", "normal")).tensors for s in range(12)]
    assert any((t["ids"] == -1).any() for t in cases)
    assert all((t["ids"][[0, -1], 0] >= 0).all() for t in cases)
    assert any((t["ids"] == -1).all(-1).any() for t in cases), "no case draws a whole padding row"
    sums = {round(float(t["weights"][0].sum()), 3) for t in cases}
    assert len(sums) >= 2 and 1.0 in sums
    cw = get_op("mla_cache_write")
    slots = torch.cat([cw.make_inputs(Case("mla_cache_write", s, 16, "tiny", "bfloat16", "normal")).tensors["slot_mapping"]
                       for s in range(8)])
    assert (slots == -1).any() and (slots < -1).any()
    from verify.ops.layers import _steps
    assert len({_steps(Case("kda_layer", s, 1, "tiny", "bfloat16", "normal")) for s in range(20)}) >= 3


# ---------------------------------------------------------------------------- range_edges, nonfinite


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_range_edges_rows_sit_past_fp16_range_for_wide_exponent_dtypes(dtype):
    """Rows are the normal draw times 2^0, 2^huge or 2^tiny, exact in the dtype; bf16 / fp32 rows pass
    fp16's largest finite value and fall below its smallest subnormal, fp16's stay finite and reach
    its subnormals."""
    from verify.model.values import RANGE_EDGE_K
    x = draw(generator(7, 3), (60, 64), "range_edges", dtype=dtype)
    ref = torch.randn((60, 64), generator=generator(7, 3), dtype=torch.float64)
    assert bool(torch.isfinite(x).all())
    k = (-_row_k(x.double(), ref)).round()
    (h0, h1), (t0, t1) = RANGE_EDGE_K["float16" if dtype == torch.float16 else "wide_exponent"]
    classes = {0 if v == 0 else 1 if h0 <= v <= h1 else 2 if t0 <= v <= t1 else -1 for v in k.tolist()}
    assert classes == {0, 1, 2}, sorted(set(k.tolist()))
    for r in range(3):                                   # any three consecutive rows hold all classes
        assert len({0 if v == 0 else 1 if v > 0 else 2 for v in k[r:r + 3].tolist()}) == 3
    big = x.double().abs().amax(-1)
    if dtype == torch.float16:
        assert float(big.max()) < 65504 and bool((x.double().abs() < 2.0 ** -14).any())
    else:
        assert float(big.max()) > 65504 and float(big.min()) < 2.0 ** -24


def test_range_edges_follow_range_dtype_for_fp64_draws():
    """A tensor drawn in fp64 for an fp16 case (kda's starting state) takes fp16's exponents."""
    x = draw(generator(1), (30, 16), "range_edges", dtype=torch.float64, range_dtype=torch.float16)
    assert float(x.abs().max()) < 65504


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_rows_share_classes_across_tensors(dtype):
    """nonfinite: rows classed from the case seed, the same for every tensor of the case; a finite row
    is finite in every tensor, a non-finite row holds at most one special per tensor, of its class, and
    some tensors of a row hold one while others do not (AttnRes-like several inputs)."""
    from verify.model.values import NONFINITE_SALT, row_classes
    B = 8
    cls = row_classes(generator(42, NONFINITE_SALT), B)
    assert (cls == 0).any() and (cls != 0).any()
    hits = torch.zeros(B, dtype=torch.long)
    for salt in range(12):
        x = draw(generator(42, salt), (B, 5, 7), "nonfinite", dtype=dtype, row_seed=42).double().flatten(1)
        special = ~torch.isfinite(x)
        assert int(special.sum(-1).max()) <= 1
        assert not special[cls == 0].any(), "a finite row got a special"
        assert special.any(), "each tensor holds a special in one row at least"
        for r in torch.nonzero(special.any(-1)).reshape(-1).tolist():
            v = x[r][special[r]][0]
            want = {1: "nan", 2: "+inf", 3: "-inf"}[int(cls[r])]
            got = "nan" if torch.isnan(v) else ("+inf" if v > 0 else "-inf")
            assert got == want
        hits += special.any(-1).long()
    broken = cls != 0
    assert bool((hits[broken] > 0).all()) and bool((hits[broken] < 12).any()), hits.tolist()


def test_nonfinite_single_row_is_always_nonfinite_and_edge_dists_always_swept():
    from verify.model.values import EDGE_DISTS, NONFINITE_SALT, row_classes
    assert all(int(row_classes(generator(s, NONFINITE_SALT), 1)[0]) != 0 for s in range(50))
    gemm = get_op("skinny_gemm")
    assert set(EDGE_DISTS) <= set(gemm.dists)
    swept = {c.dist for c in dist_sweep_cases(gemm, PROFILES["ci"], 0)}
    assert set(EDGE_DISTS) <= swept, "edge dists get their sweep case"
    assert not set(EDGE_DISTS) & set(get_op("router_topk").dists), "no declared choice over NaN scores"
