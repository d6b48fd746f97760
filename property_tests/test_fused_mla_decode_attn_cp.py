"""fused/mla_decode_attn_cp.py: a context-parallel rank's window attention as one-token sequences of the
fused decode kernel. On the CPU the composition is driven with the reference attention as its per-token
kernel: it must equal references.mla_cp.mla_decode_attn_cp on the unsplit op and on every rank of the
declared context split (windows that end inside the draft, ranks past a short sequence's end), and the
harness must pass it and reject an off-by-one twin. Over real ranks (fused.mla_decode_attn_cp.
attention_over_ranks, one process per rank: gloo on CPUs with the reference attention, NCCL on two GPUs
with the fused kernel) every rank's combined attention is the simulated split's bits, and a gather in
another rank order is caught. On the GPU (`@pytest.mark.gpu`) the fused candidate is judged by the
harness, T = 1 and the simulated T = 2, 4 splits."""
from __future__ import annotations

import pytest
import torch

from property_tests.harness_case import on_one_thread
from property_tests.ranks import spawn_ranks
from references.mla import mla_decode_attn
from references.mla_cp import combine_context, context_shards, mla_decode_attn_cp
from verify.model.case import Case
from verify.ops.registry import get_op

OP = get_op("mla_decode_attn_cp")


@on_one_thread            # these tests judge the composition, not torch's GEMM
def _reference_attend(q, cache, table, lens, scale, kv_lora_rank):
    return mla_decode_attn(q, cache, table, lens, scale, kv_lora_rank, return_lse=True)


def reference_composed(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank):
    """The fused candidate's composition with the reference attention per token (a harness candidate)."""
    from fused.mla_decode_attn_cp import compose

    return compose(_reference_attend, q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank)


def off_by_one_composed(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank):
    """A planted twin: each token sees one key too few of its window (a causal limit off by one)."""
    from fused.mla_decode_attn_cp import compose

    def attend(q, cache_, table, lens, scale_, kv):
        return _reference_attend(q, cache_, table, (lens - 1).clamp(min=1), scale_, kv)
    return compose(attend, q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank)


