"""Decode context parallelism of the MLA decode attention: one sequence's cache split over T ranks by slot
ranges, each rank's partial attention returned with its LSE, the partials combined by the split-KV combine.

`mla_decode_attn_cp` is what one rank computes: the paged latent MQA of references.mla.mla_decode_attn,
restricted to the window of key positions [kv_start[b], kv_start[b] + kv_len[b]) of each sequence that
the rank holds, normalised over the window's visible keys, with its natural-log LSE. The rank's own
block table lists the window's pages from its start (a rank's cache holds only its slots); the causal
mask among the Q query tokens is by absolute position (query j of a length-L sequence sits at
L - Q + j), so a rank that holds no key a query may see returns o = 0 and lse = -inf for it. Unsplit
(kv_start = 0, kv_len = seq_lens) it is mla_decode_attn with return_lse.

`context_shards` is the declared split: sequence b's P_b = ceil(L_b / page) pages in T page-aligned
ranges of n_b = ceil(P_b / T) pages, rank r the r-th (empty for the ranks past the sequence's end).
`combine_context` is the declared combine, rank 0..T-1: lse = logsumexp_r lse_r and
o = sum_r exp(lse_r - lse) o_r, a left fold over the ranks in the acc dtype (fp32; float64 for the
oracle) of the partials as the ranks return them (wd), rounded once to wd: FlashDecoding's split-KV
combine with the splits on different GPUs.
"""
from __future__ import annotations

import torch

from references.mla import INDEX_DTYPES, _check_decode_inputs, causal_visible, paged_cache_read
from references.primitives import acc_dtype, check_tensor


def _check(q_abs, cache, block_table, kv_start, kv_len, seq_lens) -> None:
    """mla_decode_attn's argument checks, then the window's."""
    _check_decode_inputs(q_abs, cache, block_table, seq_lens)
    n_seq = q_abs.shape[0]
    check_tensor("cache", cache, dtypes=(q_abs.dtype,))
    for name, t in (("kv_start", kv_start), ("kv_len", kv_len)):
        check_tensor(name, t, shape=(n_seq,), dtypes=INDEX_DTYPES)
    if not n_seq:
        return
    page = cache.shape[1]
    if bool((kv_start < 0).any()) or bool((kv_start % page != 0).any()):
        raise ValueError(f"kv_start: window starts must be >= 0 and page-aligned (page {page}), got {kv_start.tolist()}")
    if bool((kv_len < 0).any()) or bool((kv_start + kv_len > seq_lens).any()):
        raise ValueError(f"kv_len: windows must lie inside their sequences: kv_start {kv_start.tolist()} + kv_len "
                         f"{kv_len.tolist()} vs seq_lens {seq_lens.tolist()}")
    if bool((-(-kv_len // page) > block_table.shape[1]).any()):
        raise ValueError(f"block_table: {block_table.shape[1]} columns cannot hold windows of {kv_len.tolist()} slots "
                         f"in pages of {page}")


def mla_decode_attn_cp(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float, kv_lora_rank: int):
    """q_abs[B,Q,H,C] over each sequence's window of keys -> (o_latent[B,Q,H,kv_lora] wd, lse[B,Q,H] acc).

    Key t of sequence b's window (position kv_start[b] + t) is cache[block_table[b, t // page], t % page];
    scores, softmax over the window's visible keys and P @ V in acc, o rounded once to wd."""
    _check(q_abs, cache, block_table, kv_start, kv_len, seq_lens)
    n_seq, n_q, n_heads, _ = q_abs.shape
    acc = acc_dtype(q_abs)
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc, device=q_abs.device)
    lse = torch.full((n_seq, n_q, n_heads), float("-inf"), dtype=acc, device=q_abs.device)
    for b in range(n_seq):
        start, n, length = int(kv_start[b]), int(kv_len[b]), int(seq_lens[b])
        vis = causal_visible(length, n_q, start, start + n, q_abs.device)           # [Q, n]
        seen = vis.any(-1)                                                         # queries with a key here
        if not bool(seen.any()):
            continue
        kv = paged_cache_read(cache, block_table[b], n).to(acc)                     # [n, C]
        s = torch.einsum("qhc,tc->qht", q_abs[b].to(acc), kv) * scale
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        lse[b, seen] = torch.logsumexp(s[seen], dim=-1)
        out[b, seen] = torch.einsum("qht,tc->qhc", torch.softmax(s[seen], dim=-1), kv[:, :kv_lora_rank])
    return out.to(q_abs.dtype), lse


def context_shards(cache, block_table, seq_lens, T: int) -> list[dict]:
    """Rank r of T: {"cache": its pages only, "block_table": its window's pages from the window's start
    (-1 padded), "kv_start", "kv_len"} (rank order). Page-aligned ranges of ceil(P_b / T) pages."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T: {T!r} must be a positive int (context-parallel ranks)")
    page = cache.shape[1]
    lens = [int(n) for n in seq_lens.tolist()]
    per_rank = [-(-(-(-n // page)) // T) for n in lens]                             # n_b pages per rank
    shards = []
    for r in range(T):
        rows, starts, counts, pages = [], [], [], []
        for b, n in enumerate(lens):
            lo = min(r * per_rank[b] * page, n)
            hi = min(lo + per_rank[b] * page, n)
            own = block_table[b, lo // page: -(-hi // page)].long() if hi > lo else block_table[b, :0].long()
            rows.append(torch.arange(len(pages), len(pages) + own.numel()))
            pages += own.tolist()
            starts.append(lo if hi > lo else 0)
            counts.append(hi - lo)
        width = max(1, max(x.numel() for x in rows))
        table = torch.full((len(lens), width), -1, dtype=block_table.dtype, device=block_table.device)
        for b, row in enumerate(rows):
            table[b, :row.numel()] = row.to(table.dtype)
        idx = torch.tensor(pages, dtype=torch.long, device=cache.device)
        shards.append({"cache": cache[idx].clone() if pages else cache[:1].clone(), "block_table": table,
                       "kv_start": torch.tensor(starts, dtype=seq_lens.dtype, device=seq_lens.device),
                       "kv_len": torch.tensor(counts, dtype=seq_lens.dtype, device=seq_lens.device)})
    return shards


def combine_context(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(o_r wd, lse_r acc)] in rank order -> (o wd, lse acc): the declared split-KV combine (module doc)."""
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)
    acc = lse.dtype
    total = None
    for o, l in parts:
        term = torch.exp(l - lse).unsqueeze(-1) * o.to(acc)     # exp(-inf) = 0: a rank with no visible key
        total = term if total is None else total + term
    return total.to(parts[0][0].dtype), lse
