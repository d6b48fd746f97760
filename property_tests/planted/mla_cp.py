"""Planted bugs in mla_decode_attn_cp (references/mla_cp.py): the slips of a rank's partial attention
under decode context parallelism."""
from __future__ import annotations

import math

import torch

from references.mla import causal_visible, paged_cache_read
from references.mla_cp import _check
from references.primitives import acc_dtype

from property_tests.harness_case import on_one_thread


@on_one_thread          # stands for a kernel, whose bits do not move with a CPU thread count
def _window_attn(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank, *,
                 mask_at=None, lse_base2=False, empty_nan=False, whole_pages=False):
    _check(q_abs, cache, block_table, kv_start, kv_len, seq_lens)
    n_seq, n_q, n_heads, _ = q_abs.shape
    acc, page = acc_dtype(q_abs), cache.shape[1]
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc)
    lse = torch.full((n_seq, n_q, n_heads), float("-inf"), dtype=acc)
    for b in range(n_seq):
        start, n, length = int(kv_start[b]), int(kv_len[b]), int(seq_lens[b])
        if whole_pages and n > page:
            n = n // page * page
        vis = mask_at(start, n, length, n_q) if mask_at else causal_visible(length, n_q, start, start + n)
        if not bool(vis.any()):
            if empty_nan:                       # 0 / 0 of a softmax over no key
                out[b], lse[b] = float("nan"), float("nan")
            continue
        kv = paged_cache_read(cache, block_table[b], n).to(acc)
        s = (torch.einsum("qhc,tc->qht", q_abs[b].to(acc), kv) * scale).masked_fill(~vis[:, None, :], float("-inf"))
        seen = vis.any(-1) | empty_nan
        s = s if not empty_nan else torch.where(vis.any(-1)[:, None, None], s, float("nan"))
        lse[b, seen] = torch.logsumexp(s[seen], dim=-1) / (math.log(2) if lse_base2 else 1.0)
        out[b, seen] = torch.einsum("qht,tc->qhc", torch.softmax(s[seen], dim=-1), kv[:, :kv_lora_rank])
    return out.to(q_abs.dtype), lse


def mla_decode_attn_cp_control(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float, kv_lora_rank: int):
    """The rank's partial written out (the planted helpers' bug-free twin)."""
    return _window_attn(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank)


def mla_decode_attn_cp_mask_at_window_end(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float,
                                          kv_lora_rank: int):
    """The causal mask placed at the end of the rank's window, as if the window were the whole sequence:
    a rank holding the start of a sequence hides its last keys from the draft tokens."""
    at = lambda start, n, length, n_q: causal_visible(max(n, n_q), n_q, 0, n)
    return _window_attn(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank, mask_at=at)


def mla_decode_attn_cp_lse_base2(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float, kv_lora_rank: int):
    """Returns the LSE in base 2 (an exp2 kernel's running sum, never converted back)."""
    return _window_attn(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank, lse_base2=True)


def mla_decode_attn_cp_empty_window_nan(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float,
                                        kv_lora_rank: int):
    """A query with no visible key in the window gets softmax over all -inf: NaN output, NaN lse."""
    return _window_attn(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank, empty_nan=True)


def mla_decode_attn_cp_whole_pages_only(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float,
                                        kv_lora_rank: int):
    """A window longer than a page read in whole pages only: its last partial page is dropped."""
    return _window_attn(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank, whole_pages=True)
