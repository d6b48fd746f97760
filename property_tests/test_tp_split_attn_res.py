"""TP splits of the AttnRes ops: replicated over ranks, and the declared all-reduce order of the
partial deltas really matters for the order_sensitive inputs."""
from __future__ import annotations

import pytest
import torch

from references.attn_res import allreduce_attn_res_rmsnorm, fold_partials
from verify.model.case import Case
from verify.ops.attn_res import OPS
from verify.ops.common_splits import split_mismatches

TP_VALUES = (1, 2, 4, 8, 16)
BY_NAME = {op.name: op for op in OPS}



@pytest.mark.parametrize("T", TP_VALUES)
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_split_equals_unsplit_in_float64(name, T):
    op = BY_NAME[name]
    for seed, dist in ((T, "normal"), (T + 100, op.dists[-1])):
        inputs = op.make_inputs(Case(name, seed, 3, "tiny", "float64", dist, tp=T))
        assert split_mismatches(op, inputs, T) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("T", [4, 8, 16])
def test_order_sensitive_partials_depend_on_the_order(dtype, T):
    op = BY_NAME["allreduce_attn_res_rmsnorm"]
    inputs = op.make_inputs(Case(op.name, 5, 4, "tiny", dtype, "order_sensitive", tp=T))
    deltas = inputs.tensors["deltas"]
    assert deltas.shape[0] == T
    declared, reversed_order = fold_partials(deltas), fold_partials(deltas.flip(0))
    assert not torch.equal(declared, reversed_order), "the fold must depend on the order for these inputs"
    exact = deltas.double().sum(0)
    assert not torch.equal(declared.double(), exact), "the fp32 fold must lose bits the oracle keeps"
    # and the op's own state shows it: the same partials in another rank order change the prefix
    runs = []
    for d in (deltas, deltas.flip(0)):
        t = {k: v.clone() for k, v in inputs.tensors.items()}
        t["deltas"] = d.clone()
        allreduce_attn_res_rmsnorm(**t, **{**inputs.params, "block_write": -1})
        runs.append(t["prefix"])
    assert not torch.equal(runs[0], runs[1])


def test_replicated_combine_rejects_ranks_that_disagree():
    op = BY_NAME["attn_res_rmsnorm"]
    inputs = op.make_inputs(Case(op.name, 1, 2, "tiny", "bfloat16"))
    a = {"out": torch.zeros(2, 4), "prefix": torch.zeros(2, 4), "blocks": torch.zeros(2, 8, 4)}
    b = {**a, "out": torch.ones(2, 4)}
    with pytest.raises(ValueError, match="^per_rank_results: rank 1 'out'"):
        op.split.combine([a, b], inputs)


@pytest.mark.parametrize("T", [0, -2])
def test_bad_rank_count_names_T(T):
    op = BY_NAME["attn_res_rmsnorm"]
    with pytest.raises(ValueError, match="^T"):
        op.split.shard(op.make_inputs(Case(op.name, 1, 2, "tiny")), T)


def test_a_combine_that_drops_a_state_tensor_is_a_mismatch():
    """The split's combine must return the state as well as the outputs: one that hands back `out` and
    drops the updated prefix would let a state bug through every split (it was skipped silently)."""
    import dataclasses

    op = BY_NAME["attn_res_rmsnorm"]
    inputs = op.make_inputs(Case(op.name, 3, 3, "tiny", "float64", "normal", tp=2))
    dropping = dataclasses.replace(op.split, combine=lambda per_rank, inp: {
        n: t for n, t in op.split.combine(per_rank, inp).items() if n != "prefix"})
    assert split_mismatches(op, inputs, 2) == []
    assert split_mismatches(op, inputs, 2, split=dropping) == ["combine did not return 'prefix'"]
