"""What is special to router_topk: the declared selection order (descending choice score, lower id
first on ties) against a brute-force full sort, and the renormalised weights."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.moe import router_choice_scores, router_topk
from verify.model.case import Case
from verify.ops.moe import OPS

ROUTER = next(op for op in OPS if op.name == "router_topk")



def brute_force_ids(choice: torch.Tensor, k: int) -> list[list[int]]:
    rows = choice.tolist()
    return [sorted(range(len(r)), key=lambda e: (-r[e], e))[:k] for r in rows]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), E=st.integers(2, 24), data=st.data(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]))
def test_ids_match_a_full_sort_with_lower_id_first(seed, B, E, data, dtype):
    k = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(seed)
    # few distinct gate rows and biases: many exact ties in the choice scores
    rows = torch.randn(3, 16, generator=g)
    w_gate = rows[torch.randint(0, 3, (E,), generator=g)].to(dtype)
    bias = (torch.randint(0, 2, (E,), generator=g) * 0.25).float()
    x = torch.randn(B, 16, generator=g).to(dtype)
    ids, weights = router_topk(x, w_gate, bias, k, 1.0)
    _, choice = router_choice_scores(x, w_gate, bias)
    assert ids.tolist() == brute_force_ids(choice, k)
    assert ids.dtype == torch.int64


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1.0, 2.5]))
def test_weights_are_unbiased_scores_renormalised(seed, scale):
    g = torch.Generator().manual_seed(seed)
    x, w_gate = torch.randn(4, 32, generator=g, dtype=torch.float64), torch.randn(20, 32, generator=g, dtype=torch.float64)
    bias = torch.randn(20, generator=g, dtype=torch.float64)
    ids, weights = router_topk(x, w_gate, bias, 6, scale)
    s = torch.sigmoid(x @ w_gate.T).gather(1, ids)
    torch.testing.assert_close(weights, s / s.sum(-1, keepdim=True) * scale, rtol=1e-14, atol=0)
    torch.testing.assert_close(weights.sum(-1), torch.full((4,), scale, dtype=torch.float64))


def test_weights_are_fp32_for_low_precision_inputs():
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    _, weights = router_topk(x, w, torch.zeros(8), 3, 1.0)
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("config", ["tiny", "small"])
def test_near_ties_put_a_tie_at_the_kth_place(seed, config):
    inputs = ROUTER.make_inputs(Case("router_topk", seed, 5, config, "bfloat16", "near_ties"))
    k = inputs.params["top_k"]
    scores = ROUTER.tie_scores(inputs)
    top = scores.sort(-1, descending=True).values
    gap = top[:, k - 1] - top[:, k]
    assert bool((gap.abs() < 1e-3).all()), gap          # ties, 1-ulp bias ties, 1-ulp weight close calls
    ids, _ = router_topk(**inputs.tensors, **inputs.params)
    _, choice = router_choice_scores(inputs.tensors["x"], inputs.tensors["w_gate"], inputs.tensors["bias"])
    assert ids.tolist() == brute_force_ids(choice, k)


def test_inputs_rebuild_bit_for_bit():
    case = Case("router_topk", 11, 3, "tiny", "bfloat16", "near_ties")
    a, b = ROUTER.make_inputs(case), ROUTER.make_inputs(case)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors) and a.params == b.params


@pytest.mark.parametrize("change, error, arg", [
    ({"top_k": 9}, ValueError, "top_k"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"bias": torch.zeros(7)}, ValueError, "bias"),
    ({"w_gate": torch.zeros(8, 15)}, ValueError, "w_gate"),
    ({"x": torch.zeros(2, 16, dtype=torch.int64)}, TypeError, "x"),
])
def test_bad_input_names_the_argument(change, error, arg):
    args = dict(x=torch.zeros(2, 16), w_gate=torch.zeros(8, 16), bias=torch.zeros(8), top_k=2, routed_scale=1.0)
    with pytest.raises(error, match=f"^{arg}"):
        router_topk(**{**args, **change})


# ----------------------------------------------------------------------------------------------
# weights' running-error magnitude (verify.ops.moe.router_weights_magnitude)


@pytest.mark.parametrize("dist", ["normal", "wide_range", "heavy_tailed"])
def test_any_fp32_order_of_the_logits_errs_by_ulps_of_the_terms(dist):
    """The derivation's premise: an fp32 logit in any summation order is within 2 u sum|x w| of the
    exact one (u = 2^-24), where the same error can be many ulps of a cancelling logit."""
    op = next(o for o in OPS if o.name == "router_topk")
    for seed in range(6):
        t = op.make_inputs(Case("router_topk", seed, 16, "k3", "bfloat16", dist, 1)).tensors
        x, w = t["x"], t["w_gate"][:256]
        exact = x.double() @ w.double().T
        unit = 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
        chunks = [x[:, i:i + 896].float() @ w[:, i:i + 896].float().T for i in range(0, x.shape[1], 896)]
        folded = chunks[0]
        for c in chunks[1:]:
            folded = folded + c
        for logit in (x.float() @ w.float().T, folded, (x.float().flip(-1) @ w.float().flip(-1).T)):
            assert float(((logit.double() - exact).abs() / unit).max()) <= 2.0


def test_weights_magnitude_bounds_the_weights_and_scales_a_cancelling_row():
    from verify.judge.compare import compare_derived
    from verify.ops.moe import router_weights_magnitude

    op = next(o for o in OPS if o.name == "router_topk")
    inputs = op.make_inputs(Case("router_topk", 3, 8, "small", "float32", "wide_range", 1))
    i64 = type(inputs)({n: v.double() if v.is_floating_point() else v for n, v in inputs.tensors.items()},
                       inputs.params)
    ids, w64 = router_topk(**i64.tensors, **i64.params)
    _, w32 = router_topk(**inputs.tensors, **inputs.params)
    m = router_weights_magnitude(i64, {"ids": ids})["weights"]
    assert (m >= w64.abs()).all() and m.shape == w64.shape
    # a candidate off by one u*m everywhere passes; off by 64 u*m (a bf16 logit on a typical row) fails
    u = 2.0 ** -24
    near = (w64 + u * m).float()
    assert compare_derived("weights", near, w64, w32, 4.0, 4.0, magnitude=m).ok
    far = (w64 + 64 * u * m).float()
    assert not compare_derived("weights", far, w64, w32, 4.0, 4.0, magnitude=m).ok


# ----------------------------------------------------------------------------------------------
# weights of ids that failed the ids check (verify.judge.pipeline.judge)


def lowest_ids_right_weights(x, w_gate, bias, top_k: int, routed_scale: float):
    """Selects the k LOWEST choice scores, then renormalises its own picks' scores exactly as the
    reference would: wrong ids, right weights for them."""
    from references.moe import renormalise

    s, choice = router_choice_scores(x, w_gate, bias)
    ids = torch.sort(choice, dim=-1, descending=False, stable=True).indices[:, :top_k].contiguous()
    return ids, renormalise(s, ids, routed_scale)


def one_id_out_of_range(x, w_gate, bias, top_k: int, routed_scale: float):
    """The reference's result with one id past the last expert."""
    ids, weights = router_topk(x, w_gate, bias, top_k, routed_scale)
    ids[1, 0] = w_gate.shape[0] + 3
    return ids, weights


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weights_of_failed_ids_are_judged_at_the_candidates_ids(dtype):
    """Weights right for the candidate's own wrong ids fail nothing but the ids: the weights check
    is not reported ~1e5x over tolerance against the reference's weights for other experts."""
    from verify.judge.pipeline import evaluate_case
    from verify.model.specs import load_spec

    case = Case("router_topk", 5, 6, "tiny", dtype, "normal")
    v = evaluate_case(ROUTER, case, lowest_ids_right_weights, "user.module:fn", spec=load_spec("router_topk"))
    assert v.status == "fail" and v.stage == "compare:ids", (v.stage, v.reason)
    weights = next(c for c in v.checks if c.name == "compare:weights")
    assert weights.ok and weights.metrics["ratio"] <= 1.0, weights
    assert "judged at the candidate's ids, which failed the ids check" in weights.detail


