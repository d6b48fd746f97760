"""Planted rollback bugs in speculative-decoding designs through KDA (verify/spec_decode): each is a
design factory (`verify-kernels spec-decode --design property_tests.planted.kda_spec:NAME`) and the
contract property that must reject it. Their correct twins: `checkpoints`, `one-token`, `input-cache`.

SPEC_DECODE_CATALOGUE rows: (factory name, property that must name it, description).
"""
from __future__ import annotations

import torch

from references.kda_spec import kda_accept, kda_verify
from references.kda_spec_cache import KdaInputCache
from verify.spec_decode.design import CheckpointDesign

SPEC_DECODE_CATALOGUE: list[tuple[str, frozenset, str]] = [
    ("accept_off_by_one", frozenset({"prefix", "growth"}),
     "commits the checkpoint of token a (one past the accepted prefix) where a < n"),
    ("accept_conv_only", frozenset({"prefix", "accept-zero", "growth"}),
     "rolls the conv window back but leaves the recurrent state at the last verified token"),
    ("checkpoints_before_update", frozenset({"prefix", "growth"}),
     "writes each token's checkpoint from the state before its update"),
    ("accept_neighbours_length", frozenset({"prefix", "accept-zero", "growth"}),
     "applies each sequence's accept length to its neighbour"),
    ("input_cache_replay_skips_oldest", frozenset({"prefix", "growth"}),
     "the input cache's replay starts at its second cached token, dropping the oldest"),
    ("input_cache_writeback_early", frozenset({"prefix", "growth"}),                 # + poison where it lands at W-1
     "the input cache writes back with W-1 tokens cached, replaying the buffer's W slots (one past the prefix)"),
    ("input_cache_writeback_drops_overshoot", frozenset({"prefix", "growth"}),
     "the input cache writes back only the buffer's first W tokens when an accept filled it past W"),
    ("accept_blends_by_arithmetic", frozenset({"poison"}),
     "commits keep * checkpoint + (1 - keep) * state: right values, but a = 0 reads slot 0, past the prefix"),
]
"""(name, the properties that must each report it, what the bug is). accept_blends_by_arithmetic is right
in every value the clean copy shows, so only the poisoned twin (4) can see it."""


# ---- per-token checkpoints (references.kda_spec) --------------------------------------------------

def _accept_off_by_one(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt):
    kda_accept(torch.minimum(accepted + (accepted > 0).to(accepted.dtype), n_tokens), n_tokens, conv_state, state,
               conv_ckpt, state_ckpt, validate=False)


def _accept_conv_only(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt):
    last = state_ckpt[torch.arange(state.shape[0]), (n_tokens.long() - 1)].clone()
    kda_accept(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt)
    state.copy_(last)


def _accept_neighbours_length(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt):
    kda_accept(torch.minimum(accepted.roll(1), n_tokens), n_tokens, conv_state, state, conv_ckpt, state_ckpt)


def _verify_checkpoints_before_update(**kw):
    conv_ckpt, state_ckpt, n = kw["conv_ckpt"], kw["state_ckpt"], kw["n_tokens"]
    y = kda_verify(**kw)
    for b in range(state_ckpt.shape[0]):
        k = int(n[b])
        state_ckpt[b, 1:k] = state_ckpt[b, :k - 1].clone()
        state_ckpt[b, 0] = kw["state"][b]
        conv_ckpt[b, 1:k] = conv_ckpt[b, :k - 1].clone()
        conv_ckpt[b, 0] = kw["conv_state"][b]
    return y


def _accept_blends_by_arithmetic(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt):
    rows, slot = torch.arange(state.shape[0]), (accepted.long() - 1).clamp(min=0)
    for now, ckpt in ((conv_state, conv_ckpt), (state, state_ckpt)):
        keep = (accepted > 0).to(now.dtype).view(-1, *(1,) * (now.dim() - 1))
        now.copy_(keep * ckpt[rows, slot] + (1 - keep) * now)


def accept_off_by_one():
    return CheckpointDesign(accept_fn=_accept_off_by_one)


def accept_conv_only():
    return CheckpointDesign(accept_fn=_accept_conv_only)


def accept_neighbours_length():
    return CheckpointDesign(accept_fn=_accept_neighbours_length)


def accept_blends_by_arithmetic():
    return CheckpointDesign(accept_fn=_accept_blends_by_arithmetic)


def checkpoints_before_update():
    return CheckpointDesign(verify_fn=_verify_checkpoints_before_update)


# ---- the input cache (references.kda_spec_cache) -------------------------------------------------

class _SkipsOldest(KdaInputCache):
    def _rebuild(self, count):
        conv, state = self.base_conv.clone(), self.base_state.clone()
        if not self.cache:
            return conv, state
        for s in range(1, int(count.max())):                  # slot 0, the oldest cached token, never replayed
            token = {name: self.cache[name][:, s] for name in self.cache}
            _, conv, state = self._step(token, conv, state, count > s)
        return conv, state


class _WritebackAt(KdaInputCache):
    """Writes back when `at` tokens are cached, replaying `slots` of them (None: all it holds)."""

    def __init__(self, at: int, slots: int | None, window: int = 6):
        super().__init__(window)
        self.at, self.slots = at, slots

    def accept(self, accepted):
        self.fill = self.fill + accepted.to(torch.int64)
        full = self.fill >= self.at
        count = self.fill if self.slots is None else torch.full_like(self.fill, self.slots)
        conv, state = self._rebuild(torch.where(full, count, torch.zeros_like(count)))
        self.base_conv = torch.where(full.view(-1, 1, 1, 1), conv, self.base_conv)
        self.base_state = torch.where(full.view(-1, 1, 1, 1), state, self.base_state)
        self.fill = torch.where(full, torch.zeros_like(self.fill), self.fill)


def input_cache_replay_skips_oldest():
    return _SkipsOldest(6)


def input_cache_writeback_early():
    return _WritebackAt(at=5, slots=6)


def input_cache_writeback_drops_overshoot():
    return _WritebackAt(at=6, slots=6)


def input_cache_control():
    """_WritebackAt with the right length and count: must pass (the planted subclass machinery is sound)."""
    return _WritebackAt(at=6, slots=None)
