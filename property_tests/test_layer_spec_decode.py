"""Speculative decoding through a whole KDA or MLA layer (references/layers_spec.py) under the layer contract
(verify/spec_decode/layer.py): the reference layer is decode_steps one token at a time bit for bit and meets
every property over 64 steps; a non-reference KDA design inside it meets them too; every planted layer bug
(property_tests/planted/layers_spec.py) is named by each property it breaks while its correct twin passes;
`verify-kernels spec-decode --layer` prints the verdicts. CPU, single-threaded (small GEMVs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from property_tests.planted.layers_spec import LAYER_SPEC_CATALOGUE
from references.config import TINY
from references.kda_spec_cache import KdaInputCache
from references.layers import decode_steps, new_layer_state
from references.layers_spec import SpecLayer
from references.weights import make_layer_weights
from verify.spec_decode.layer import LayerDrive, check_layer_contract, committed_rows, poison_cache, reference_layer

ROOT = Path(__file__).resolve().parent.parent
PLANTED = "property_tests.planted.layers_spec"


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _failed(report) -> set[str]:
    return {p for p, t in report.tally.items() if t.violations}


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_the_reference_layer_meets_the_contract_over_64_steps(kind):
    report = check_layer_contract(reference_layer(), LayerDrive(kind=kind, config="tiny", batch=2, steps=64, seed=1))
    assert report.ok, "\n".join(map(str, report.violations))
    assert report.steps_run == 64
    for p in ("prefix", "accept-zero", "growth", "poison"):
        assert report.tally[p].checks > 0, f"{p} was never checked"
    # the reference is decode_steps' arithmetic, so it sits on the baseline: at most 1/k of every bound
    # (1/2 for kda_layer's conv_state, k = 2; 1/4 for the rest)
    assert report.tally["growth"].worst_ratio <= (0.5 if kind == "kda" else 0.25) + 1e-9


@pytest.mark.parametrize("kind, layer_idx", [("kda", 13), ("kda", 12), ("mla", 15)])
def test_verify_then_accept_is_decode_steps_one_token_at_a_time_bit_for_bit(kind, layer_idx):
    """Ragged drafts (5, 2, 4 of 5 slots), accepted 3, 0, 4: each accepted token's output and the committed
    state are those of the same tokens stepped by decode_steps, each with its own blocks (layer 12 pushes a
    block: the push goes into the token's own copy)."""
    w = make_layer_weights(kind, TINY, 3)
    B, n_q = 3, 5
    state = new_layer_state(kind, TINY, B, 64, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    if kind == "kda":
        state.conv_state.copy_(torch.randn(state.conv_state.shape, generator=g))
        state.recurrent_state.copy_(torch.randn(state.recurrent_state.shape, generator=g))
    else:
        state.cache.copy_(torch.randn(state.cache.shape, generator=g))
        state.seq_lens.copy_(torch.tensor([0, 5, 9]))
    x = torch.randn(B, n_q, TINY.hidden, generator=g).bfloat16()
    blocks = torch.randn(B, n_q, 8, TINY.hidden, generator=g).bfloat16()
    n_tokens, accepted = torch.tensor([5, 2, 4]), torch.tensor([3, 0, 4])
    layer = SpecLayer(kind, w, layer_idx)
    layer.begin(state.clone(), n_q)
    out = layer.verify(x, blocks, n_tokens)
    layer.accept(accepted)
    got = layer.committed()

    ref, outs, after = state.clone(), [], [state.clone()]
    for t in range(n_q):
        ref.blocks = blocks[:, t].clone()
        outs.append(decode_steps(kind, w, ref, x[:, t].unsqueeze(0), layer_idx)[0])
        after.append(ref.clone())
    for b in range(B):
        a = int(accepted[b])
        for t in range(a):
            assert torch.equal(out[b, t], outs[t][b]), f"sequence {b} token {t}"
        assert not out[b, int(n_tokens[b]):].any(), f"sequence {b}: a slot past n_tokens has an output"
        want = after[a]
        if kind == "kda":
            assert torch.equal(got["conv_state"][b], want.conv_state[b])
            assert torch.equal(got["recurrent_state"][b], want.recurrent_state[b])
        else:
            assert int(got["seq_lens"][b]) == int(want.seq_lens[b])
    if kind == "mla":
        one = torch.ones(B, dtype=torch.bool)
        assert torch.equal(committed_rows("mla", got, state.block_table, got["seq_lens"], one, "cache"),
                           committed_rows("mla", {"cache": after[-1].cache}, state.block_table, got["seq_lens"], one,
                                          "cache"))


def test_the_mla_draft_attention_has_the_same_shapes_however_many_tokens_a_step_drafts(monkeypatch):
    """The prefix property compares a step of n_tokens drafts with the same layer run on the accepted ones
    alone, bit for bit: every mla_decode_attn call of a verify holds one query token, whose length is
    its own, so no sum changes shape with the draft (a multi-query call over the draft failed it on the
    H200: torch's CUDA GEMMs pick their kernel by the row count). Ragged 5 / 2 / 4 drafts."""
    import references.layers_spec as LS

    calls = []
    real = LS.mla_decode_attn

    def recording(q_abs, cache, block_table, seq_lens, *rest):
        calls.append((q_abs.shape[1], seq_lens.tolist()))
        return real(q_abs, cache, block_table, seq_lens, *rest)

    monkeypatch.setattr(LS, "mla_decode_attn", recording)
    w = make_layer_weights("mla", TINY, 3)
    B, n_q = 3, 5
    state = new_layer_state("mla", TINY, B, 64, torch.bfloat16)
    state.seq_lens.copy_(torch.tensor([0, 5, 9]))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, n_q, TINY.hidden, generator=g).bfloat16()
    blocks = torch.randn(B, n_q, 8, TINY.hidden, generator=g).bfloat16()
    layer = SpecLayer("mla", w, 3)
    layer.begin(state, n_q)
    layer.verify(x, blocks, torch.tensor([5, 2, 4]))
    assert {q for q, _ in calls} == {1}, calls
    lengths = sorted(n for _, lens in calls for n in lens)
    assert lengths == sorted([1, 2, 3, 4, 5] + [6, 7] + [10, 11, 12, 13]), calls


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_the_reference_layer_meets_the_contract_at_small(kind):
    report = check_layer_contract(reference_layer(), LayerDrive(kind=kind, config="small", batch=2, steps=4, seed=3))
    assert report.ok, "\n".join(map(str, report.violations))


def test_a_non_reference_design_runs_inside_the_kda_layer_and_passes():
    """The input-cache design (references.kda_spec_cache, window 3: write-backs within the drive)."""
    report = check_layer_contract(reference_layer(lambda: KdaInputCache(3)),
                                  LayerDrive(kind="kda", config="tiny", batch=2, steps=12, seed=5))
    assert report.ok, "\n".join(map(str, report.violations))
    assert report.tally["poison"].checks > 0


@pytest.mark.parametrize("name, kind, must, what", LAYER_SPEC_CATALOGUE, ids=[r[0] for r in LAYER_SPEC_CATALOGUE])
def test_planted_layer_bugs_are_named_by_each_property_they_break(name, kind, must, what):
    import property_tests.planted.layers_spec as planted

    report = check_layer_contract(getattr(planted, name), LayerDrive(kind=kind, config="tiny", batch=3, steps=6,
                                                                     seed=2))
    assert must <= _failed(report), f"{what}: expected {sorted(must)}, got {sorted(_failed(report))}"
    assert not report.tally["run"].violations, report.violations
    for v in report.violations:         # each message says where and by how much (or which experts)
        assert f"step {v.step}" in str(v) and any(w in v.message for w in ("err/tol", "differ bitwise", "tie band"))


def test_the_planted_attention_with_the_right_mask_passes():
    """mla_draft_sees_next_draft's machinery (its own multi-query attention) with the right mask: the shift
    is the bug, not the rewrite."""
    import property_tests.planted.layers_spec as planted

    report = check_layer_contract(planted.mla_attend_control, LayerDrive(kind="mla", config="tiny", batch=3, steps=6,
                                                                         seed=2))
    assert report.ok, "\n".join(map(str, report.violations))


def test_poison_cache_hits_exactly_the_positions_past_start_in_each_sequences_pages():
    cache = torch.zeros(5, 4, 3)
    table = torch.tensor([[3, 0, -1], [1, 4, -1]], dtype=torch.int32)      # page 2 belongs to nobody
    poison_cache(cache, table, torch.tensor([5, 0]))
    flat = cache.view(-1, 3)
    dead = {int(p) for p in torch.nonzero(torch.isnan(flat[:, 0])).flatten()}
    assert dead == {0 * 4 + 1, 0 * 4 + 2, 0 * 4 + 3} | {1 * 4 + i for i in range(4)} | {4 * 4 + i for i in range(4)}
    assert not torch.isnan(cache[2]).any() and not torch.isnan(cache[3]).any()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "verify.cli", "spec-decode", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "100"}, timeout=300)


