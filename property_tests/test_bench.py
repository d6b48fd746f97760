"""verify-kernels bench on the CPU: the timing core under a fake clock, the ops' declared byte counts
against their real tensors, the speed rule and the score, one row end to end, the records and the
CLI's refusal without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verify.bench import diff as speed_diff
from verify.bench import floor, output, run, score, shapes, timing
from verify.model.case import Case
from verify.ops.registry import all_ops, get_op

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------ timing core
class FakeClock:
    """Launches advance `now` (ms) by what they return; replays run the captured calls in order."""

    def __init__(self, method: str = "graph"):
        self.now, self.captured, self.method = 0.0, [], method

    def capture(self, calls):
        self.captured = list(calls)

        def replay():
            for c in calls:
                self.now += c()
        return replay, self.method

    def elapsed_ms(self, replay, n):
        t0 = self.now
        for _ in range(n):
            replay()
        return self.now - t0


def test_rotation_repeats_the_sets_until_the_graph_holds_min_calls():
    assert timing.rotation(3, 20) == [0, 1, 2] * 7
    assert timing.rotation(64, 20) == list(range(64))
    assert timing.rotation(1, 20) == [0] * 20
    with pytest.raises(ValueError):
        timing.rotation(0)


def test_sets_needed_spreads_the_rotation_beyond_l2():
    assert timing.sets_needed(1 << 20, rotate_bytes=256 << 20) == 64           # capped
    assert timing.sets_needed(100 << 20, rotate_bytes=256 << 20) == 3
    assert timing.sets_needed(700 << 20, rotate_bytes=256 << 20) == 1
    n = timing.sets_needed(13 << 20)
    assert n * (13 << 20) >= timing.ROTATE_BYTES > (n - 1) * (13 << 20)


def test_percentile_interpolates():
    assert timing.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert timing.percentile([0.0, 10.0], 10) == pytest.approx(1.0)
    assert timing.percentile([7.0], 90) == 7.0


def test_time_launches_reports_per_call_time_of_each_set_in_rotation():
    clock = FakeClock()
    calls = [lambda: 0.002, lambda: 0.004]              # 2 and 4 us per call
    st = timing.time_launches(calls, clock, min_calls=10, samples=5, replays=2)
    assert len(clock.captured) == 10                    # the rotation repeated to 10 calls
    assert st.median_us == pytest.approx(3.0) and st.p10_us == pytest.approx(3.0) and st.p90_us == pytest.approx(3.0)
    assert (st.sets, st.calls, st.samples, st.method) == (2, 10, 5, "graph")


def test_time_launches_median_and_spread_from_noisy_samples():
    clock = FakeClock(method="stream")
    noise = iter([0.0] + [i * 0.001 for i in range(11)])    # the warm-up replay, then 11 samples of 1 call

    def call():
        return 0.010 + next(noise)
    st = timing.time_launches([call], clock, min_calls=1, samples=11, replays=1)
    assert st.median_us == pytest.approx(15.0)
    assert st.p10_us == pytest.approx(11.0) and st.p90_us == pytest.approx(19.0)
    assert st.method == "stream"


def test_plan_samples_deals_the_replays_by_the_graphs_length():
    assert timing.plan_samples(0.04) == (timing.SAMPLES, timing.REPLAYS)     # short: the full count
    assert timing.plan_samples(1.0, measure_ms=60) == (25, 2)                # 60 replays of 1 ms
    assert timing.plan_samples(10.0, measure_ms=60) == (timing.MIN_SAMPLES, 1)   # long: the minimum
    assert timing.plan_samples(0.0) == (timing.SAMPLES, timing.REPLAYS)


def test_time_launches_without_counts_times_a_probe_and_deals_the_rest():
    clock = FakeClock()
    calls = [lambda: 1.0]                              # 1 ms a call, 10 ms a replay of 10 calls
    st = timing.time_launches(calls, clock, min_calls=10, measure_ms=60)
    assert (st.samples, st.replays, st.calls) == (timing.MIN_SAMPLES, 1, 10)   # 10 ms replays: 10 of 1
    assert st.median_us == pytest.approx(1000.0)
    # the one-call probe, then the warm replay, the probe replay and the samples
    assert clock.now == pytest.approx(1.0 + 10.0 * (1 + 1 + timing.MIN_SAMPLES))
    short = timing.time_launches([lambda: 0.001], FakeClock(), min_calls=20, measure_ms=60)
    assert (short.samples, short.replays, short.calls) == (timing.SAMPLES, timing.REPLAYS, 20)


def test_a_long_call_is_timed_in_one_pass_over_its_sets():
    """A call of LONG_CALL_MS or more (an eager reference layer) is not repeated to min_calls: its graph
    holds each set once; one just under it still is."""
    long_ms = timing.LONG_CALL_MS
    clock = FakeClock(method="stream")
    st = timing.time_launches([lambda: 50.0, lambda: 50.0], clock, min_calls=20, measure_ms=60)
    assert (st.calls, st.sets, st.samples, st.replays) == (2, 2, timing.MIN_SAMPLES, 1)
    assert st.median_us == pytest.approx(50000.0)
    assert clock.now == pytest.approx(50.0 + 100.0 * (1 + 1 + timing.MIN_SAMPLES))
    assert timing.time_launches([lambda: long_ms], FakeClock(), min_calls=20).calls == 1
    assert timing.time_launches([lambda: 0.99 * long_ms], FakeClock(), min_calls=20).calls == 20


# ------------------------------------------------------------------------------------ byte counts
def _returned(result) -> list[torch.Tensor]:
    if result is None:
        return []
    return [result] if isinstance(result, torch.Tensor) else [t for t in result if isinstance(t, torch.Tensor)]


def touched_bytes(op, inputs, outputs: list[torch.Tensor]) -> int:
    """Independently of the registry: every input read once, every state tensor read and written,
    every returned tensor written; the ops whose state is touched in part say which part."""
    t, p = inputs.tensors, inputs.params
    nb = {k: v.numel() * v.element_size() for k, v in t.items()}
    total = sum(v for k, v in nb.items() if k not in op.state) + sum(2 * nb[k] for k in op.state)
    total += sum(o.numel() * o.element_size() for o in outputs)
    if op.name in ("attn_res_rmsnorm", "allreduce_attn_res_rmsnorm"):   # blocks [B, slots, D]: the live read, the write slot written
        B, slots, D = t["blocks"].shape
        row = B * D * t["blocks"].element_size()
        total += -2 * nb["blocks"] + p["n_blocks"] * row + (row if p["block_write"] >= 0 else 0)
    if op.name == "mla_decode_attn":        # cache: the slots each sequence attends to, read once
        total += -nb["cache"] + sum(int(n) for n in t["seq_lens"].tolist()) * t["cache"].stride(1) * t["cache"].element_size()
    if op.name == "mla_decode_attn_cp":     # cache: the slots of each sequence's window, read once
        total += -nb["cache"] + sum(int(n) for n in t["kv_len"].tolist()) * t["cache"].stride(1) * t["cache"].element_size()
    if op.name in ("moe_experts_mxfp4", "moe_experts_mxfp4_ep"):   # expert weights: the chosen experts, once each
        chosen = {int(e) for e in t["ids"].flatten().tolist() if 0 <= e < t["w13_packed"].shape[0]}
        for k in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            total += -nb[k] + len(chosen) * nb[k] // t[k].shape[0]
    if op.name == "kda_verify":             # checkpoints: the verified tokens' slots written, none read
        tokens = int(t["n_tokens"].sum())
        for k in ("conv_ckpt", "state_ckpt"):
            total += -2 * nb[k] + tokens * nb[k] // (t[k].shape[0] * t[k].shape[1])
    if op.name == "kda_cache_step":         # cache: the committed slots read, the draft's stored; the base
        row = t["cache"][0, 0].numel() * t["cache"].element_size()          # read, written where it writes back
        total += -2 * nb["cache"] + (int(t["fill"].sum()) + int(t["n_tokens"].sum())) * row
        wb = int(((t["fill"].long() + t["accepted"].long()) >= p["window"]).sum())
        for k in ("base_conv", "base_state"):
            total += -2 * nb[k] + nb[k] + wb * nb[k] // t[k].shape[0]
    if op.name == "mla_cache_write":        # cache: only the rows the slots name are written, none read
        rows = int((t["slot_mapping"] >= 0).sum())
        total += -2 * nb["cache"] + rows * t["cache"][0, 0].numel() * t["cache"].element_size()
    if op.name == "mla_cache_append":       # cache: one row per sequence written, none read; one
        B = t["seq_lens"].shape[0]          # block-table entry per sequence read
        total += (-2 * nb["cache"] + B * t["cache"][0, 0].numel() * t["cache"].element_size()
                  - nb["block_table"] + B * t["block_table"].element_size())
    if op.family == "layers":
        return layer_touched_bytes(inputs)
    return total


def layer_touched_bytes(inputs) -> int:
    """A layer's N steps, each on its own: every weight tensor but the four expert tensors read whole;
    of those, the rows of the experts the reference's router chose at the step (decode_steps' routing
    record); x_steps[t] read and prefix_steps[t] written; blocks[:, :ceil(l / 12)] read; KDA state
    read and written; MLA: each sequence's cached tokens at the step read, its new token written,
    block_table read, seq_lens read and written."""
    from references.config import get_config
    from references.layers import LayerState, decode_steps
    from references.weights import LayerWeights

    t, p = inputs.tensors, inputs.params
    kind = "mla" if "cache" in t else "kda"
    state_names = ("cache", "block_table", "seq_lens") if kind == "mla" else ("conv_state", "recurrent_state")
    cfg = get_config(p["config"])
    work = {k: v.clone() for k, v in t.items()}
    weights = {k: v for k, v in work.items() if k not in state_names + ("x_steps", "blocks")}
    state = LayerState(prefix=torch.zeros_like(work["x_steps"][0]), blocks=work["blocks"],
                       **{k: work[k] for k in state_names})
    routing = []
    decode_steps(kind, LayerWeights(kind, cfg, work["x_steps"].dtype, weights), state, work["x_steps"],
                 p["layer_idx"], routing=routing)
    size = {k: v.numel() * v.element_size() for k, v in t.items()}
    experts = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")
    N, B, D = t["x_steps"].shape
    token_bytes = B * D * t["x_steps"].element_size()
    visible = -(-p["layer_idx"] // cfg.attn_res_block)
    total = 0
    for step, (ids, _) in enumerate(routing):
        chosen = {int(e) for e in ids.flatten().tolist()}
        total += sum(v for k, v in size.items() if k in weights and k not in experts)
        total += sum(len(chosen) * size[k] // t[k].shape[0] for k in experts)
        total += 2 * token_bytes + visible * token_bytes
        if kind == "kda":
            total += 2 * size["conv_state"] + 2 * size["recurrent_state"]
        else:
            cached = sum(int(n) + step for n in t["seq_lens"].tolist())
            total += (cached + B) * t["cache"][0, 0].numel() * t["cache"].element_size()
            total += size["block_table"] + 2 * size["seq_lens"]
    return total


def _byte_cases():
    for op in all_ops().values():
        if op.moved_bytes is None:
            continue
        for config, batches in (("tiny", (1, 3)), ("small", (2, 8))):
            for B in batches:
                for knobs in op.bench_knobs + ({},):
                    yield op.name, config, B, tuple(sorted(knobs.items()))


@pytest.mark.parametrize("name, config, batch, knobs", list(_byte_cases()))
def test_moved_bytes_match_the_real_tensors(name, config, batch, knobs):
    from verify.judge.candidates import reference_fn

    op = get_op(name)
    for seed in (0, 1):
        inputs = op.make_inputs(Case(name, seed, batch, config, "bfloat16", "normal", 1, knobs))
        tps = [1] + [T for T in (2, 4) if op.split is not None and T in op.split.tp_values]
        for T in tps:
            try:
                rank = shapes.rank_inputs(op, inputs, T)
            except ValueError:
                continue                      # a split that does not divide this small shape
            work = {k: v.clone() for k, v in rank.tensors.items()}
            outs = _returned(reference_fn(op)(**work, **rank.params))
            assert floor.declared_bytes(op, rank) == touched_bytes(op, rank, outs), (name, config, batch, knobs, T)


def test_every_fused_op_declares_its_bytes():
    missing = [o.name for o in all_ops().values() if o.fused and o.moved_bytes is None]
    assert not missing, f"fused ops without moved_bytes (their floor): {missing}"


@pytest.mark.parametrize("name", ["router_topk", "attn_res_rmsnorm", "kda_decode", "mla_cache_write"])
def test_moved_bytes_at_k3(name):
    from verify.judge.candidates import reference_fn

    op = get_op(name)
    for knobs in op.bench_knobs:
        inputs = op.make_inputs(Case(name, 0, 2, "k3", "bfloat16", "normal", 1, tuple(sorted(knobs.items()))))
        outs = _returned(reference_fn(op)(**{k: v.clone() for k, v in inputs.tensors.items()}, **inputs.params))
        assert floor.declared_bytes(op, inputs) == touched_bytes(op, inputs, outs)


def test_copy_half_moves_the_declared_traffic():
    assert floor.copy_half(1000) == 496 and floor.copy_half(10) == 16
    assert 2 * floor.copy_half(12_845_056) == 12_845_056


def test_both_floor_copies_move_the_bytes_and_the_faster_is_the_floor(monkeypatch):
    """memcpy and the SM copy each write every byte of their destination from their source; the row's
    floor is the faster of the two, with both kept."""
    for kind in floor.FLOOR_KINDS:
        (launch,) = floor.floor_launches(4096, 1, "cpu", kind)
        src = launch.__defaults__[0]
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8).view(src.dtype) if src.dtype == torch.uint8
                  else torch.randint(-2**31, 2**31 - 1, src.shape, dtype=torch.int32))
        out = launch()
        want = src if kind == "memcpy" else torch.bitwise_not(src)
        assert torch.equal(out, want) and out.numel() * out.element_size() == floor.copy_half(4096), kind
    with pytest.raises(ValueError, match="floor kind 'dma'"):
        floor.floor_launches(4096, 1, "cpu", "dma")
    fake_ms = {"memcpy": 0.003, "sm_copy": 0.002}
    monkeypatch.setattr(floor, "floor_launches", lambda nbytes, n, device, kind: [lambda: fake_ms[kind]] * n)
    op = get_op("skinny_gemm")
    inputs = op.make_inputs(Case("skinny_gemm", 0, 2, "tiny", "bfloat16", "normal"))
    row = run.bench_shape(op, shapes.Shape("skinny_gemm", 1, 2), inputs, {"fused": lambda s: (lambda: 0.001)}, {},
                          ["fused"], FakeClock(), "cpu", timing_kw=FAST)
    assert row["timings"]["floor"]["kind"] == "sm_copy" and row["timings"]["floor"]["median_us"] == pytest.approx(2.0)
    assert row["floor_copies"] == {"memcpy": pytest.approx(3.0), "sm_copy": pytest.approx(2.0)}
    assert row["judged"]["fused"]["floor_ratio"] == pytest.approx(0.5)


# ------------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize("name", ["skinny_gemm", "router_topk", "attn_res_rmsnorm", "kda_decode", "mla_cache_write"])
def test_a_smaller_batch_has_the_builders_shapes(name):
    op = get_op(name)
    knobs = tuple(sorted(op.bench_knobs[0].items()))
    big = op.make_inputs(Case(name, 0, 8, "small", "bfloat16", "normal", 1, knobs))
    small = op.make_inputs(Case(name, 0, 3, "small", "bfloat16", "normal", 1, knobs))
    taken = shapes.take_batch(op, big, 3)
    assert {k: (v.shape, v.dtype) for k, v in taken.tensors.items()} == \
           {k: (v.shape, v.dtype) for k, v in small.tensors.items()}
    assert taken.params == small.params


def test_input_cache_gives_the_shard_of_the_batch_as_built_directly():
    op = get_op("kda_decode")
    cache = shapes.InputCache()
    for b in (4, 2):
        shape = shapes.Shape("kda_decode", 8, b)
        got = cache.inputs(op, shape, 4)
        want = shapes.take_batch(op, shapes.rank_inputs(op, op.make_inputs(shapes.case_for(op, shape, 4)), 8), b)
        assert got.params == want.params and got.tensors.keys() == want.tensors.keys()
        assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)


def test_routed_experts_at_k3s_expert_count_are_drawn_on_the_device_with_spread_routing():
    """knob n_experts above the registry's 32 at K3 on CUDA: the experts are drawn on the device and each
    token picks k distinct of all of them (B = 64 over 32 experts put 32 tokens on every expert; K3's
    896 give about one). device_expert_inputs is run here on the CPU at the small config."""
    from dataclasses import replace

    from verify.ops.moe import K3_CPU_EXPERTS

    op = get_op("moe_experts_mxfp4")
    k3 = Case("moe_experts_mxfp4", 0, 64, "k3", "bfloat16", "normal", 8, (("n_experts", 896),))
    assert shapes.device_built(op, k3, "cuda") and not shapes.device_built(op, k3, "cpu")
    assert shapes.whole_k3(op, k3) and not shapes.whole_k3(op, replace(k3, extra=(("n_experts", K3_CPU_EXPERTS),)))
    assert not shapes.whole_k3(op, replace(k3, extra=())) and not shapes.whole_k3(get_op("router_topk"), k3)
    assert shapes.knob_error(op, {"n_experts": 896}) is None

    case = Case("moe_experts_mxfp4", 3, 16, "small", "bfloat16", "normal", 1, (("n_experts", 40),))
    got = shapes.device_expert_inputs(op, case, "cpu")
    reg = op.make_inputs(case)                                          # the registry's 40 experts
    t, k = got.tensors, reg.tensors["ids"].shape[1]
    assert t["w13_packed"].shape[0] == t["w2_scale"].shape[0] == 40 and got.params == reg.params
    for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
        assert t[n].shape == reg.tensors[n].shape and t[n].dtype == reg.tensors[n].dtype
    at_k = op.make_inputs(replace(case, extra=(("n_experts", k),))).tensors  # z, weights, padding: its case at k
    assert torch.equal(t["z"], at_k["z"]) and torch.equal(t["weights"], at_k["weights"])
    assert torch.equal(t["ids"] < 0, at_k["ids"] < 0) and t["ids"].max() < 40
    for row in t["ids"]:
        real = row[row >= 0]
        assert real.unique().numel() == real.numel()
    assert len(t["ids"][t["ids"] >= 0].unique()) > k                 # spread over the 40, not one token's k
    with pytest.raises(ValueError, match="n_experts=4: fewer experts than the top-"):
        shapes.device_expert_inputs(op, replace(case, extra=(("n_experts", 4),)), "cpu")


def test_shapes_for_follows_the_op_declarations():
    gemm, deq, kda = get_op("skinny_gemm"), get_op("mxfp4_dequant"), get_op("kda_decode")
    s, notes = shapes.shapes_for(gemm, [1, 8, 3], [1, 64])
    assert len(s) == 4 * 2 * 2 and any("T=3" in n for n in notes)
    assert {dict(x.knobs)["proj"] for x in s} == {"o_proj", "g_proj", "latent_down", "latent_up"}
    assert shapes.coverage_order([1, 2, 4, 8, 16, 32, 64]) == [1, 64, 8, 2, 16, 4, 32]
    assert sorted(shapes.coverage_order([3, 1, 2, 9, 5])) == [1, 2, 3, 5, 9]
    s, _ = shapes.shapes_for(deq, [1, 8], [1, 2, 4])
    assert [(x.tp, x.batch) for x in s] == [(1, 7168), (8, 7168)]       # weight rows, not decode tokens
    s, notes = shapes.shapes_for(get_op("router_topk"), [1, 8, 16], [1])
    assert [x.tp for x in s] == [1] and any("replicated" in n for n in notes)
    s, notes = shapes.shapes_for(kda, [1], [32, 64])
    assert [x.batch for x in s] == [32, 64] and any("batch-invariance" in n for n in notes)
    assert s[0].label == "T=1 B=32"


# ------------------------------------------------------------------------------------ rule and score
def test_rule_met_miss_and_incomplete():
    ok = score.judge(5.0, {"eager": 50.0, "compiled": 10.0, "peer:x": 6.0}, 4.0)
    assert ok["verdict"] == "met" and ok["floor_ratio"] == 1.25 and ok["floor_limit"] == 2.0
    slow = score.judge(5.0, {"eager": 50.0, "compiled": 10.0, "peer:x": 4.9}, 4.0)
    assert slow["verdict"] == "miss" and "peer:x" in slow["misses"][0]
    tie = score.judge(5.0, {"eager": 5.0}, 4.0)
    assert tie["verdict"] == "miss"                               # "faster" is strict
    part = score.judge(5.0, {"eager": 50.0, "compiled": None}, 4.0)
    assert part["verdict"] == "incomplete" and part["unjudged"] == ["compiled"]
    nofloor = score.judge(5.0, {"eager": 50.0}, None)
    assert nofloor["verdict"] == "incomplete" and "floor" in nofloor["unjudged"]


def test_floor_limit_switches_at_ten_microseconds():
    assert score.floor_limit(10.0) == 1.25 and score.floor_limit(9.99) == 2.0
    assert score.judge(12.6, {}, 10.0)["verdict"] == "miss"       # 1.26x of a 10 us floor
    assert score.judge(12.5, {}, 10.0)["verdict"] == "met"
    assert score.judge(19.9, {}, 9.99)["verdict"] == "met"        # 1.99x of a latency-bound floor
    assert score.judge(20.0, {}, 9.99)["verdict"] == "miss"


def _row(op, shape, cand_us, eager, peer=None, floor_us=1.0, cands=("fused",)):
    timings = {"eager": {"median_us": eager, "p10_us": eager, "p90_us": eager},
               "compiled": {"median_us": eager, "p10_us": eager, "p90_us": eager}, "floor": {"median_us": floor_us}}
    if cand_us is not None:
        timings["fused"] = {"median_us": cand_us, "p10_us": cand_us, "p90_us": cand_us}
    if peer is not None:
        timings["peer:p"] = {"median_us": peer, "p10_us": peer, "p90_us": peer}
    row = {"op": op, "shape": shape, "candidates": list(cands), "timings": timings, "errors": {}, "judged": {}}
    run.judge_row(row, ["p"] if peer is not None else [])
    return row


def test_summary_shares_over_benchmarked_shapes():
    rows = [_row("a", "B=1", 1.0, 2.5, peer=1.6), _row("a", "B=2", 1.0, 1.6, peer=0.9),
            _row("a", "B=4", 1.0, 1.2), _row("b", "B=1", None, 3.0)]      # b: refused, never timed
    s = score.summary(rows, ["fused"], {"fused": {"a"}})["fused"]
    assert s["shapes"] == 4 and s["certified_and_timed"] == 3
    assert s["vs_eager"] == {"1.0": 0.75, "1.5": 0.5, "2.0": 0.25}
    assert s["peer_shapes"] == 2 and s["vs_best_peer"] == {"1.0": 0.5, "1.5": 0.5, "2.0": 0.0}
    assert s["rule_met"] == 1 + 0 + 1                                     # B=2 is slower than its peer


def test_summary_counts_an_uncertified_op_as_zero():
    rows = [_row("a", "B=1", 1.0, 5.0)]
    assert score.summary(rows, ["fused"], {})["fused"]["vs_eager"]["1.0"] == 0.0


# ------------------------------------------------------------------------------------ one row, end to end
def test_bench_shape_times_every_entry_and_reports_a_failing_one():
    from verify.bench.peers import torch_linear
    from verify.judge.candidates import reference_fn

    op = get_op("skinny_gemm")
    shape = shapes.Shape("skinny_gemm", 1, 4, (("proj", "o_proj"),))
    inputs = op.make_inputs(shapes.case_for(op, shape))
    ref = reference_fn(op)

    def broken(s):
        raise RuntimeError("no kernel for this shape\nsecond line")
    makers = {"eager": run._op_launch(ref), "peer:torch_linear": run._peer_launch(torch_linear),
              "fused": run._op_launch(ref), "compiled": broken}

    class CpuClock(timing.GraphClock):       # a real host clock: the row's plumbing, not its numbers
        def capture(self, calls):
            return (lambda: [c() for c in calls]), "stream"

        def elapsed_ms(self, replay, n):
            import time
            t0 = time.perf_counter()
            for _ in range(n):
                replay()
            return (time.perf_counter() - t0) * 1e3

    def transposed(t, p):                   # a peer that computes something else
        return lambda: torch_linear(t, p)().T.contiguous().T * 1.5
    row = run.bench_shape(op, shape, inputs, makers, {}, ["fused"], CpuClock(), "cpu",
                          timing_kw={"min_calls": 2, "samples": 3, "replays": 1},
                          checks={"peer:torch_linear": torch_linear, "peer:wrong": transposed})
    assert row["peer_checks"]["peer:torch_linear"].startswith("ok")
    assert row["peer_checks"]["peer:wrong"].startswith("DIFFERS")
    assert set(row["timings"]) == {"eager", "peer:torch_linear", "fused", "floor"}
    assert set(row["errors"]) == {"compiled"}
    assert row["errors"]["compiled"].startswith("RuntimeError: no kernel for this shape (at test_bench.py:")
    assert row["bytes"] == op.moved_bytes(inputs) and row["sets"] >= 1
    j = row["judged"]["fused"]
    assert "compiled" in j["unjudged"] and set(j["speedup"]) == {"eager", "peer:torch_linear"}


def test_on_cuda_each_entry_records_its_memory(monkeypatch):
    """Each entry's allocator peak (reset before it), what stays allocated and reserved after its launches
    are collected, and the card's free memory, in GB; nothing of the kind on the CPU."""
    import torch

    calls = []
    peaks = iter([3e9, 5e9])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 1e9)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2e9)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70e9, 80e9))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(run, "_device_sets", lambda inputs, n, device: [inputs])
    op = get_op("skinny_gemm")
    shape = shapes.Shape("skinny_gemm", 1, 2, (("proj", "o_proj"),))
    inputs = op.make_inputs(shapes.case_for(op, shape))
    makers = {"eager": lambda s: (lambda: None), "fused": lambda s: (lambda: None)}
    row = run.bench_shape(op, shape, inputs, makers, {}, ["fused"], FakeClock(), "cuda",
                          timing_kw={"min_calls": 2, "samples": 2, "replays": 1})
    assert row["memory_gb"] == {"eager": {"peak": 3.0, "after": 1.0, "reserved": 2.0, "free": 70.0},
                                "fused": {"peak": 5.0, "after": 1.0, "reserved": 2.0, "free": 70.0}}
    assert calls[:4] == ["reset", "empty", "reset", "empty"]
    cpu = run.bench_shape(op, shape, inputs, makers, {}, ["fused"], FakeClock(), "cpu",
                          timing_kw={"min_calls": 2, "samples": 2, "replays": 1})
    assert "memory_gb" not in cpu


