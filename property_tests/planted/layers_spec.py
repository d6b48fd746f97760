"""Planted bugs in speculative-decoding layers (references/layers_spec.py, judged by verify/spec_decode/layer.py):
each is a layer factory make(kind, weights, layer_idx) and the contract properties that must reject it.
Their correct twins: references.layers_spec.SpecLayer itself, and `mla_attend_control` (the planted
attention machinery with the right causal mask).

LAYER_SPEC_CATALOGUE rows: (factory name, layer kind, properties that must each name it, description).
"""
from __future__ import annotations

import torch

from references.layers_spec import SpecLayer
from references.mla import paged_cache_read
from references.primitives import acc_dtype

LAYER_SPEC_CATALOGUE: list[tuple[str, str, frozenset, str]] = [
    ("kda_accept_off_by_one", "kda", frozenset({"prefix", "growth", "poison"}),
     "the layer commits one token past the accepted prefix where 0 < a < n_tokens (reading its rejected storage)"),
    ("mla_accept_off_by_one", "mla", frozenset({"prefix", "growth", "poison"}),
     "the layer commits one token past the accepted prefix where 0 < a < n_tokens (reading its rejected storage)"),
    ("mla_accept_advances_n_tokens", "mla", frozenset({"prefix", "accept-zero", "growth", "poison"}),
     "accept sets seq_lens += n_tokens: the rejected drafts' cache slots are read as committed tokens"),
    ("mla_draft_sees_next_draft", "mla", frozenset({"prefix", "growth"}),
     "the causal mask among the drafts lets draft t attend to draft t+1"),
    ("kda_accept_conv_only", "kda", frozenset({"prefix", "accept-zero", "growth"}),
     "the KDA design rolls the conv window back but leaves the recurrent state at the last verified token"),
]


class _AcceptOffByOne(SpecLayer):
    def accept(self, accepted):
        super().accept(torch.minimum(accepted + (accepted > 0).to(accepted.dtype), self.n_tokens.to(accepted.dtype)))


class _AcceptAdvancesNTokens(SpecLayer):
    def accept(self, accepted):
        super().accept(self.n_tokens.to(accepted.dtype))


class _AttendShifted(SpecLayer):
    """Multi-query attention written out per sequence, draft t seeing positions < seq_lens + t + 1 + shift."""

    shift = 1

    def attend(self, q_abs, n_tokens):
        cfg = self.weights.config
        B, T, H = q_abs.shape[:3]
        acc = acc_dtype(q_abs)
        out = torch.zeros(B, T, H, cfg.kv_lora_rank, dtype=acc, device=q_abs.device)
        for b in range(B):
            k, length = int(n_tokens[b]), int(self.seq_lens[b]) + int(n_tokens[b])
            kv = paged_cache_read(self.cache, self.block_table[b], length).to(acc)
            s = torch.einsum("qhc,tc->qht", q_abs[b, :k].to(acc), kv) * cfg.mla_scale
            sees = torch.arange(length).view(1, -1) < (int(self.seq_lens[b]) + torch.arange(k) + 1 + self.shift).view(-1, 1)
            s = s.masked_fill(~sees[:, None, :], float("-inf"))
            out[b, :k] = torch.einsum("qht,tc->qhc", torch.softmax(s, dim=-1), kv[:, :cfg.kv_lora_rank])
        return out.to(q_abs.dtype)


class _AttendControl(_AttendShifted):
    shift = 0


def kda_accept_off_by_one(kind, weights, layer_idx):
    return _AcceptOffByOne(kind, weights, layer_idx)


def mla_accept_off_by_one(kind, weights, layer_idx):
    return _AcceptOffByOne(kind, weights, layer_idx)


def mla_accept_advances_n_tokens(kind, weights, layer_idx):
    return _AcceptAdvancesNTokens(kind, weights, layer_idx)


def mla_draft_sees_next_draft(kind, weights, layer_idx):
    return _AttendShifted(kind, weights, layer_idx)


def mla_attend_control(kind, weights, layer_idx):
    """_AttendShifted with the right mask: must pass (the planted attention is sound, the shift is the bug)."""
    return _AttendControl(kind, weights, layer_idx)


def kda_accept_conv_only(kind, weights, layer_idx):
    from property_tests.planted.kda_spec import accept_conv_only

    return SpecLayer(kind, weights, layer_idx, design=accept_conv_only())
