"""Speculative decoding through KDA (references/kda_spec.py): the verify step over n_q draft tokens and
the accept that commits each sequence's accepted prefix, held to the contract every rollback design
must show its caller:

- a sequence's outputs and checkpoints are those of its tokens run one kda_decode launch each,
  whatever the other sequences verify (ragged n_tokens), bit for bit (here against the reference
  op; the harness will hold other candidates to kda_decode's class against the float64 oracle);
- verify leaves the committed state alone; accept of a commits the state after a tokens, bit for bit,
  and accept of 0 leaves it unchanged;
- nothing in the checkpoint slots at or past the accepted length reaches the committed state;
- many steps with random accept lengths end in the state of the accepted tokens run one by one.

`contract_violations` checks one (verify, accept) pair against those, and the planted designs below
(accept off by one, the conv state committed without the recurrent one, checkpoints written before
the token's update, one sequence's accept length applied to its neighbour) must each break it.
CPU, tiny and small configs.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from references.kda import kda_decode  # noqa: E402
from references.kda_spec import kda_accept, kda_verify  # noqa: E402
from verify.model.case import Case  # noqa: E402
from verify.ops.kda import make_kda_decode_inputs  # noqa: E402

TOKEN = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
LAYER = ("conv_w", "A_log", "dt_bias", "o_norm_w")


def draft(config: str, dtype: str, batch: int, n_q: int, seed: int) -> dict:
    """A verify step's tensors: the committed state and layer weights of `seed`'s kda_decode case, and
    n_q tokens per sequence drawn as the token inputs of seeds seed+1..seed+n_q."""
    base = Case(op="kda_decode", seed=seed, batch=batch, config=config, dtype=dtype)
    first = make_kda_decode_inputs(base)
    steps = [make_kda_decode_inputs(replace(base, seed=seed + 1 + t)).tensors for t in range(n_q)]
    t = {k: torch.stack([s[k] for s in steps], dim=1) for k in TOKEN}
    t.update({k: first.tensors[k] for k in LAYER + ("conv_state", "state")})
    return {"tensors": t, "params": dict(first.params)}


def checkpoints(d: dict, poison: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint buffers the caller owns, NaN-poisoned: a slot nobody writes stays NaN."""
    t, n_q = d["tensors"], d["tensors"]["q_raw"].shape[1]
    conv = torch.full((t["state"].shape[0], n_q) + tuple(t["conv_state"].shape[1:]), float("nan") if poison else 0.0,
                      dtype=t["conv_state"].dtype)
    state = torch.full((t["state"].shape[0], n_q) + tuple(t["state"].shape[1:]), float("nan") if poison else 0.0,
                       dtype=t["state"].dtype)
    return conv, state


def run_verify(verify, d: dict, n_tokens: torch.Tensor):
    t = {k: v.clone() for k, v in d["tensors"].items()}
    conv_ckpt, state_ckpt = checkpoints(d)
    y = verify(**{k: t[k] for k in TOKEN}, n_tokens=n_tokens, conv_w=t["conv_w"], conv_state=t["conv_state"],
               A_log=t["A_log"], dt_bias=t["dt_bias"], o_norm_w=t["o_norm_w"], state=t["state"],
               conv_ckpt=conv_ckpt, state_ckpt=state_ckpt, **d["params"])
    return y, t, conv_ckpt, state_ckpt