# ------------------------------------------------------------------------------------ a whole run, cut or not
class CountingClock:
    """Captures the calls; a replay runs them and counts 1 us per call: numbers that say the plumbing ran."""

    def capture(self, calls):
        calls = list(calls)

        def replay():
            for c in calls:
                c()
            return len(calls)
        return replay, "graph"

    def elapsed_ms(self, replay, n):
        return sum(replay() for _ in range(n)) * 1e-3


def _dry_plan(monkeypatch, ops=("router_topk", "mla_cache_write"), budget=None, allowed=None, on_shape=None,
              batches=(1, 2, 4)):
    """A plan over real ops at T = 1 on the CPU, every entry a no-op launch (no reference runs, nothing
    compiles); on_shape(shape) is called as each shape starts; `seen` lists (op, B) in run order."""
    seen = []

    def entries(op, allowed_fns, device="cuda"):
        return {"eager": lambda s: (lambda: None), "fused": lambda s: (lambda: None)}, {}, {}
    monkeypatch.setattr(run, "entries_for", entries)
    real = run.bench_shape

    def bench_shape(op, shape, *a, **k):
        seen.append((op.name, shape.batch))
        if on_shape is not None:
            on_shape(shape)
        return real(op, shape, *a, **k)
    monkeypatch.setattr(run, "bench_shape", bench_shape)
    plan = run.Plan(ops=[get_op(n) for n in ops], candidates={n: ["fused"] for n in ops},
                    allowed=allowed if allowed is not None else {n: {"fused": None} for n in ops},
                    tps=[1], batches=list(batches), device="cpu", budget_s=budget)
    return plan, seen


