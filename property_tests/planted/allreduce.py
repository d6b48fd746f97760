"""Planted bugs in allreduce_fold (references/allreduce.py): the slips of a hand-written fold of
gathered partials."""
from __future__ import annotations

import torch


def _fold(terms, acc=torch.float32):
    total = terms[0].to(acc)
    for t in terms[1:]:
        total = total + t.to(acc)
    return total


def allreduce_fold_control(parts):
    """The declared fold, written out (the planted helpers' bug-free twin)."""
    return _fold(list(parts)).to(parts.dtype)


def allreduce_fold_reverse(parts):
    """Folds rank T-1..0 (the ring order seen from the last rank), not 0..T-1."""
    return _fold(list(parts)[::-1]).to(parts.dtype)


def allreduce_fold_pairwise(parts):
    """A tree fold, (p0 + p1) + (p2 + p3) ...: the order a warp-shuffle reduction over ranks gives."""
    terms = [p.float() for p in parts]
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0].to(parts.dtype)


def allreduce_fold_wd_accum(parts):
    """Accumulates in the working dtype (each add rounded), as a bf16 NCCL all-reduce does."""
    total = parts[0].clone()
    for p in parts[1:]:
        total = total + p
    return total


def allreduce_fold_drops_last_rank(parts):
    """The rank loop stops one short: the last rank's partial never added (wrong at T >= 2)."""
    T = parts.shape[0]
    return _fold(list(parts)[:max(T - 1, 1)]).to(parts.dtype)


def allreduce_fold_assumes_contiguous(parts):
    """Reads parts as the contiguous [T, B, N] block from its storage offset, whatever its strides."""
    T, B, N = parts.shape
    dense = torch.as_strided(parts, (T, B, N), (B * N, N, 1), parts.storage_offset())
    return _fold(list(dense)).to(parts.dtype)


def allreduce_fold_vector_tail_dropped(parts):
    """Only whole 16-byte vectors of a row are folded: the last N % (16 / element size) columns stay zero."""
    vec = 16 // parts.element_size()
    out = torch.zeros(parts.shape[1:], dtype=parts.dtype, device=parts.device)
    whole = parts.shape[2] - parts.shape[2] % vec
    out[:, :whole] = _fold(list(parts[..., :whole])).to(parts.dtype)
    return out
