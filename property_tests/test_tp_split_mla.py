"""TP forms of the MLA ops, simulated in one process: shard + per-rank reference + combine == unsplit (float64),
for T in 1, 2, 4, 8, 16; and the whole attention half with its o_proj row-split sum in declared rank order."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.config import get_config
from references.mla import mla_attention_step, mla_attention_step_tp, sum_partials_rank_order
from verify.model.case import Case
from verify.ops.mla import OPS, make_decode_attn_inputs, paged_layout
from verify.ops.registry import import_callable

TPS = (1, 2, 4, 8, 16)
OP = {op.name: op for op in OPS}


def run_rank(op, shard) -> dict:
    """One rank's call; its outputs and its state after the call, by name (what SplitRule.combine expects)."""
    tensors = {k: v.clone() if k in op.state else v for k, v in shard.tensors.items()}
    out = import_callable(op.reference)(**tensors, **shard.params)
    out = () if out is None else (out if isinstance(out, tuple) else (out,))
    return {**dict(zip(op.outputs, out)), **{k: tensors[k] for k in op.state}}


def split_vs_unsplit(op, case):
    inputs = op.make_inputs(case)
    whole = run_rank(op, inputs)
    combined = op.split.combine([run_rank(op, s) for s in op.split.shard(inputs, case.tp)], inputs)
    return whole, combined


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 4), config=st.sampled_from(["tiny", "small"]))
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", sorted(OP))
def test_shard_then_combine_equals_unsplit_in_float64(name, tp, seed, batch, config):
    op = OP[name]
    whole, combined = split_vs_unsplit(op, Case(op=name, seed=seed, batch=batch, config=config,
                                                dtype="float64", tp=tp))
    assert set(combined) == set(op.outputs + op.state)
    for key in op.outputs + op.state:
        if op.split.kind == "replicated" or key in op.state:
            assert torch.equal(combined[key], whole[key]), f"{name}.{key}: replicated result must be identical"
        else:
            torch.testing.assert_close(combined[key], whole[key], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("tp", [16])
@pytest.mark.parametrize("name", ["mla_decode_attn", "mla_q_absorb"])
def test_head_split_at_k3_dimensions(name, tp):
    """96 heads, 6 per rank; also checks each rank's shard has the per-rank shapes of vLLM (§2.2)."""
    op = OP[name]
    case = Case(op=name, seed=1, batch=2, config="k3", dtype="float64", tp=tp, extra=(("q_per_seq", 2),))
    inputs = op.make_inputs(case)
    shards = op.split.shard(inputs, tp)
    heads = 96 // tp
    if name == "mla_q_absorb":
        assert shards[0].tensors["w_q_b"].shape == (heads * 192, 1536)
        assert shards[0].tensors["w_uk"].shape == (heads, 128, 512)
    else:
        assert shards[0].tensors["q_abs"].shape == (2, 2, heads, 576)
        assert shards[0].tensors["cache"] is inputs.tensors["cache"], "the latent cache is replicated"
    whole = run_rank(op, inputs)
    combined = op.split.combine([run_rank(op, s) for s in shards], inputs)
    for key in op.outputs:
        torch.testing.assert_close(combined[key], whole[key], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("name", ["mla_q_absorb", "mla_decode_attn", "mla_out_gate"])
@pytest.mark.parametrize("tp", [3, 5, 32])
def test_heads_not_divisible_by_tp_raise_naming_tp(name, tp):
    inputs = OP[name].make_inputs(Case(op=name, seed=0, batch=2, config="tiny"))
    with pytest.raises(ValueError, match=rf"^tp={tp}: n_heads=16 is not divisible"):
        OP[name].split.shard(inputs, tp)


def test_replicated_combine_rejects_ranks_that_disagree():
    op = OP["mla_cache_write"]
    inputs = op.make_inputs(Case(op=op.name, seed=0, batch=4, config="tiny"))
    ranks = [run_rank(op, s) for s in op.split.shard(inputs, 2)]
    ranks[1]["cache"].view(-1)[0] += 1
    with pytest.raises(ValueError, match=r"^rank 1: replicated result 'cache'"):
        op.split.combine(ranks, inputs)


def step_inputs(seed, config, n_seq, n_q, dtype):
    """A whole attention half: weights, a paged cache whose sequences end with the N = n_seq*n_q new tokens."""
    cfg = get_config(config)
    g = torch.Generator().manual_seed(seed)
    h, dh, rope, ql, kv, d = cfg.n_heads, cfg.head_dim, cfg.qk_rope_dim, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.hidden

    def rnd(*shape, fan_in=1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * fan_in ** -0.5).to(dtype)

    case = Case(op="mla_decode_attn", seed=seed, batch=n_seq, config=config, extra=(("q_per_seq", n_q),))
    ref_inputs = make_decode_attn_inputs(case)
    lengths = ref_inputs.tensors["seq_lens"].tolist()
    block_table, seq_lens, n_pages = paged_layout(case, lengths, cfg.page_size)
    # The new tokens' slots: the last n_q positions of every sequence.
    slots = torch.tensor([int(block_table[b, t // cfg.page_size]) * cfg.page_size + t % cfg.page_size
                          for b, n in enumerate(lengths) for t in range(n - n_q, n)], dtype=torch.int64)
    return dict(x=rnd(n_seq * n_q, d), w_qkv_a=rnd(ql + kv + rope, d, fan_in=d), q_a_norm_w=1 + 0.1 * rnd(ql),
                kv_a_norm_w=1 + 0.1 * rnd(kv), w_q_b=rnd(h * (dh + rope), ql, fan_in=ql), w_uk=rnd(h, dh, kv, fan_in=dh),
                w_uv=rnd(h, dh, kv, fan_in=kv), w_g=rnd(h * dh, d, fan_in=d), w_o=rnd(d, h * dh, fan_in=h * dh),
                cache=rnd(n_pages, cfg.page_size, kv + rope), block_table=block_table, seq_lens=seq_lens,
                slot_mapping=slots, eps=cfg.mla_latent_eps, scale=cfg.mla_scale)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 10_000), n_seq=st.integers(1, 3), n_q=st.integers(1, 4))
@pytest.mark.parametrize("tp", TPS)
def test_attention_step_tp_equals_unsplit_in_float64(tp, seed, n_seq, n_q):
    a = step_inputs(seed, "tiny", n_seq, n_q, torch.float64)
    b = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    whole = mla_attention_step(**a)
    split = mla_attention_step_tp(**b, tp=tp)
    torch.testing.assert_close(split, whole, rtol=1e-11, atol=1e-12)
    assert torch.equal(a["cache"], b["cache"]), "the replicated cache write is the same on every rank"
    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    c["cache"] = step_inputs(seed, "tiny", n_seq, n_q, torch.float64)["cache"]
    partials = mla_attention_step_tp(**c, tp=tp, return_partials=True)
    assert partials.shape == (tp, *whole.shape)
    assert torch.equal(sum_partials_rank_order(list(partials)), split)


def test_attention_step_tp1_is_bitwise_the_unsplit_step_in_bf16():
    a = step_inputs(3, "small", 3, 2, torch.bfloat16)
    b = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    assert torch.equal(mla_attention_step_tp(**b, tp=1), mla_attention_step(**a))


def test_o_proj_partials_sum_as_a_left_fold_in_fp32():
    # bf16 partials whose fp32 sum depends on the order: left fold gives ((2^25 + 1) - 2^25) + 1 = 1, a pairwise
    # tree gives (2^25 + 1) + (-2^25 + 1) = 0, and summing in bf16 loses both ones.
    parts = [torch.full((2, 3), v, dtype=torch.bfloat16) for v in (2.0 ** 25, 1.0, -(2.0 ** 25), 1.0)]
    assert torch.equal(sum_partials_rank_order(parts), torch.full((2, 3), 1.0, dtype=torch.bfloat16))