ROUNDS = [("router_topk", 1), ("mla_cache_write", 1), ("router_topk", 4), ("mla_cache_write", 4),
          ("router_topk", 2), ("mla_cache_write", 2)]          # B in coverage order 1, 4, 2; every op each round
FAST = {"min_calls": 2, "samples": 2, "replays": 1}


def test_bench_all_runs_rounds_and_writes_the_rest_as_pending_after_every_row(monkeypatch):
    plan, seen = _dry_plan(monkeypatch)
    states, ends = [], []
    res = run.bench_all(plan, CountingClock(), lambda row, st: states.append(json.loads(json.dumps(st))),
                        timing_kw=FAST, on_round=lambda st: ends.append(len(st["rows"])))
    assert seen == ROUNDS and res["not_reached"] == [] and ends == [2, 4, 6]
    assert [len(s["rows"]) for s in states] == [1, 2, 3, 4, 5, 6]
    assert [len(s["not_reached"]) for s in states] == [5, 4, 3, 2, 1, 0]
    assert [(d["op"], d["batch"], d["reason"]) for d in states[0]["not_reached"]] == [
        (op, b, "pending") for op, b in ROUNDS[1:]]
    assert all(r["timings"]["fused"]["median_us"] > 0 and "floor" in r["timings"] for r in res["rows"])
    assert [(r["op"], r["batch"]) for r in res["rows"]] == sorted(ROUNDS, key=lambda x: (x[0] != "router_topk", x[1]))


