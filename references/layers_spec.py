"""Speculative decoding through a whole KDA or MLA layer: a verify step over up to n_q draft tokens per
sequence and the accept that commits each sequence's accepted prefix (references/layers.py for the layer
step, references/kda_spec.py for the op-level KDA verify).

What crosses steps is the layer's attention state only: conv_state + recurrent_state (KDA), the paged
cache + seq_lens (MLA; block_table is fixed). The AttnRes prefix and blocks are the token's own
activations, so each draft token brings its own: x[B, n_q, D] (its layer input h) and blocks
[B, n_q, 8, D] (its block snapshots; a push layer writes into that token's copy).

  verify   token t of sequence b is one layer step after tokens 0..t-1 of the draft (the committed state
           for t = 0); returns every verified token's output prefix [B, n_q, D] (zero past n_tokens[b]).
           KDA: the token inputs of all draft tokens go through a rollback design (SpecDecodeDesign,
           verify/spec_decode/design.py; CheckpointDesign over references.kda_spec by default), so any
           design, fused ones included, runs inside the layer. MLA: the draft latents are written at
           positions seq_lens .. seq_lens + n_tokens - 1 and attention is references.mla's multi-query
           decode, causal among the drafts. Nothing the caller sees through committed() changes.
  accept   accepted[b] in 0..n_tokens[b]: KDA commits the design's state after that many tokens; MLA
           sets seq_lens += accepted. A rejected draft's cache slots lie at or past seq_lens, are never
           read (attention reads seq_lens + n_tokens positions, the newest written by the same verify)
           and are overwritten by the next verify.

Per draft slot every op runs over the batch [B, D] with the shapes of references.layers.decode_steps,
so each token's bits are those of the layer stepped one token at a time; a slot's rows past a
sequence's n_tokens are computed from zeros and dropped (their cache writes are skipped). The host
reads the longest draft (the slots run) and, for MLA, the draft lengths present (one multi-query
attention launch per length).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from references.kda import kda_in_proj
from references.kda_spec import check_accept_counts, check_verify_counts
from references.layers import (BLOCK_SLOTS, DEFAULT_LAYER, LayerState, attn_side, check_layer_args, layer_kind_of,
                               mlp_side, next_slots)
from references.mla import mla_cache_write, mla_decode_attn, mla_out_gate, mla_q_absorb, mla_qkv_a
from references.primitives import check_tensor, linear
from references.weights import LayerWeights

COUNT_DTYPES = (torch.int32, torch.int64)
TOKEN_INPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
SPEC_KINDS = ("kda", "mla")
COMMITTED = {"kda": ("conv_state", "recurrent_state"), "mla": ("cache", "seq_lens")}


class CheckpointDesign:
    """Per-token checkpoints through a (verify, accept) pair with references.kda_spec's signatures
    (kda_verify / kda_accept by default): the checkpoint buffers [B, n_q, ...] are the rollback storage,
    none of it committed (kept = 0: the committed state lives in its own tensors)."""

    def __init__(self, verify_fn: Callable | None = None, accept_fn: Callable | None = None):
        from references.kda_spec import kda_accept, kda_verify

        self.verify_fn = verify_fn or kda_verify
        self.accept_fn = accept_fn or kda_accept

    def begin(self, *, conv_state, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, l2_eps, norm_eps, n_q):
        self.conv_state, self.state = conv_state.clone(), state.clone()
        self.layer = {"conv_w": conv_w, "A_log": A_log, "dt_bias": dt_bias, "o_norm_w": o_norm_w}
        self.params = {"lower_bound": lower_bound, "l2_eps": l2_eps, "norm_eps": norm_eps}
        B = state.shape[0]
        self.conv_ckpt = torch.zeros((B, n_q) + tuple(conv_state.shape[1:]), dtype=conv_state.dtype,
                                     device=conv_state.device)
        self.state_ckpt = torch.zeros((B, n_q) + tuple(state.shape[1:]), dtype=state.dtype, device=state.device)
        self.n_tokens = None

    def verify(self, *, n_tokens, **tokens):
        self.n_tokens = n_tokens.clone()
        return self.verify_fn(**tokens, n_tokens=n_tokens, **self.layer, conv_state=self.conv_state,
                              state=self.state, conv_ckpt=self.conv_ckpt, state_ckpt=self.state_ckpt, **self.params)

    def accept(self, accepted):
        self.accept_fn(accepted, self.n_tokens, self.conv_state, self.state, self.conv_ckpt, self.state_ckpt)

    def committed(self):
        return self.conv_state.clone(), self.state.clone()

    def rollback_buffers(self):
        none = torch.zeros(self.state.shape[0], dtype=torch.int64, device=self.state.device)
        return [("conv_ckpt", self.conv_ckpt, none), ("state_ckpt", self.state_ckpt, none)]


def _rows(live: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new where live[b] (a [B] bool), else old."""
    return torch.where(live.view((-1,) + (1,) * (new.dim() - 1)), new, old)