def test_weights_of_malformed_ids_fail_unjudged():
    from verify.judge.pipeline import evaluate_case
    from verify.model.specs import load_spec

    case = Case("router_topk", 5, 6, "tiny", "float32", "normal")
    v = evaluate_case(ROUTER, case, one_id_out_of_range, "user.module:fn", spec=load_spec("router_topk"))
    assert v.status == "fail" and v.stage == "compare:ids", (v.stage, v.reason)
    weights = next(c for c in v.checks if c.name == "compare:weights")
    assert not weights.ok and "ratio" not in weights.metrics and "\n" not in weights.detail
    assert weights.detail.startswith("not judged: the candidate's ids are malformed (1 ids outside [0, "), weights
    assert "row 1 slot 0" in weights.detail


@pytest.mark.parametrize("ids, why", [
    (torch.tensor([[0, 1], [2, 3]], dtype=torch.float32), "dtype torch.float32, not an integer dtype"),
    (torch.tensor([[0, 1, 2]]), "shape (1, 3), expected (2, 2)"),
    (torch.tensor([[0, 1], [-1, 3]]), "1 ids outside [0, 4), first at row 1 slot 0: -1"),
    (torch.tensor([[0, 1], [3, 3]]), "1 rows name an id twice, first row 1: [3, 3]"),
    (torch.tensor([[0, 1], [3, 2]]), None),
])
def test_malformed_ids_says_why(ids, why):
    from verify.judge.compare import malformed_ids

    assert malformed_ids(ids, (2, 2), 4) == why