def alone(d: dict, b: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Sequence b's first n tokens, one kda_decode launch each, with no draft, no mask and no rollback:
    its outputs and (conv, recurrent) state after every token. Each launch runs the whole batch (row
    b's bits do not depend on the other rows' values, but a CPU reduction's may on the batch's size),
    and only row b is kept."""
    t = d["tensors"]
    cs, s = t["conv_state"].clone(), t["state"].clone()
    ys, css, ss = [], [], []
    for i in range(n):
        ys.append(kda_decode(*(t[k][:, i] for k in TOKEN), t["conv_w"], cs, t["A_log"], t["dt_bias"],
                             t["o_norm_w"], s, **d["params"])[b])
        css.append(cs[b].clone())
        ss.append(s[b].clone())
    return ys, css, ss


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def contract_violations(verify, accept, d: dict, n_tokens: torch.Tensor, accepted: torch.Tensor) -> list[str]:
    """What the (verify, accept) pair does that the contract forbids, on one step; [] if nothing."""
    out = []
    y, t, conv_ckpt, state_ckpt = run_verify(verify, d, n_tokens)
    if not (_same(t["conv_state"], d["tensors"]["conv_state"]) and _same(t["state"], d["tensors"]["state"])):
        out.append("verify changed the committed state")
    runs = [alone(d, b, int(n_tokens[b])) for b in range(n_tokens.shape[0])]   # accepted <= n_tokens
    for b, (ys, css, ss) in enumerate(runs):
        n = int(n_tokens[b])
        for i in range(n):
            if not _same(y[b, i], ys[i]):
                out.append(f"sequence {b} token {i}: output differs from the token run alone")
            if not (_same(conv_ckpt[b, i], css[i]) and _same(state_ckpt[b, i], ss[i])):
                out.append(f"sequence {b} token {i}: checkpoint differs from the state after the token run alone")
        if bool(y[b, n:].any()):
            out.append(f"sequence {b}: output in the slots past its {n} tokens")
        if n < conv_ckpt.shape[1] and not bool(state_ckpt[b, n:].isnan().all()):
            out.append(f"sequence {b}: checkpoint written past its {n} tokens")
    # poison every slot at or past the accepted length: none of it may reach the committed state
    for b in range(n_tokens.shape[0]):
        conv_ckpt[b, int(accepted[b]):] = float("nan")
        state_ckpt[b, int(accepted[b]):] = float("nan")
    accept(accepted, n_tokens, t["conv_state"], t["state"], conv_ckpt, state_ckpt)
    for b in range(n_tokens.shape[0]):
        a = int(accepted[b])
        want_cs, want_s = ((d["tensors"]["conv_state"][b], d["tensors"]["state"][b]) if a == 0
                           else (runs[b][1][a - 1], runs[b][2][a - 1]))
        if not _same(t["conv_state"][b], want_cs):
            out.append(f"sequence {b}: committed conv state is not the one after its {a} accepted tokens")
        if not _same(t["state"][b], want_s):
            out.append(f"sequence {b}: committed recurrent state is not the one after its {a} accepted tokens")
    return out


@settings(max_examples=12, deadline=None, derandomize=True)
@given(config=st.sampled_from(["tiny", "small"]), dtype=st.sampled_from(["bfloat16", "float32"]),
       batch=st.integers(1, 4), n_q=st.integers(1, 8), seed=st.integers(0, 2**20), data=st.data())
def test_the_reference_meets_the_contract(config, dtype, batch, n_q, seed, data):
    d = draft(config, dtype, batch, n_q, seed)
    n_tokens = torch.tensor(data.draw(st.lists(st.integers(1, n_q), min_size=batch, max_size=batch)), dtype=torch.int32)
    accepted = torch.tensor([data.draw(st.integers(0, int(n))) for n in n_tokens], dtype=torch.int32)
    assert contract_violations(kda_verify, kda_accept, d, n_tokens, accepted) == []


def test_accepting_nothing_leaves_the_state_bitwise_and_everything_commits_the_last_checkpoint():
    d = draft("tiny", "bfloat16", 3, 6, 11)
    n_tokens = torch.tensor([6, 2, 4], dtype=torch.int32)
    for accepted in ([0, 0, 0], [6, 2, 4]):
        assert contract_violations(kda_verify, kda_accept, d, n_tokens, torch.tensor(accepted, dtype=torch.int32)) == []


def test_many_steps_with_random_accept_lengths_track_the_accepted_tokens_run_one_by_one():
    """64 verify+accept steps, accept lengths drawn each step: the committed state equals the one of
    the accepted tokens run one kda_decode launch each, bit for bit (the rejected drafts leave no trace)."""
    gen = torch.Generator().manual_seed(5)
    d = draft("tiny", "bfloat16", 2, 4, 3)
    t = {k: v.clone() for k, v in d["tensors"].items()}
    cs, s = t["conv_state"].clone(), t["state"].clone()                  # the one-by-one run's state
    for step in range(64):
        nd = draft("tiny", "bfloat16", 2, 4, 1000 + 10 * step)          # this step's draft tokens
        for k in TOKEN:
            t[k] = nd["tensors"][k]
        n_tokens = torch.randint(1, 5, (2,), generator=gen, dtype=torch.int32)
        accepted = torch.minimum(torch.randint(0, 5, (2,), generator=gen, dtype=torch.int32), n_tokens)
        conv_ckpt, state_ckpt = checkpoints({"tensors": t})
        kda_verify(**{k: t[k] for k in TOKEN}, n_tokens=n_tokens, conv_w=t["conv_w"], conv_state=t["conv_state"],
                   A_log=t["A_log"], dt_bias=t["dt_bias"], o_norm_w=t["o_norm_w"], state=t["state"],
                   conv_ckpt=conv_ckpt, state_ckpt=state_ckpt, **d["params"])
        kda_accept(accepted, n_tokens, t["conv_state"], t["state"], conv_ckpt, state_ckpt)
        for b in range(2):                     # sequence b's accepted tokens, whole-batch launches, row b kept
            cs_b, s_b = cs.clone(), s.clone()
            for i in range(int(accepted[b])):
                kda_decode(*(t[k][:, i] for k in TOKEN), t["conv_w"], cs_b, t["A_log"], t["dt_bias"],
                           t["o_norm_w"], s_b, **d["params"])
            cs[b], s[b] = cs_b[b], s_b[b]
    assert torch.equal(t["state"], s) and torch.equal(t["conv_state"], cs)
    assert not torch.equal(s, d["tensors"]["state"])                    # the state did move


# ---- planted rollback bugs: each must break the contract ----------------------------------------

# the planted rollback functions of the spec-decode catalogue (property_tests/planted/kda_spec.py)
from property_tests.planted.kda_spec import (  # noqa: E402
    _accept_conv_only as accept_conv_only, _accept_neighbours_length as accept_shifted_lengths,
    _accept_off_by_one as accept_off_by_one, _verify_checkpoints_before_update as verify_checkpoints_before_update)


@pytest.mark.parametrize("verify, accept, words", [
    (kda_verify, accept_off_by_one, "not the one after its"),
    (kda_verify, accept_conv_only, "committed recurrent state"),
    (kda_verify, accept_shifted_lengths, "not the one after its"),
    (verify_checkpoints_before_update, kda_accept, "checkpoint differs"),
])
def test_planted_rollback_bugs_break_the_contract(verify, accept, words):
    d = draft("tiny", "bfloat16", 3, 5, 21)
    n_tokens = torch.tensor([5, 3, 4], dtype=torch.int32)
    accepted = torch.tensor([2, 3, 0], dtype=torch.int32)
    bad = contract_violations(verify, accept, d, n_tokens, accepted)
    assert any(words in x for x in bad), bad


@pytest.mark.parametrize("n_tokens, accepted, words", [
    ([0, 2], None, "n_tokens: sequence 0 verifies 0 tokens; expected 1..4"),
    ([5, 2], None, "n_tokens: sequence 0 verifies 5 tokens"),
    ([3, 2], [1, 3], "accepted: sequence 1 accepts 3 tokens of the 2 it verified"),
    ([3, 2], [-1, 0], "accepted: sequence 0 accepts -1 tokens"),
])
def test_counts_out_of_range_are_one_line_errors(n_tokens, accepted, words):
    d = draft("tiny", "float32", 2, 4, 1)
    n = torch.tensor(n_tokens, dtype=torch.int32)
    if accepted is None:
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            run_verify(kda_verify, d, n)
        return
    _, t, conv_ckpt, state_ckpt = run_verify(kda_verify, d, n)
    with pytest.raises(ValueError, match=words):
        kda_accept(torch.tensor(accepted, dtype=torch.int32), n, t["conv_state"], t["state"], conv_ckpt, state_ckpt)