def _close(a, b, wd_ulps: float = 2.0):
    """Equal up to a couple of working-dtype ulps of the row scale (the per-token pass sums its keys in
    another blocking than the windowed reference); -inf where the other is -inf."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        same_inf = torch.equal(torch.isinf(a), torch.isinf(b))
        fin = torch.isfinite(b)
        return same_inf and torch.allclose(a[fin], b[fin], rtol=1e-5, atol=1e-5)
    eps = torch.finfo(a.dtype).eps
    return bool(((a.float() - b.float()).abs() <= wd_ulps * eps * b.float().abs().amax().clamp_min(1e-30)).all())


@pytest.mark.parametrize("seed,q_per_seq,T", [(0, 1, 1), (1, 6, 1), (2, 8, 2), (3, 6, 3), (4, 2, 4), (5, 8, 4)])
def test_composition_equals_the_reference_on_every_rank(seed, q_per_seq, T):
    inputs = OP.make_inputs(Case("mla_decode_attn_cp", seed, 5, "small", "bfloat16", "normal",
                                 extra=(("q_per_seq", q_per_seq),)))
    t, p = inputs.tensors, inputs.params
    ranks = [dict(cache=t["cache"], block_table=t["block_table"], kv_start=t["kv_start"], kv_len=t["kv_len"])] \
        if T == 1 else context_shards(t["cache"], t["block_table"], t["seq_lens"], T)
    for r, shard in enumerate(ranks):
        args = (t["q_abs"], shard["cache"], shard["block_table"], shard["kv_start"], shard["kv_len"], t["seq_lens"],
                p["scale"], p["kv_lora_rank"])
        want_o, want_lse = mla_decode_attn_cp(*args)
        got_o, got_lse = reference_composed(*args)
        assert got_o.shape == want_o.shape and got_lse.shape == want_lse.shape
        assert _close(got_o, want_o), f"rank {r}: o"
        assert _close(got_lse.float(), want_lse.float()), f"rank {r}: lse"


def test_a_window_ending_inside_the_draft_and_an_empty_rank():
    """130 slots in pages of 16 over 3 ranks of 3 pages: rank 2 holds 34 slots; with 6 draft tokens the
    first tokens see part of rank 2's window; a 20-slot sequence leaves ranks 1 and 2 empty."""
    inputs = OP.make_inputs(Case("mla_decode_attn_cp", 7, 2, "small", "bfloat16", "normal",
                                 extra=(("q_per_seq", 6),)))
    t, p = dict(inputs.tensors), inputs.params
    page = t["cache"].shape[1]
    lens = torch.tensor([130, 20], dtype=t["seq_lens"].dtype)
    pages = -(-130 // page)
    t["cache"] = torch.randn(2 * pages, page, t["cache"].shape[2]).to(t["cache"].dtype)
    t["block_table"] = torch.arange(2 * pages, dtype=t["block_table"].dtype).view(2, pages)
    t["seq_lens"], t["kv_len"] = lens, lens.clone()
    for shard in context_shards(t["cache"], t["block_table"], lens, 3):
        args = (t["q_abs"], shard["cache"], shard["block_table"], shard["kv_start"], shard["kv_len"], lens,
                p["scale"], p["kv_lora_rank"])
        want_o, want_lse = mla_decode_attn_cp(*args)
        got_o, got_lse = reference_composed(*args)
        assert _close(got_o, want_o) and _close(got_lse.float(), want_lse.float())
    assert bool(torch.isinf(want_lse[1]).all())           # the last rank holds nothing of sequence 1


@pytest.mark.parametrize("T", [1, 2, 4])
def test_the_harness_passes_the_composition_and_rejects_its_off_by_one_twin(T):
    from property_tests.harness_case import judge_case

    here = "property_tests.test_fused_mla_decode_attn_cp"
    for seed in range(2):
        case = Case("mla_decode_attn_cp", seed, 4, "small", "bfloat16", "normal", T, (("q_per_seq", 6),))
        good = judge_case(case, f"{here}:reference_composed", device="cpu")
        assert good.status == "pass", f"T={T} seed {seed}: {good.stage}: {good.reason}"
    bad = [judge_case(Case("mla_decode_attn_cp", s, 4, "small", "bfloat16", "normal", T, (("q_per_seq", 6),)),
                      f"{here}:off_by_one_composed", device="cpu") for s in range(2)]
    assert all(v.status == "fail" for v in bad), [(v.status, v.stage) for v in bad]


# ---------------------------------------------------------------------------------------- real ranks
RANK_SEEDS = (11, 12, 13)


def _rank_case(seed: int, device: str):
    inputs = OP.make_inputs(Case("mla_decode_attn_cp", seed, 4, "small", "bfloat16", "normal",
                                 extra=(("q_per_seq", 6),)))
    return {n: v.to(device) for n, v in inputs.tensors.items()}, inputs.params


def _window_args(t, p, shard):
    return (t["q_abs"], shard["cache"], shard["block_table"], shard["kv_start"], shard["kv_len"], t["seq_lens"],
            p["scale"], p["kv_lora_rank"])


class _ReversedRanks:
    """A gather that stacks the ranks' tensors last rank first (a combine folded in another order)."""

    def __init__(self, real):
        self.real = real

    def __call__(self, t):
        return self.real(t).flip(0)


def _cp_rank_worker(rank: int, T: int, device: str, order: str):
    import fused.mla_decode_attn_cp as cp
    from fused.layers_tp import ProcessGroupGather

    # gloo: the composition over the reference attention; NCCL: the fused kernel (the default attend)
    attend, per_rank = ({"attend": _reference_attend}, reference_composed) if device == "cpu" else \
        ({}, cp.mla_decode_attn_cp)
    gather = ProcessGroupGather() if order == "declared" else _ReversedRanks(ProcessGroupGather())
    got = []
    for seed in RANK_SEEDS:
        t, p = _rank_case(seed, device)
        shards = context_shards(t["cache"], t["block_table"], t["seq_lens"], T)
        o, lse = cp.attention_over_ranks(gather, *_window_args(t, p, shards[rank]), **attend)
        # the split the harness simulates: the candidate on every rank's window here, combined in rank order
        sim = combine_context([per_rank(*_window_args(t, p, shard)) for shard in shards]) if rank == 0 else None
        got.append(((o.cpu(), lse.cpu()), sim and tuple(x.cpu() for x in sim)))
    return got


def _check_ranks_are_the_simulated_split(ranks: list) -> None:
    for i, seed in enumerate(RANK_SEEDS):
        o, lse = ranks[0][i][0]
        for r in range(1, len(ranks)):
            assert torch.equal(ranks[r][i][0][0], o) and torch.equal(ranks[r][i][0][1], lse), \
                f"seed {seed}: rank {r}'s combined attention differs from rank 0's"
        sim_o, sim_lse = ranks[0][i][1]
        assert torch.equal(o, sim_o) and torch.equal(lse, sim_lse), \
            f"seed {seed}: the ranks' attention differs from the simulated split's bits"


@pytest.mark.parametrize("T", [2, 3])
def test_ranks_over_gloo_are_the_simulated_split_bit_for_bit(T):
    ranks = spawn_ranks(_cp_rank_worker, T, "gloo", "declared")
    _check_ranks_are_the_simulated_split(ranks)
    t, p = _rank_case(RANK_SEEDS[0], "cpu")         # and it is the whole attention: the unsplit op's
    want_o, want_lse = mla_decode_attn_cp(*_window_args(t, p, dict(cache=t["cache"], block_table=t["block_table"],
                                                                    kv_start=t["kv_start"], kv_len=t["kv_len"])))
    o, lse = ranks[0][0][0]
    assert _close(o, want_o, wd_ulps=4.0) and _close(lse, want_lse.float())


def test_a_gather_in_another_rank_order_is_caught():
    ranks = spawn_ranks(_cp_rank_worker, 3, "gloo", "reversed")
    with pytest.raises(AssertionError, match="differs from the simulated split"):
        _check_ranks_are_the_simulated_split(ranks)


@pytest.mark.multi_gpu(2)
def test_fused_ranks_over_nccl_on_two_gpus_are_the_simulated_split_bit_for_bit():
    _check_ranks_are_the_simulated_split(spawn_ranks(_cp_rank_worker, 2, "nccl", "declared"))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,T", [("small", 1), ("small", 2), ("small", 4), ("k3", 1), ("k3", 2)])
def test_the_fused_candidate_is_judged_by_the_harness(config, T):
    from property_tests.harness_case import judge_case

    for seed in range(3):
        v = judge_case(Case("mla_decode_attn_cp", seed, 4, config, "bfloat16", "normal", T),
                       "fused.mla_decode_attn_cp:mla_decode_attn_cp")
        assert v.status == "pass", f"seed {seed}: {v.stage}: {v.reason}"


def test_the_fused_composition_is_drawn_in_its_kernels_dtypes_only():
    """The composition runs fused/mla_decode_attn.py, which takes bf16 and fp16: its module declares
    that scope, so the harness draws no fp32 case for it and names the scope in the verdict."""
    import fused.mla_decode_attn_cp as cp
    from verify.model.profile import get_profile
    from verify.plan.scope import candidate_scope

    scope = candidate_scope(get_op("mla_decode_attn_cp"), cp.mla_decode_attn_cp, get_profile("release"))
    assert set(scope.profile.dtypes) == {"bfloat16", "float16"}
    assert any("float32 not drawn" in n for n in scope.notes), scope.notes