def test_an_entry_failing_the_same_way_twice_is_not_tried_again(monkeypatch):
    calls = {"n": 0}

    def entries(op, allowed_fns, device="cuda"):
        def broken(s):
            calls["n"] += 1
            raise RuntimeError("inductor: the compile failed")
        return {"compiled": broken, "fused": lambda s: (lambda: None)}, {}, {}
    plan, seen = _dry_plan(monkeypatch, ops=("router_topk",), batches=(1, 2, 4, 8))
    monkeypatch.setattr(run, "entries_for", entries)
    res = run.bench_all(plan, CountingClock(), lambda row, st: None, timing_kw=FAST)
    errs = [r["errors"]["compiled"] for r in sorted(res["rows"], key=lambda r: seen.index(("router_topk", r["batch"])))]
    assert calls["n"] == run.GIVE_UP_AFTER and errs[0] == errs[1]
    assert errs[0].startswith("RuntimeError: inductor: the compile failed (at test_bench.py:")
    assert all(e.startswith("not tried: the same error at the 2 shapes before: RuntimeError") for e in errs[2:])
    assert all("fused" in r["timings"] for r in res["rows"])


def test_rounds_put_one_batch_of_every_op_in_each():
    gemm, deq = get_op("skinny_gemm"), get_op("mxfp4_dequant")
    per_op = [(gemm, shapes.shapes_for(gemm, [1, 8], [1, 64])[0]), (deq, shapes.shapes_for(deq, [1, 8], [1, 64])[0])]
    r = run.rounds(per_op)
    assert [[(op.name, s.batch) for op, s in rd] for rd in r] == [
        [("skinny_gemm", 1)] * 8 + [("mxfp4_dequant", 7168)] * 2, [("skinny_gemm", 64)] * 8]


