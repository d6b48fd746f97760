"""Planted bugs in mla_cache_append (references/mla_cache_append.py): the slips of a kernel that derives
each sequence's cache slot from its block table and length."""
from __future__ import annotations

import torch

from property_tests.planted._cache import TensorKeyed
from references.mla_cache_append import _check_args, append_slots, check_append


def _append(kv_c, k_rot, cache, slots, seq_lens, advance=True, latent=None):
    page = cache.shape[1]
    keep = slots >= 0
    s = slots[keep]
    rows = torch.cat([kv_c, k_rot], dim=-1) if latent is None else latent
    cache[s // page, s % page] = rows[keep]
    if advance:
        seq_lens += keep.to(seq_lens.dtype)


def _checked(kv_c, k_rot, cache, block_table, seq_lens, validate):
    _check_args(kv_c, k_rot, cache, block_table, seq_lens)
    if validate:
        check_append(cache, block_table, seq_lens)


def mla_cache_append_control(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """The reference's append written out (the planted helpers' bug-free twin)."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    _append(kv_c, k_rot, cache, append_slots(cache, block_table, seq_lens), seq_lens)


def mla_cache_append_one_past(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """Writes at position seq_lens + 1 (the length already advanced when the slot is taken)."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    slots = append_slots(cache, block_table, seq_lens + 1)
    _append(kv_c, k_rot, cache, slots, seq_lens)


def mla_cache_append_neighbour_row(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """Reads the page id from the next sequence's block-table row (a row index off by one, wrapping)."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    slots = append_slots(cache, block_table.roll(-1, 0), seq_lens)
    ok = append_slots(cache, block_table, seq_lens) >= 0
    _append(kv_c, k_rot, cache, torch.where(ok, slots, -1), seq_lens)


def mla_cache_append_keeps_length(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """Writes the latent but never advances seq_lens (left to a separate launch that was dropped)."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    _append(kv_c, k_rot, cache, append_slots(cache, block_table, seq_lens), seq_lens, advance=False)


def mla_cache_append_16bit_slot(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """Keeps the slot in 16 bits: a slot past 2^16 lands on a low slot (the knob cache='large')."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    slots = append_slots(cache, block_table, seq_lens)
    _append(kv_c, k_rot, cache, torch.where(slots >= 0, slots & 0xFFFF, -1), seq_lens)


def mla_cache_append_drops_rope(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """Copies the kv_c chunks only: the k_rot part of the row keeps the cache's old bits."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    slots = append_slots(cache, block_table, seq_lens)
    page, keep = cache.shape[1], slots >= 0
    s = slots[keep]
    cache[s // page, s % page, :kv_c.shape[1]] = kv_c[keep]
    seq_lens += keep.to(seq_lens.dtype)


_PAGES = TensorKeyed()


def mla_cache_append_pages_per_table(kv_c, k_rot, cache, block_table, seq_lens, validate: bool = True):
    """Caches each sequence's page list per block_table tensor (a persistent, graph-captured buffer): the
    engine re-pages a sequence in place between steps and the append keeps writing to the old page."""
    _checked(kv_c, k_rot, cache, block_table, seq_lens, validate)
    table = _PAGES.get(block_table)
    if table is None:
        table = block_table.clone()
        _PAGES.put(block_table, table)
    _append(kv_c, k_rot, cache, append_slots(cache, table, seq_lens), seq_lens)
