"""Decode context parallelism of the MLA decode attention (references/mla_cp.py, registry mla_decode_attn_cp):
the rank op unsplit is mla_decode_attn with its LSE, bit for bit; the context split covers every key
position once, hands each rank only its pages, and leaves ranks past a short sequence empty; the
combine of the ranks' partials is the unsplit attention (float64: to rounding); the window's bounds
are checked by name; and the split runs over real gloo ranks (the NCCL run is test_distributed_nccl's,
which takes every op with a collective)."""
from __future__ import annotations

import pytest
import torch

from references.mla import mla_decode_attn
from references.mla_cp import combine_context, context_shards, mla_decode_attn_cp
from verify.model.case import Case
from verify.ops.registry import get_op


def _case(config="tiny", batch=4, dtype="bfloat16", seed=3, q=3):
    op = get_op("mla_decode_attn_cp")
    return op, op.make_inputs(Case(op.name, seed, batch, config, dtype, "normal", 1, (("q_per_seq", q),)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unsplit_is_mla_decode_attn_with_its_lse_bit_for_bit(dtype):
    _, inputs = _case(dtype=dtype)
    t, p = inputs.tensors, inputs.params
    o, lse = mla_decode_attn(t["q_abs"], t["cache"], t["block_table"], t["seq_lens"], p["scale"], p["kv_lora_rank"],
                             return_lse=True)
    o_cp, lse_cp = mla_decode_attn_cp(**t, **p)
    assert torch.equal(o.view(torch.int16) if dtype == "bfloat16" else o, o_cp.view(torch.int16) if dtype == "bfloat16"
                       else o_cp)
    assert torch.equal(lse, lse_cp)


@pytest.mark.parametrize("T", [2, 4, 8, 16])
def test_every_key_position_on_one_rank_and_only_its_pages(T):
    _, inputs = _case(batch=6, seed=11)
    t = inputs.tensors
    page = t["cache"].shape[1]
    shards = context_shards(t["cache"], t["block_table"], t["seq_lens"], T)
    for b, n in enumerate(t["seq_lens"].tolist()):
        spans = sorted((int(s["kv_start"][b]), int(s["kv_len"][b])) for s in shards if int(s["kv_len"][b]))
        pos = 0
        for start, length in spans:
            assert start == pos and start % page == 0, (b, spans)
            pos += length
        assert pos == n, (b, spans, n)
        for s in shards:          # a rank's window reads, page by page, the sequence's own pages
            length, start = int(s["kv_len"][b]), int(s["kv_start"][b])
            for j in range(-(-length // page)):
                mine = s["cache"][int(s["block_table"][b, j])]
                assert torch.equal(mine, t["cache"][int(t["block_table"][b, start // page + j])])
    held = sum(s["cache"].shape[0] for s in shards if bool(s["kv_len"].any()))
    assert held == sum(-(-n // page) for n in t["seq_lens"].tolist())      # no rank holds another's page
    if T == 16:
        assert any(int(s["kv_len"].min()) == 0 for s in shards)             # short sequences leave ranks empty


@pytest.mark.parametrize("T", [2, 4, 16])
def test_combined_partials_are_the_unsplit_attention(T):
    _, inputs = _case(batch=5, dtype="bfloat16", seed=5, q=4)
    t = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.tensors.items()}
    p = inputs.params
    whole = mla_decode_attn_cp(**t, **p)
    parts = [mla_decode_attn_cp(t["q_abs"], s["cache"], s["block_table"], s["kv_start"], s["kv_len"], t["seq_lens"],
                                **p) for s in context_shards(t["cache"], t["block_table"], t["seq_lens"], T)]
    o, lse = combine_context(parts)
    assert torch.allclose(o, whole[0], atol=1e-12, rtol=0) and torch.allclose(lse, whole[1], atol=1e-12, rtol=0)


def test_a_rank_with_no_visible_key_returns_zero_and_minus_infinity():
    _, inputs = _case(batch=2, seed=7, q=2)
    t, p = inputs.tensors, inputs.params
    empty = {**t, "kv_len": torch.zeros_like(t["kv_len"])}
    o, lse = mla_decode_attn_cp(**empty, **p)
    assert not o.any() and bool(torch.isneginf(lse).all())


def test_window_bounds_are_refused_by_name():
    _, inputs = _case(batch=2)
    t, p = inputs.tensors, inputs.params
    page = t["cache"].shape[1]
    for key, bad, word in (("kv_start", t["kv_start"] + 1, "kv_start"), ("kv_len", t["seq_lens"] + page, "kv_len"),
                           ("kv_len", t["kv_len"] - t["seq_lens"] - 1, "kv_len"),
                           ("kv_start", t["kv_start"].float(), "kv_start")):
        with pytest.raises((ValueError, TypeError), match=f"^{word}"):
            mla_decode_attn_cp(**{**t, key: bad}, **p)


def test_the_split_refuses_inputs_that_are_already_a_window():
    op, inputs = _case(batch=2)
    t = dict(inputs.tensors)
    t["kv_len"] = t["kv_len"] - 1
    with pytest.raises(ValueError, match="^kv_start/kv_len"):
        op.split.shard(type(inputs)(t, inputs.params), 2)


def test_context_split_over_real_gloo_ranks_certifies():
    from verify.run.distributed import certify_distributed

    [v] = certify_distributed([get_op("mla_decode_attn_cp")], "reference", "gloo", [2], cases_per_op=2)
    assert v.status == "pass", v.reason
    assert v.cases_run >= 2