def test_bench_all_time_budget_lists_every_shape_it_did_not_start(monkeypatch):
    plan, seen = _dry_plan(monkeypatch, budget=1e-9)
    res = run.bench_all(plan, CountingClock(), lambda row, st: None)
    assert seen == [] and res["rows"] == []
    assert [(d["op"], d["batch"], d["reason"]) for d in res["not_reached"]] == [
        (op, b, "time budget") for op, b in ROUNDS]
    note = res["notes"]["run"][0]
    assert note.startswith("time budget of 1e-09 s reached") and "6 shapes not started" in note


def test_bench_all_interrupted_keeps_the_rows_and_lists_the_rest(monkeypatch):
    def stop_at_third(shape, n=[0]):
        n[0] += 1
        if n[0] == 3:
            raise run.Interrupted("SIGTERM")
    plan, seen = _dry_plan(monkeypatch, on_shape=stop_at_third)
    res = run.bench_all(plan, CountingClock(), lambda row, st: None, timing_kw=FAST)
    assert [(r["op"], r["batch"]) for r in res["rows"]] == ROUNDS[:2]
    assert [(d["op"], d["batch"]) for d in res["not_reached"]] == ROUNDS[2:]
    assert {d["reason"] for d in res["not_reached"]} == {"interrupted (Interrupted: SIGTERM)"}
    assert "interrupted" in res["notes"]["run"][0]


def test_an_op_with_nothing_certified_is_listed_untimed(monkeypatch):
    plan, seen = _dry_plan(monkeypatch, allowed={"router_topk": {"fused": None}})
    res = run.bench_all(plan, CountingClock(), lambda row, st: None, timing_kw=FAST)
    untimed = [r for r in res["rows"] if r["op"] == "mla_cache_write"]
    assert len(untimed) == 3 and all(r["timings"] == {} and "passing verdict" in r["errors"]["not timed"]
                                     for r in untimed)
    assert seen == [("router_topk", 1), ("router_topk", 4), ("router_topk", 2)]   # no baseline timed for nothing
    s = score.summary(res["rows"], ["fused"], {"fused": {"router_topk"}})["fused"]
    assert s["shapes"] == 6 and s["certified_and_timed"] == 3


def _bench_args(**kw):
    import argparse

    return argparse.Namespace(**{"json": False, "time_budget": None, "profile_kernels": None, **kw})


def _dry_gate(monkeypatch, ops):
    from verify.bench import certified

    gate = certified.Gate(allowed={o: {"fused": None} for o in ops}, applies={o: ["fused"] for o in ops},
                          certificate="c.json")
    monkeypatch.setattr(certified, "from_certificates", lambda *a, **k: gate)


def test_bench_command_writes_json_table_and_html(monkeypatch, tmp_path):
    from verify.bench import command

    ops = ("router_topk", "mla_cache_write")
    plan, seen = _dry_plan(monkeypatch, ops)
    _dry_gate(monkeypatch, ops)
    monkeypatch.setattr(timing, "plan_samples", lambda *a, **k: (2, 1))
    rc = command._bench(_bench_args(), [get_op(o) for o in ops], ["fused"], [1], [1, 2, 4], ["c.json"], tmp_path,
                        ["bench"], device="cpu", clock=CountingClock())
    assert rc == 0 and seen == ROUNDS
    rec = output.load(tmp_path / "bench.json")
    assert len(rec["rows"]) == 6 and rec["not_reached"] == [] and rec["scores"]["fused"]["shapes"] == 6
    assert "router_topk: us per call" in (tmp_path / "bench.txt").read_text()
    md = (tmp_path / "bench.md").read_text()
    assert "### router_topk" in md and "| T=1 B=2 |" in md and "Command: `verify-kernels bench`" in md
    assert "data:image/png;base64," in (tmp_path / "bench.html").read_text()


