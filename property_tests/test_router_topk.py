"""What is special to router_topk: the declared selection order (descending choice score, lower id
first on ties) against a brute-force full sort, and the renormalised weights."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.moe import router_choice_scores, router_topk
from verify.case import Case
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