def test_cli_layer_passes_the_reference_and_fails_a_planted_kda_design_with_a_repro():
    ok = _cli("--layer", "mla", "--steps", "3", "--batch", "2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("PASS ") == 4 and "mla_layer meets the contract over 3 steps" in ok.stdout
    bad = _cli("--layer", "kda", "--design", "property_tests.planted.kda_spec:accept_conv_only", "--steps", "3",
               "--batch", "2")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL accept-zero" in bad.stdout and "kda_layer with property_tests.planted.kda_spec:accept_conv_only" \
        in bad.stdout
    assert "repro: verify-kernels spec-decode --layer kda --design property_tests.planted.kda_spec:accept_conv_only" \
        in bad.stdout


@pytest.mark.parametrize("args, words", [
    (["--layer", "mla", "--design", "checkpoints"], "--design 'checkpoints': --layer mla has no KDA rollback design"),
    (["--layer", "gqa"], "invalid choice: 'gqa'"),
    (["--layer", "kda", "--design", "nope"], "--design 'nope' is unknown"),
])
def test_layer_bad_usage_is_one_line_and_exit_2(args, words, capsys):
    from verify.cli import main

    try:
        rc = main(["spec-decode", *args])
    except SystemExit as e:
        rc = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and words in lines[0], lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("design", ["checkpoints:fused.kda_verify", "fused.kda_verify_cache:KdaInputCacheFused"])
def test_the_fused_kda_designs_meet_the_layer_contract_on_gpu(design):
    from verify.spec_decode.design import resolve_design

    report = check_layer_contract(reference_layer(resolve_design(design, "cuda")),
                                  LayerDrive(kind="kda", config="small", batch=4, steps=64, device="cuda"))
    assert report.ok, "\n".join(map(str, report.violations))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_mla_layer_meets_the_contract_on_gpu():
    report = check_layer_contract(reference_layer(), LayerDrive(kind="mla", config="small", batch=4, steps=64,
                                                                device="cuda"))
    assert report.ok, "\n".join(map(str, report.violations))