def test_bench_command_on_sigterm_writes_what_it_has_and_lists_the_rest(monkeypatch, tmp_path):
    import signal

    from verify.bench import command

    ops = ("router_topk", "mla_cache_write")
    plan, seen = _dry_plan(monkeypatch, ops, on_shape=lambda s: len(seen) == 3 and os.kill(os.getpid(), signal.SIGTERM))
    _dry_gate(monkeypatch, ops)
    monkeypatch.setattr(timing, "plan_samples", lambda *a, **k: (2, 1))
    before = signal.getsignal(signal.SIGTERM)
    rc = command._bench(_bench_args(), [get_op(o) for o in ops], ["fused"], [1], [1, 2, 4], ["c.json"], tmp_path,
                        ["bench"], device="cpu", clock=CountingClock())
    assert rc == 1 and signal.getsignal(signal.SIGTERM) == before
    rec = output.load(tmp_path / "bench.json")
    assert [(r["op"], r["batch"]) for r in rec["rows"]] == [("router_topk", 1), ("mla_cache_write", 1)]
    assert [(d["op"], d["batch"], d["reason"]) for d in rec["not_reached"]] == [
        (op, b, "interrupted (Interrupted: SIGTERM)") for op, b in ROUNDS[2:]]
    text = (tmp_path / "bench.txt").read_text()
    assert ("not timed, interrupted (Interrupted: SIGTERM): 4 shapes: router_topk T=1 B=4; mla_cache_write T=1 B=4; "
            "router_topk T=1 B=2; mla_cache_write T=1 B=2") in text
    assert "Not timed, interrupted" in (tmp_path / "bench.html").read_text()


# ------------------------------------------------------------------------------------ peers on the CPU
def test_torch_peers_compute_the_op():
    from verify.bench import peers
    from verify.judge.candidates import reference_fn

    op = get_op("router_topk")
    inputs = op.make_inputs(Case("router_topk", 3, 5, "small", "bfloat16", "normal"))
    ids, w = reference_fn(op)(**inputs.tensors, **inputs.params)
    pids, pw = peers.cublas_logits_topk(inputs.tensors, inputs.params)()
    assert torch.equal(pids.sort(-1).values, ids.sort(-1).values)
    assert torch.allclose(pw.gather(1, pids.argsort(-1)), w.gather(1, ids.argsort(-1)), rtol=1e-5, atol=1e-6)
    g = get_op("skinny_gemm")
    gi = g.make_inputs(Case("skinny_gemm", 0, 3, "small", "bfloat16", "normal"))
    y = reference_fn(g)(**gi.tensors)
    assert torch.allclose(peers.torch_linear(gi.tensors, {})().float(), y.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequant_cublas_peer_computes_the_routed_experts(dtype):
    from verify.bench import peer_check, peers
    from verify.judge.candidates import reference_fn

    op = get_op("moe_experts_mxfp4")
    inputs = op.make_inputs(Case("moe_experts_mxfp4", 2, 6, "tiny", dtype, "normal"))
    y = reference_fn(op)(**inputs.tensors, **inputs.params)
    got = peers.dequant_cublas_experts(inputs.tensors, inputs.params)()
    assert got.dtype == y.dtype and peer_check.compare(y, got).startswith("ok"), peer_check.compare(y, got)
    wrong = dict(inputs.tensors, ids=inputs.tensors["ids"].roll(1, 0))        # checked, so a wrong peer shows
    assert peer_check.compare(y, peers.dequant_cublas_experts(wrong, inputs.params)()).startswith("DIFFERS")


def test_peer_option_adds_a_peer_to_the_named_op_for_the_run():
    from verify.bench import command

    ops = [get_op("moe_experts_mxfp4"), get_op("router_topk")]
    got = command._with_peers(ops, ["moe_experts_mxfp4:dequant_cublas=verify.bench.peers:dequant_cublas_experts"])
    assert [p.name for p in got[0].peers][-1] == "dequant_cublas" and got[1] is ops[1]
    assert got[0].peers[:-1] == ops[0].peers and get_op("moe_experts_mxfp4").peers == ops[0].peers


def test_knobs_option_replaces_the_named_ops_bench_knobs_for_the_run():
    from verify.bench import command
    from verify.bench.shapes import shapes_for

    ops = [get_op("mla_decode_attn"), get_op("attn_res_rmsnorm")]
    got = command._with_knobs(ops, ["mla_decode_attn:context=8192,q_per_seq=6", "mla_decode_attn:context=1024,q_per_seq=1"])
    assert got[0].bench_knobs == ({"context": 8192, "q_per_seq": 6}, {"context": 1024, "q_per_seq": 1})
    assert got[1] is ops[1] and get_op("mla_decode_attn").bench_knobs == ops[0].bench_knobs
    shapes, _ = shapes_for(got[0], [1, 8], [1, 64])
    assert {s.label for s in shapes} >= {"T=8 B=64 context=8192 q_per_seq=6", "T=1 B=1 context=1024 q_per_seq=1"}
    assert len(shapes) == 2 * 2 * 2


@pytest.mark.parametrize("context", [1, 63, 64, 65, 200])
def test_context_knob_gives_every_sequence_its_own_pages_of_that_length(context):
    from references.mla import mla_decode_attn, paged_cache_read
    from verify.bench.shapes import Shape, build_inputs, case_for, take_batch

    op = get_op("mla_decode_attn")
    shape = Shape("mla_decode_attn", 1, 3, (("context", context), ("q_per_seq", 1)))
    inputs = build_inputs(op, case_for(op, shape, 3))
    t = inputs.tensors
    page = t["cache"].shape[1]
    assert t["seq_lens"].tolist() == [context] * 3 and t["cache"].dtype == t["q_abs"].dtype
    pages = t["block_table"].flatten().tolist()
    assert len(set(pages)) == len(pages) == 3 * -(-context // page)        # no page shared between sequences
    rows = [paged_cache_read(t["cache"], t["block_table"][b], context) for b in range(3)]
    assert all(r.shape[0] == context for r in rows) and not torch.equal(rows[0], rows[1])
    assert 0.5 < float(t["cache"].float().std()) < 2.0
    one = take_batch(op, inputs, 1)                    # a smaller batch reads the first sequence's pages
    assert torch.equal(mla_decode_attn(**one.tensors, **one.params)[0],
                       mla_decode_attn(**inputs.tensors, **inputs.params)[0])


def test_every_declared_knob_set_names_knobs_its_builder_reads():
    from verify.bench.shapes import builder_knobs, knob_error
    from verify.ops.registry import all_ops

    for op in all_ops().values():
        for knobs in (*op.bench_knobs, *op.knob_sweep):
            assert knob_error(op, knobs) is None, (op.name, knobs)
    assert "q_per_seq" in builder_knobs(get_op("mla_decode_attn"))
    assert "proj" in builder_knobs(get_op("skinny_gemm")) and "q_per_seq" not in builder_knobs(get_op("skinny_gemm"))


def test_context_shorter_than_the_draft_is_refused():
    from verify.bench.shapes import Shape, build_inputs, case_for

    op = get_op("mla_decode_attn")
    with pytest.raises(ValueError, match="shorter than the 6 query tokens"):
        build_inputs(op, case_for(op, Shape("mla_decode_attn", 1, 2, (("context", 4), ("q_per_seq", 6))), 2))


def test_peer_check_compares_ids_as_sets_and_weights_in_their_order():
    from verify.bench import peer_check

    ids, w = torch.tensor([[3, 1, 2]]), torch.tensor([[0.5, 0.3, 0.2]])
    assert peer_check.compare((ids, w), (ids[:, [1, 0, 2]], w[:, [1, 0, 2]])).startswith("ok")
    assert peer_check.compare((ids, w), (torch.tensor([[3, 1, 4]]), w)) == "DIFFERS: ids differ in 1 of 1 rows"
    assert peer_check.compare(torch.ones(2, 3), torch.ones(3, 2)).startswith("DIFFERS: outputs")
    assert peer_check.compare(torch.ones(2, 3), torch.full((2, 3), float("nan"))).startswith("DIFFERS")


def test_fla_peers_say_what_is_missing(monkeypatch):
    from verify.bench import peers

    monkeypatch.setitem(sys.modules, "fla", None)
    with pytest.raises(ImportError, match="fla-core"):
        peers._fla()


# ------------------------------------------------------------------------------------ records
def _record(rows):
    class G:
        certificate, refused, absent = None, [{"op": "b", "candidate": "fused", "state": "fail", "reason": "x"}], []
    return output.record({"device": "cuda", "gpu": "H200"}, ["bench"], {}, G(),
                         {"rows": rows, "not_reached": [], "notes": {}},
                         score.summary(rows, ["fused"], {"fused": {"a"}}))


def test_record_roundtrip_table_and_html(tmp_path):
    from rich.console import Console

    from verify.bench import html

    rows = [_row("a", "T=1 B=1", 1.0, 2.5, peer=1.6), _row("a", "T=1 B=2", 1.2, 2.5, peer=1.0)]
    for r, b in zip(rows, (1, 2)):
        r.update(tp=1, batch=b, knobs={})
    rec = _record(rows)
    path = output.write(rec, tmp_path)
    assert output.load(path) == json.loads(json.dumps(rec)) and output.is_bench(path)
    console = Console(record=True, width=200)
    output.print_report(console, rec, path)
    text = console.export_text()
    assert "met" in text and "miss" in text and "refused" in text and "score fused" in text
    page = html.page(rec)
    assert "data:image/png;base64," in page and "Speed (verify-kernels bench)" in page


def test_load_refuses_a_certificate(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"format": "verify-kernels/certificate/v1", "rows": []}))
    with pytest.raises(ValueError, match="is not 'verify-kernels/bench/v1'"):
        output.load(p)