class SpecLayer:
    """One KDA or MLA layer of B sequences under speculative decoding (module docstring): begin(state,
    n_q) takes the committed attention state, then verify / accept per step; committed() and, for KDA,
    rollback_buffers() (the design's) show it. `design`: KDA only, a SpecDecodeDesign instance."""

    def __init__(self, kind: str, weights: LayerWeights, layer_idx: int | None = None, design=None):
        if kind not in SPEC_KINDS:
            raise ValueError(f"kind: {kind!r} has no speculative layer step; use one of {SPEC_KINDS}")
        self.layer_idx = DEFAULT_LAYER[kind] if layer_idx is None else layer_idx
        if layer_kind_of(self.layer_idx) != kind:
            raise ValueError(f"layer_idx: K3 layer {self.layer_idx} is a {layer_kind_of(self.layer_idx)!r} layer, "
                             f"not {kind!r}")
        if kind == "mla" and design is not None:
            raise ValueError("design: an MLA layer has no KDA rollback design (its attention is references.mla's); "
                             "pass design=None")
        self.kind, self.weights = kind, weights
        self.design = CheckpointDesign() if kind == "kda" and design is None else design
        self.n_tokens = None

    # ---- state ----------------------------------------------------------------------------------
    def begin(self, state: LayerState, n_q: int) -> None:
        """Take (a copy of) state's attention state as the committed one; every verify has n_q draft slots."""
        check_layer_args(self.weights, state, self.kind)
        if not isinstance(n_q, int) or not 1 <= n_q <= 8:
            raise ValueError(f"n_q: {n_q!r} draft slots; the verify step takes 1..8 per sequence")
        self.n_q, self.batch = n_q, state.prefix.shape[0]
        if self.kind == "kda":
            w, cfg = self.weights, self.weights.config
            self.design.begin(conv_state=state.conv_state.clone(), state=state.recurrent_state.clone(),
                              conv_w=w["conv_w"], A_log=w["A_log"], dt_bias=w["dt_bias"], o_norm_w=w["o_norm_w"],
                              lower_bound=cfg.gate_lower_bound, l2_eps=cfg.l2_eps, norm_eps=cfg.rms_eps, n_q=n_q)
        else:
            self.cache, self.block_table = state.cache.clone(), state.block_table.clone()
            self.seq_lens = state.seq_lens.clone()

    def committed(self) -> dict[str, torch.Tensor]:
        """Copies of the committed attention state: conv_state, recurrent_state (KDA); cache, seq_lens (MLA:
        only positions below seq_lens of each sequence's pages are committed)."""
        if self.kind == "kda":
            return dict(zip(COMMITTED["kda"], self.design.committed()))
        return {"cache": self.cache.clone(), "seq_lens": self.seq_lens.clone()}

    def rollback_buffers(self):
        """KDA: the design's rollback storage (design.py); MLA keeps none beyond its cache (paged_cache)."""
        return self.design.rollback_buffers() if self.kind == "kda" else []

    def paged_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA: the live (cache, block_table, seq_lens): positions at or past seq_lens hold no committed token."""
        return self.cache, self.block_table, self.seq_lens

    def fork(self) -> "SpecLayer":
        """The same layer from the same committed state, sharing the weights (not copied)."""
        twin = copy.copy(self)
        if self.kind == "kda":
            fork = getattr(self.design, "fork", None)
            twin.design = fork() if callable(fork) else copy.deepcopy(self.design)
        else:
            twin.cache, twin.block_table, twin.seq_lens = self.cache.clone(), self.block_table.clone(), self.seq_lens.clone()
        return twin

    # ---- the step -------------------------------------------------------------------------------
    def _check_verify(self, x, blocks, n_tokens) -> int:
        """Shapes, dtypes and counts; returns the slots to run (the longest draft)."""
        w, B = self.weights, self.batch
        check_tensor("x", x, shape=(B, self.n_q, w.config.hidden), dtypes=(w.dtype,))
        check_tensor("blocks", blocks, shape=(B, self.n_q, BLOCK_SLOTS, w.config.hidden), dtypes=(w.dtype,))
        check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
        check_verify_counts(n_tokens, self.n_q)
        if self.kind == "mla":                     # the last draft position of every sequence has a page
            last = LayerState(x[:, 0], blocks[:, 0], cache=self.cache, block_table=self.block_table,
                              seq_lens=self.seq_lens + n_tokens.to(self.seq_lens.dtype) - 1)
            next_slots(last)
        return int(n_tokens.max())

    def verify(self, x: torch.Tensor, blocks: torch.Tensor, n_tokens: torch.Tensor,
               routing: list | None = None) -> torch.Tensor:
        """Every draft token's layer output [B, n_q, D] (module docstring). `routing` collects (ids, choice
        scores) per slot run, as references.layers.decode_steps does per step."""
        T = self._check_verify(x, blocks, n_tokens)
        self.n_tokens = n_tokens.clone()
        live = [n_tokens > t for t in range(T)]
        # per slot: the token's own AttnRes stream, its attn-side normed input and the mlp side's blocks
        streams, normed = [], []
        for t in range(T):
            s = LayerState(prefix=_rows(live[t], x[:, t], torch.zeros_like(x[:, t])),
                           blocks=_rows(live[t], blocks[:, t], torch.zeros_like(blocks[:, t])))
            xa, mlp_blocks = attn_side(self.weights, s, self.layer_idx)
            streams.append(s)
            normed.append(xa)
        attn = self._kda_attention(normed, n_tokens) if self.kind == "kda" else self._mla_attention(normed, n_tokens)
        out = torch.zeros_like(x)
        for t in range(T):
            out[:, t] = _rows(live[t], mlp_side(self.weights, streams[t], attn[t], mlp_blocks, routing), out[:, t])
        return out

    def _kda_attention(self, normed: list, n_tokens: torch.Tensor) -> list:
        """in_proj per slot, the design's verify over all slots (slots past n_tokens NaN), o_proj per slot."""
        w, cfg, B = self.weights, self.weights.config, self.batch
        per_slot = [kda_in_proj(xa, w["w_in"], w["w_fb"], cfg.n_heads) for xa in normed]
        tokens = {}
        for i, name in enumerate(TOKEN_INPUTS):
            first = per_slot[0][i]
            stacked = torch.full((B, self.n_q) + tuple(first.shape[1:]), float("nan"), dtype=first.dtype,
                                 device=first.device)
            for t, slot in enumerate(per_slot):
                stacked[:, t] = _rows(n_tokens > t, slot[i], stacked[:, t])
            tokens[name] = stacked
        y = self.design.verify(**tokens, n_tokens=n_tokens.clone())
        return [linear(y[:, t], w["w_o"]) for t in range(len(normed))]

    def _mla_attention(self, normed: list, n_tokens: torch.Tensor) -> list:
        """Per slot: qkv_a, q absorption and the cache write at position seq_lens + t (live rows only); then
        the multi-query attention; per slot: the output gate and o_proj."""
        w, cfg = self.weights, self.weights.config
        q_abs = []
        for t, xa in enumerate(normed):
            q_c, kv_c, k_rot = mla_qkv_a(xa, w["w_qkv_a"], w["q_a_norm_w"], w["kv_a_norm_w"], cfg.mla_latent_eps)
            q_abs.append(mla_q_absorb(q_c, w["w_q_b"], w["w_uk"]))
            # a row past its draft looks up its last draft position (a valid slot), then writes nothing (-1)
            pos = self.seq_lens + n_tokens.clamp(max=t + 1).to(self.seq_lens.dtype) - 1
            slots = next_slots(LayerState(xa, xa, cache=self.cache, block_table=self.block_table, seq_lens=pos))
            slots = torch.where(n_tokens > t, slots, torch.full_like(slots, -1))
            mla_cache_write(torch.cat([kv_c, k_rot], dim=-1), self.cache, slots.long())
        o_latent = self.attend(torch.stack(q_abs, dim=1), n_tokens)
        outs = []
        for t, xa in enumerate(normed):
            o = mla_out_gate(o_latent[:, t], w["w_uv"], xa, w["w_g"])
            outs.append(linear(o, w["w_o"]))
        return outs

    def attend(self, q_abs: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        """Multi-query latent attention q_abs[B, T, H, C] -> o_latent[B, T, H, kv_lora], causal among the
        drafts: draft t of a sequence with more than t draft tokens sees its seq_lens + t + 1 positions,
        one mla_decode_attn query per draft slot. The same math as one multi-query call per sequence, but
        each query's sums have the same shape however many tokens the step drafts, so a step's bits do not
        depend on it (torch's CUDA GEMMs pick their kernel, and so their fp32 order, by the row count)."""
        cfg = self.weights.config
        B, T, H = q_abs.shape[:3]
        out = torch.zeros(B, T, H, cfg.kv_lora_rank, dtype=q_abs.dtype, device=q_abs.device)
        for t in range(T):
            sel = n_tokens > t
            if bool(sel.any()):
                out[sel, t:t + 1] = mla_decode_attn(q_abs[sel, t:t + 1], self.cache, self.block_table[sel],
                                                    self.seq_lens[sel] + t + 1, cfg.mla_scale, cfg.kv_lora_rank)
        return out

    def accept(self, accepted: torch.Tensor) -> None:
        """Commit accepted[b] of the last verify's draft tokens (0..n_tokens[b])."""
        if self.n_tokens is None:
            raise ValueError("accepted: no verify to accept from; call verify() first")
        check_tensor("accepted", accepted, shape=(self.batch,), dtypes=COUNT_DTYPES)
        check_accept_counts(accepted, self.n_tokens)
        if self.kind == "kda":
            self.design.accept(accepted.clone())
        else:
            self.seq_lens += accepted.to(self.seq_lens.dtype)
