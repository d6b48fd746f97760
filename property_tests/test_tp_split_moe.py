"""TP/EP splits of the MoE ops against the unsplit reference, in float64, T in 1..16."""
from __future__ import annotations

import pytest
import torch

from references.moe import (moe_tp_shard_width, renormalise, router_choice_scores, router_topk,
                            router_topk_scores_split)
from verify.model.case import Case
from verify.ops.common_splits import split_mismatches
from verify.ops.moe import OPS
from verify.ops.moe_splits import MOE_EXPERTS_EP_SPLIT, shard_moe_intermediate, shard_shared_experts

TP_VALUES = (1, 2, 4, 8, 16)
BY_NAME = {op.name: op for op in OPS}
SPLIT_OPS = sorted(n for n, op in BY_NAME.items() if op.split is not None)



@pytest.mark.parametrize("T", TP_VALUES)
@pytest.mark.parametrize("name", SPLIT_OPS)
def test_registered_split_equals_unsplit_in_float64(name, T):
    op = BY_NAME[name]
    inputs = op.make_inputs(Case(name, T, 3, "tiny", "float64", op.dists[-1], tp=T))
    assert split_mismatches(op, inputs, T) == []


@pytest.mark.parametrize("T", TP_VALUES)
def test_expert_parallel_split_equals_unsplit(T):
    op = BY_NAME["moe_experts_mxfp4"]
    inputs = op.make_inputs(Case(op.name, 40 + T, 4, "tiny", "float64", tp=T))
    assert split_mismatches(op, inputs, T, split=MOE_EXPERTS_EP_SPLIT) == []


@pytest.mark.parametrize("T", TP_VALUES)
@pytest.mark.parametrize("dist", ["normal", "near_ties"])
def test_router_scores_split_and_gather_equals_unsplit(T, dist):
    """Each rank's logits are whole dot products, so the ids are the unsplit ones and the weights equal.
    A rank's GEMM over its slice of experts may round a logit 1 ulp away from the whole GEMM's (seen
    with the AVX2 kernels of a 2-core CI machine), so a duplicated expert's exact tie can break the
    other way: rows may differ only among experts tied with the k-th score to within 4 ulps, and the
    weights are then those of the unsplit scores at the split's ids."""
    op = BY_NAME["router_topk"]
    inputs = op.make_inputs(Case(op.name, T, 5, "tiny", "float64", dist, tp=T))
    ids, weights = router_topk(**inputs.tensors, **inputs.params)
    ids_split, weights_split = router_topk_scores_split(**inputs.tensors, **inputs.params, T=T)
    s, choice = router_choice_scores(inputs.tensors["x"], inputs.tensors["w_gate"], inputs.tensors["bias"])
    kth = choice.gather(1, ids).amin(-1, keepdim=True)
    tied = (choice - kth).abs() <= 4 * torch.finfo(torch.float64).eps * kth.abs()
    for r in range(ids.shape[0]):
        moved = set(ids[r].tolist()) ^ set(ids_split[r].tolist())
        assert all(tied[r, e] for e in moved), f"row {r}: {sorted(ids[r].tolist())} vs {sorted(ids_split[r].tolist())}"
    if dist == "normal":
        assert torch.equal(ids_split, ids)
    torch.testing.assert_close(weights_split, renormalise(s, ids_split, inputs.params["routed_scale"]),
                               rtol=1e-13, atol=0)


def test_intermediate_width_pads_like_vllm_at_k3():
    assert [moe_tp_shard_width(3072, T) for T in TP_VALUES] == [3072, 1536, 768, 384, 256]
    assert [moe_tp_shard_width(128, T) for T in TP_VALUES] == [128, 64, 32, 32, 32]   # small: group floor


def test_padded_intermediate_is_zero_filled():
    op = BY_NAME["moe_experts_mxfp4"]
    inputs = op.make_inputs(Case(op.name, 0, 2, "tiny", "float64", tp=16))
    shards = shard_moe_intermediate(inputs, 16)
    inter = inputs.tensors["w13_packed"].shape[1] // 2
    width = moe_tp_shard_width(inter, 16)
    live = -(-inter // width)                       # ranks holding real rows; the rest are padding
    for shard in shards[live:]:
        assert not bool(shard.tensors["w13_packed"].any()) and not bool(shard.tensors["w2_packed"].any())


@pytest.mark.parametrize("T", [3, 5, 0])
def test_rank_count_not_dividing_names_T(T):
    op = BY_NAME["shared_experts"]
    inputs = op.make_inputs(Case(op.name, 0, 2, "tiny", "float64"))
    with pytest.raises(ValueError, match="^T"):
        shard_shared_experts(inputs, T)
    with pytest.raises(ValueError, match="^T"):
        moe_tp_shard_width(64, 0)