def test_speed_diff_flags_slowdowns_beyond_the_spread():
    old = {"rows": [{"op": "a", "shape": "B=1", "timings": {"fused": {"median_us": 10.0, "p10_us": 9.8, "p90_us": 10.2},
                                                             "eager": {"median_us": 50.0, "p10_us": 40, "p90_us": 60}},
                     "judged": {"fused": {"verdict": "met"}}, "candidates": ["fused"]}]}
    new = json.loads(json.dumps(old))
    new["rows"][0]["timings"]["fused"] = {"median_us": 11.0, "p10_us": 10.9, "p90_us": 11.1}
    new["rows"][0]["timings"]["eager"] = {"median_us": 54.0, "p10_us": 45, "p90_us": 66}     # within its spread
    new["rows"][0]["judged"]["fused"]["verdict"] = "miss"
    ch = speed_diff.speed_diff(old, new)
    assert [(c.entry, c.kind) for c in ch] == [("fused", "regression"), ("fused", "verdict")]
    assert speed_diff.regressions(ch, {"fused"}) and not speed_diff.regressions(ch, {"eager"})
    assert speed_diff.speed_diff(new, old)[0].kind == "improvement"
    assert "SPEED REGRESSIONS" in speed_diff.render_text(ch)


# ------------------------------------------------------------------------------------ CLI
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "100", "CUDA_VISIBLE_DEVICES": ""}, timeout=120)


def test_bench_without_a_gpu_exits_2_with_one_line():
    r = _cli("bench", "--ops", "router_topk")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "verify-kernels bench: needs a CUDA device (torch.cuda.is_available() is False)"]


@pytest.mark.parametrize("args, words", [
    (["--tp", "x"], "--tp 'x': not a comma-separated list"),
    (["--batch", "0"], "--batch '0': needs integers of 1 or more"),
    (["--ops", "nope"], "unknown op 'nope'"),
    (["--candidate", "weird"], "--candidate 'weird'"),
    (["--certificate", "/nonexistent/c.json"], "--certificate /nonexistent/c.json: no such file"),
    (["--time-budget", "0"], "--time-budget 0"),
    (["--peer", "moe_experts_mxfp4=verify.bench.peers:x"], "expected OP:NAME=MODULE:ATTR"),
    (["--ops", "router_topk", "--peer", "moe_experts_mxfp4:p=m:f"], "op 'moe_experts_mxfp4' is not among"),
    (["--ops", "router_topk", "--peer", "router_topk:cublas_logits=m:f"], "already has a peer named 'cublas_logits'"),
    (["--ops", "mla_decode_attn", "--knobs", "mla_decode_attn"], "expected OP:K=V[,K=V]"),
    (["--ops", "mla_decode_attn", "--knobs", "mla_decode_attn:context"], "expected OP:K=V[,K=V]"),
    (["--ops", "router_topk", "--knobs", "mla_decode_attn:context=8"], "op 'mla_decode_attn' is not among"),
    (["--ops", "mla_cache_write", "--knobs", "mla_cache_write:context=8"], "a paged attention op's knob"),
    (["--ops", "mla_decode_attn", "--knobs", "mla_decode_attn:context=0"], "needs 1 or more slots"),
    (["--ops", "mla_decode_attn", "--knobs", "mla_decode_attn:contxt=8"], "read no knob 'contxt'"),
    (["--out", "property_tests/planted_release"], None),
])
def test_bench_bad_usage_is_one_line(args, words, tmp_path):
    if words is None:            # a run's certificate in --out: the quick certification would replace it
        (tmp_path / "certificate.json").write_text(json.dumps({"format": "verify-kernels/certificate/v1",
                                                               "options": {"profile": "release"}}))
        args, words = ["--out", str(tmp_path)], "holds a certificate of `verify-kernels run`"
    r = _cli("bench", *args)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_diff_of_two_bench_records(tmp_path):
    rows = [_row("a", "T=1 B=1", 1.0, 2.5)]
    rows[0].update(tp=1, batch=1, knobs={})
    old = _record(rows)
    new = json.loads(json.dumps(old))
    new["rows"][0]["timings"]["fused"] = {"median_us": 2.0, "p10_us": 1.9, "p90_us": 2.1}
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    a, b = output.write(old, tmp_path / "old"), output.write(new, tmp_path / "new")
    r = _cli("diff", str(a), str(b))
    assert r.returncode == 1 and "SPEED REGRESSIONS (1)" in r.stdout and "[fused]" in r.stdout
    assert _cli("diff", str(a), str(a)).returncode == 0


def test_report_includes_the_bench_section_beside_its_certificate(tmp_path):
    from verify.record import certificate
    from verify.model.verdict import OpVerdict

    cert = certificate.build([OpVerdict("mla_cache_write", "fused", "pass", 4, 4)], all_ops(), {"profile": "quick"},
                             "cuda")
    path = certificate.write(cert, tmp_path)
    r = _cli("report", str(path), "-o", str(tmp_path / "plain.html"))
    assert r.returncode == 0 and "verify-kernels bench" not in (tmp_path / "plain.html").read_text()
    rows = [_row("mla_cache_write", "T=1 B=1", 1.0, 9.0)]
    rows[0].update(tp=1, batch=1, knobs={})
    output.write(_record(rows), tmp_path)
    r = _cli("report", str(path), "-o", str(tmp_path / "with.html"))
    page = (tmp_path / "with.html").read_text()
    assert r.returncode == 0 and "Speed (verify-kernels bench)" in page and "mla_cache_write: us against batch" in page


