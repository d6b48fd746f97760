"""mla_cache_append: each sequence's new latent written at its next cache slot, its length advanced.

One decode step of a gated-MLA layer caches one latent per sequence: cat(kv_c, k_rot) at position
seq_lens[b] of sequence b, that is slot block_table[b, pos // page] * page + pos % page of the paged
cache (references.layers.next_slots), then seq_lens[b] = pos + 1, so the attention that follows reads
pos + 1 tokens. It is references.mla.mla_cache_write with the slot mapping derived on the device
from the block table and the lengths, as a captured decode step needs (no host-built slot_mapping).

validate=True (the default) checks the lengths and the block table on the host before anything is
written: a length < 0, a sequence with no page for its next token, a page outside the cache, two
sequences on one slot are each a one-line error. validate=False reads no tensor value on the host
(a step captured in a CUDA graph, validated once before): a sequence with no valid slot then writes
nothing and keeps its length, so no write ever lands outside the cache.
"""
from __future__ import annotations

import torch

from references.mla import INDEX_DTYPES
from references.primitives import FLOAT_DTYPES, check_tensor


def _check_args(kv_c, k_rot, cache, block_table, seq_lens) -> None:
    check_tensor("kv_c", kv_c, ndim=2, dtypes=FLOAT_DTYPES)
    B = kv_c.shape[0]
    check_tensor("k_rot", k_rot, shape=(B, None), dtypes=(kv_c.dtype,))
    check_tensor("cache", cache, shape=(None, None, kv_c.shape[1] + k_rot.shape[1]), dtypes=(kv_c.dtype,))
    check_tensor("block_table", block_table, shape=(B, None), dtypes=INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=INDEX_DTYPES)


def append_slots(cache, block_table, seq_lens) -> torch.Tensor:
    """[B] int64: the slot of each sequence's next token, -1 where it has none (a length < 0, no page
    for position seq_lens[b] in its block-table row, or a page outside the cache)."""
    n_pages, page = cache.shape[0], cache.shape[1]
    pos = seq_lens.long()
    col = pos // page
    has_col = (pos >= 0) & (col < block_table.shape[1])
    pages = block_table.long().gather(1, torch.where(has_col, col, 0)[:, None]).squeeze(1)
    valid = has_col & (pages >= 0) & (pages < n_pages)
    return torch.where(valid, pages * page + pos % page, -1)


def check_append(cache, block_table, seq_lens) -> None:
    """The value checks of validate=True (host reads): every sequence has a slot, no slot twice."""
    page, n_pages = cache.shape[1], cache.shape[0]
    if bool((seq_lens < 0).any()):
        b = int(torch.nonzero(seq_lens < 0)[0])
        raise ValueError(f"seq_lens: sequence {b} has length {int(seq_lens[b])}; lengths must be >= 0")
    pos = seq_lens.long()
    full = pos // page >= block_table.shape[1]
    if bool(full.any()):
        b = int(torch.nonzero(full)[0])
        raise ValueError(f"block_table: sequence {b} is full ({int(pos[b])} tokens in {block_table.shape[1]} pages "
                         f"of {page}); give it more pages")
    slots = append_slots(cache, block_table, seq_lens)
    if bool((slots < 0).any()):
        b = int(torch.nonzero(slots < 0)[0])
        col = int(pos[b]) // page
        raise ValueError(f"block_table: sequence {b} writes position {int(pos[b])} to page "
                         f"{int(block_table[b, col])}, outside the cache of {n_pages} pages; assign it a page "
                         f"in 0..{n_pages - 1}")
    if slots.unique().numel() != slots.numel():
        raise ValueError("block_table: two sequences write the same cache slot; give each sequence its own pages")


def mla_cache_append(kv_c: torch.Tensor, k_rot: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, validate: bool = True) -> None:
    """cache[slot of seq_lens[b]] = cat(kv_c[b], k_rot[b]); seq_lens[b] += 1 (cache, seq_lens in place)."""
    _check_args(kv_c, k_rot, cache, block_table, seq_lens)
    if validate:
        check_append(cache, block_table, seq_lens)
    page = cache.shape[1]
    slots = append_slots(cache, block_table, seq_lens)
    keep = slots >= 0
    slots = slots[keep]
    cache[slots // page, slots % page] = torch.cat([kv_c, k_rot], dim=-1)[keep]
    seq_lens += keep.to(seq_lens.dtype)