def test_diff_of_two_certificates_shows_the_speed_of_the_bench_records_beside_them(tmp_path):
    from verify.record import certificate
    from verify.model.verdict import OpVerdict

    rows = [_row("a", "T=1 B=1", 1.0, 2.5)]
    rows[0].update(tp=1, batch=1, knobs={})
    old = _record(rows)
    new = json.loads(json.dumps(old))
    new["rows"][0]["timings"]["fused"] = {"median_us": 2.0, "p10_us": 1.9, "p90_us": 2.1}
    paths = []
    for name, rec in (("old", old), ("new", new)):
        d = tmp_path / name
        cert = certificate.build([OpVerdict("mla_cache_write", "fused", "pass", 4, 4)], all_ops(), {}, "cuda")
        paths.append(str(certificate.write(cert, d)))
        output.write(rec, d)
    r = _cli("diff", *paths)
    assert r.returncode == 1 and "SPEED REGRESSIONS (1)" in r.stdout
    r = _cli("diff", *paths, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["speed"][0]["kind"] == "regression"


def test_ncu_child_keeps_the_command_with_its_own_out():
    from verify.bench import profile

    argv = ["bench", "--ops", "router_topk", "--out", "x", "--profile-kernels", "ncu"]
    assert profile._with_out(argv, "x/profile") == ["bench", "--ops", "router_topk", "--profile-kernels", "ncu",
                                                    "--out", "x/profile"]


def test_variants_are_timed_beside_the_dispatchers_pick_and_the_slower_picks_are_named(tmp_path):
    """--variants: each declared launch variant timed on the same sets, unjudged; the row names the
    fastest and the dispatcher's ratio to it; the report lists picks over SLOWER_PICK x the fastest."""
    import io

    from rich.console import Console

    from property_tests.user_kernels import gemm_variants as gv
    from verify.bench.shapes import Shape

    op, rows = get_op("skinny_gemm"), []
    for b in (2, 16):
        inputs = op.make_inputs(Case("skinny_gemm", 0, b, "tiny", "bfloat16", "normal"))
        allowed = {"fused": gv.skinny_gemm}
        rows.append(run.bench_shape(op, Shape("skinny_gemm", 1, b), inputs, {"fused": run._op_launch(gv.skinny_gemm)},
                                    {}, ["fused"], FakeClock(), "cpu", timing_kw=FAST,
                                    variants=run.variant_makers(allowed, inputs)))
    assert set(rows[0]["variant_timings"]) == {"fused@m1", "fused@m8", "fused@m64"}
    assert list(rows[0]["timings"]) == ["fused"] and list(rows[0]["judged"]) == ["fused"]   # variants unjudged
    v2, v16 = rows[0]["variants"]["fused"], rows[1]["variants"]["fused"]
    assert v2["fastest"] == "m8" and v2["timed"] == 3
    assert v2["dispatcher_over_fastest"] == pytest.approx(0.004 / 0.0015, rel=0.01)    # m1 picked at M = 2
    assert v16["fastest"] == "m8" and v16["dispatcher_over_fastest"] == pytest.approx(0.002 / 0.0015, rel=0.01)
    rec = {"rows": rows, "refused": [], "absent": [], "scores": {}, "not_reached": []}
    buf = io.StringIO()
    output.print_report(Console(file=buf, width=300), rec, tmp_path / "bench.json")
    text = buf.getvalue()
    assert "variant skinny_gemm T=1 B=2 fused: dispatcher" in text and "fastest of 3 variants m8" in text
    assert "variants: at 0 of 2 shapes the dispatcher's pick is within 1.05x of the fastest" in text
    md = output.markdown(rec | {"created": "x"})
    assert "| skinny_gemm | T=1 B=16 | fused |" in md and "| m8 |" in md


def test_variants_of_a_module_that_declares_none_add_nothing():
    op = get_op("skinny_gemm")
    inputs = op.make_inputs(Case("skinny_gemm", 0, 2, "tiny", "bfloat16", "normal"))
    from property_tests.user_kernels import gemm_ok

    assert run.variant_makers({"mine": gemm_ok.skinny_gemm, "eager": gemm_ok.skinny_gemm}, inputs) == {}


# ---------------------------------------------------------------------------------------------- overlap
def test_overlap_counts_the_time_another_stream_covers():
    from verify.bench.overlap import Interval, summarize

    s = summarize([Interval("routed", 7, 0, 10), Interval("shared", 13, 2, 6), Interval("shared", 13, 8, 14),
                   Interval("norm", 7, 14, 16)])
    assert s["span_us"] == 16 and s["streams"] == {7: 12, 13: 10}
    assert s["concurrent_us"] == 6                     # [2, 6) and [8, 10); touching at 14 is not overlap
    k = {(r["name"], r["stream"]): r for r in s["kernels"]}
    assert k[("routed", 7)]["overlapped_us"] == 6 and k[("shared", 13)] == {
        "name": "shared", "stream": 13, "calls": 2, "us": 10, "overlapped_us": 6}
    assert k[("norm", 7)]["overlapped_us"] == 0        # the same stream's work never counts


def test_overlap_of_three_streams_counts_each_instant_once():
    from verify.bench.overlap import Interval, summarize

    s = summarize([Interval("a", 1, 0, 10), Interval("b", 2, 0, 10), Interval("c", 3, 5, 20)])
    assert s["concurrent_us"] == 10 and s["span_us"] == 20
    assert {r["name"]: r["overlapped_us"] for r in s["kernels"]} == {"a": 10, "b": 10, "c": 5}


def test_overlap_reads_the_device_events_of_a_chrome_trace():
    from verify.bench.overlap import Interval, device_intervals

    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10.5, "dur": 4, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 12, "dur": 1, "args": {"stream": 20}},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 2, "dur": 0.5, "args": {"stream": 7}}]}
    assert device_intervals(trace) == [Interval("Memset", 7, 2, 2.5, "gpu_memset"), Interval("gemm", 7, 10.5, 14.5),
                                       Interval("Memcpy DtoD", 20, 12, 13, "gpu_memcpy")]


def test_stream_overlap_reads_a_torch_profile():
    """torch.profiler's trace through the summary: on a CPU the profiled pass has no device work."""
    from torch.profiler import ProfilerActivity, profile

    from verify.bench.profile import stream_overlap

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    assert stream_overlap(prof).startswith("span 0.0 us; two or more streams busy 0.0 us")


def test_peer_check_says_how_many_rows_differ_and_how_close_the_rest_are():
    """A layer step whose router chose another top-k for a few tokens differs in those rows only: the
    note counts them (rows along the last dim, every leading dim flattened) and bounds the rest."""
    from verify.bench import peer_check

    ref = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(0))
    peer = ref.clone()
    peer[0, [5, 40]] += 1.0
    note = peer_check.compare(ref, peer)
    assert note.startswith("DIFFERS") and " in 2 of 64 rows (the others <= 0)" in note, note
    everywhere = peer_check.compare(ref, -ref)
    assert " in 64 of 64 rows" in everywhere and "others" not in everywhere, everywhere
    assert "rows" not in peer_check.compare(ref, ref * 1.001)
