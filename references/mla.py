"""Gated MLA (no RoPE) decode: readable references for the fused MLA kernels, plus their TP forms.

Math and shapes: shared/reference/kimi-k3-math.md §2.2 (absorbed form, as vLLM runs it). dtype-generic:
"fp32" steps use `acc_dtype`, so float64 inputs give the oracle. Every wd rounding below is one that
the K3 reference (HF eager / vLLM) also makes; comments say which.

Layouts: tokens are sequence-major; decode attention takes q_abs[B, Q, H, C] (FlashMLA's
[batch, q_len, heads, dim]) so that dim 0 is the sequence and a batch permutation moves a sequence's
query tokens, block-table row and length together. C = kv_lora + rope (576 at K3), one latent head.
"""
from __future__ import annotations

import torch

from references.primitives import FLOAT_DTYPES, acc_dtype, check_tensor, linear, rms_norm, fold_ranks

INDEX_DTYPES = (torch.int32, torch.int64)


def mla_qkv_a(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float):
    """Fused q_a / kv_a_with_mqa GEMM, then the two latent RMSNorms; k_rot stays raw (NoPE: no rotation).

    x[B,D], w_qkv_a[(q_lora + kv_lora + rope), D] -> (q_c[B,q_lora], kv_c[B,kv_lora], k_rot[B,rope]).
    eps is a parameter because the sources disagree (1e-6 in the HF copies, 1e-5 in vLLM).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("q_a_norm_w", q_a_norm_w, ndim=1, dtypes=FLOAT_DTYPES)
    check_tensor("kv_a_norm_w", kv_a_norm_w, ndim=1, dtypes=FLOAT_DTYPES)
    q_lora, kv_lora = q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
    check_tensor("w_qkv_a", w_qkv_a, shape=(None, x.shape[1]), dtypes=FLOAT_DTYPES)
    rope = w_qkv_a.shape[0] - q_lora - kv_lora
    if rope < 0:
        raise ValueError(f"w_qkv_a: {w_qkv_a.shape[0]} rows < q_lora {q_lora} + kv_lora {kv_lora}")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps!r}")
    qkv = linear(x, w_qkv_a)                     # one GEMM, rounded to wd (vLLM fused_qkv_a_proj)
    q_c = rms_norm(qkv[:, :q_lora], q_a_norm_w, eps)
    kv_c = rms_norm(qkv[:, q_lora:q_lora + kv_lora], kv_a_norm_w, eps)
    return q_c.contiguous(), kv_c.contiguous(), qkv[:, q_lora + kv_lora:].contiguous()


def mla_q_absorb(q_c, w_q_b, w_uk):
    """q_b GEMM, then W_UK absorption of q_nope: -> q_abs[B, H, kv_lora + rope] = [ql, q_rot].

    w_q_b[H*(Dh+rope), q_lora] rows head-major; w_uk[H, Dh, kv_lora] = kv_b_proj.view(H, 2Dh, kv_lora)[:, :Dh].
    """
    check_tensor("q_c", q_c, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w_uk", w_uk, ndim=3, dtypes=FLOAT_DTYPES)
    n_heads, head_dim, kv_lora = w_uk.shape
    check_tensor("w_q_b", w_q_b, shape=(None, q_c.shape[1]), dtypes=FLOAT_DTYPES)
    if w_q_b.shape[0] % n_heads or w_q_b.shape[0] // n_heads < head_dim:
        raise ValueError(f"w_q_b: {w_q_b.shape[0]} rows is not n_heads {n_heads} x (head_dim {head_dim} + rope)")
    q = linear(q_c, w_q_b).view(q_c.shape[0], n_heads, -1)   # q_b_proj output rounded to wd
    acc = acc_dtype(q)
    ql = torch.einsum("bhd,hdc->bhc", q[..., :head_dim].to(acc), w_uk.to(acc)).to(q.dtype)  # bmm, one rounding
    return torch.cat([ql, q[..., head_dim:]], dim=-1)


def mla_cache_write(latent, cache, slot_mapping) -> None:
    """cache.view(-1, C)[slot] = latent[i] for every i with slot >= 0; negative slots are padding.

    Written through (page, offset) indexing so a strided cache works too; same bits as the view form.
    """
    check_tensor("latent", latent, ndim=2, dtypes=FLOAT_DTYPES)
    n_tok, width = latent.shape
    check_tensor("cache", cache, shape=(None, None, width), dtypes=(latent.dtype,))
    check_tensor("slot_mapping", slot_mapping, shape=(n_tok,), dtypes=(torch.int64,))
    n_pages, page = cache.shape[0], cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if slots.numel() and int(slots.max()) >= n_pages * page:
        bad = int(torch.nonzero(slot_mapping >= n_pages * page)[0])
        raise ValueError(f"slot_mapping: slot {int(slot_mapping[bad])} at index {bad} is outside the cache of "
                         f"{n_pages} pages x {page} = {n_pages * page} slots; use -1 for padding tokens")
    if slots.unique().numel() != slots.numel():
        raise ValueError("slot_mapping: a slot appears twice; the write order would decide the cache bits")
    cache[slots // page, slots % page] = latent[keep]


def paged_cache_read(cache, block_ids, length: int):
    """The first `length` latent rows of one sequence: position t lives at page block_ids[t // page], row t % page."""
    check_tensor("cache", cache, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES)
    page = cache.shape[1]
    n_blocks = -(-length // page)
    if length < 0 or n_blocks > block_ids.shape[0]:
        raise ValueError(f"seq_lens: length {length} needs {n_blocks} pages, block_table row has {block_ids.shape[0]}")
    blocks = block_ids[:n_blocks].long()
    if n_blocks and (int(blocks.min()) < 0 or int(blocks.max()) >= cache.shape[0]):
        raise ValueError(f"block_table: page ids {blocks.tolist()} reach outside the cache of {cache.shape[0]} pages")
    return cache[blocks].reshape(n_blocks * page, -1)[:length]


def _check_decode_inputs(q_abs, cache, block_table, seq_lens):
    check_tensor("q_abs", q_abs, ndim=4, dtypes=FLOAT_DTYPES)
    n_seq, n_q, _, width = q_abs.shape
    check_tensor("cache", cache, shape=(None, None, width), dtypes=FLOAT_DTYPES)
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("block_table", block_table, shape=(n_seq, None))
    check_tensor("seq_lens", seq_lens, shape=(n_seq,), dtypes=INDEX_DTYPES)
    if not 1 <= n_q <= 8:
        raise ValueError(f"q_abs: {n_q} query tokens per sequence; decode supports 1..8 (dim 1)")
    if n_seq and int(seq_lens.min()) < n_q:
        raise ValueError(f"seq_lens: every length must cover the {n_q} query tokens, got {seq_lens.tolist()}")


def causal_visible(length: int, n_q: int, start: int, stop: int, device=None):
    """[n_q, stop-start] bool: query j (0-based among n_q) of a length-`length` sequence sees t < length-n_q+j+1."""
    pos = torch.arange(start, stop, device=device)
    last = length - n_q + torch.arange(n_q, device=device)
    return pos[None, :] <= last[:, None]


def mla_decode_attn(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int, *, return_lse=False):
    """Paged latent MQA over ragged lengths, 1..8 causal query tokens per sequence, one pass per sequence.

    q_abs[B,Q,H,C], cache[P,page,C], block_table[B,max_pages], seq_lens[B] -> o_latent[B,Q,H,kv_lora] (wd);
    with return_lse also lse[B,Q,H] (acc, natural log of the scaled scores' sum of exps).
    Scores, softmax and P@V in acc, one rounding at the end (keys = all C columns, values = first kv_lora).
    """
    _check_decode_inputs(q_abs, cache, block_table, seq_lens)
    n_seq, n_q, n_heads, _ = q_abs.shape
    acc = acc_dtype(q_abs)
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc, device=q_abs.device)
    lse = torch.zeros(n_seq, n_q, n_heads, dtype=acc, device=q_abs.device)
    for b in range(n_seq):
        length = int(seq_lens[b])
        kv = paged_cache_read(cache, block_table[b], length).to(acc)           # [L, C]
        s = torch.einsum("qhc,tc->qht", q_abs[b].to(acc), kv) * scale
        s = s.masked_fill(~causal_visible(length, n_q, 0, length, s.device)[:, None, :], float("-inf"))
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.einsum("qht,tc->qhc", torch.softmax(s, dim=-1), kv[:, :kv_lora_rank])
    out = out.to(q_abs.dtype)
    return (out, lse) if return_lse else out


def mla_decode_attn_split_kv(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int, n_splits: int):
    """The same attention as split-KV partials + LSE combine (FlashDecoding / FlashMLA form), written independently.

    Each sequence's pages are cut into n_splits page-aligned chunks; a chunk gives (o_i, lse_i) normalised over its
    visible keys (lse_i = -inf when a query sees none of it); combine: o = sum_i exp(lse_i - lse) o_i in acc.
    Returns (o_latent[B,Q,H,kv_lora] wd, lse[B,Q,H] acc).
    """
    _check_decode_inputs(q_abs, cache, block_table, seq_lens)
    if n_splits < 1:
        raise ValueError(f"n_splits: must be >= 1, got {n_splits}")
    n_seq, n_q, n_heads, _ = q_abs.shape
    page, acc = cache.shape[1], acc_dtype(q_abs)
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc, device=q_abs.device)
    lse_out = torch.zeros(n_seq, n_q, n_heads, dtype=acc, device=q_abs.device)
    for b in range(n_seq):
        length = int(seq_lens[b])
        pages_per_split = -(-(-(-length // page)) // n_splits)
        kv_all = paged_cache_read(cache, block_table[b], length).to(acc)
        partial_o, partial_lse = [], []
        for start in range(0, length, pages_per_split * page):
            stop = min(length, start + pages_per_split * page)
            kv = kv_all[start:stop]
            s = torch.einsum("qhc,tc->qht", q_abs[b].to(acc), kv) * scale
            s = s.masked_fill(~causal_visible(length, n_q, start, stop, s.device)[:, None, :], float("-inf"))
            m = s.amax(-1, keepdim=True)
            m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))     # fully masked chunk
            e = torch.exp(s - m_safe)
            denom = e.sum(-1, keepdim=True)
            safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))
            partial_o.append(torch.einsum("qht,tc->qhc", e, kv[:, :kv_lora_rank]) / safe_denom)
            partial_lse.append((m_safe + torch.log(denom)).squeeze(-1))       # log 0 = -inf when masked
        lse_i = torch.stack(partial_lse)                                        # [S, Q, H]
        lse = torch.logsumexp(lse_i, dim=0)
        weight = torch.exp(lse_i - lse)                                         # exp(-inf) = 0 for empty chunks
        out[b] = (weight[..., None] * torch.stack(partial_o)).sum(0)
        lse_out[b] = lse
    return out.to(q_abs.dtype), lse_out


def mla_uv_project(o_latent, w_uv):
    """W_UV: o_latent[B,H,kv_lora] x w_uv[H,Dh,kv_lora] -> [B,H,Dh] (bmm, acc, one rounding)."""
    acc = acc_dtype(o_latent)
    return torch.einsum("bhc,hdc->bhd", o_latent.to(acc), w_uv.to(acc)).to(o_latent.dtype)


def mla_out_gate(o_latent, w_uv, x, w_g):
    """W_UV up-projection, then the K3 output gate: o[B, H*Dh] = (o_latent W_UV) * sigmoid(x @ w_g.T).

    Rounding as in HF/vLLM: bmm -> wd, g_proj -> wd, sigmoid -> wd, product -> wd.
    """
    check_tensor("o_latent", o_latent, ndim=3, dtypes=FLOAT_DTYPES)
    n_tok, n_heads, kv_lora = o_latent.shape
    check_tensor("w_uv", w_uv, shape=(n_heads, None, kv_lora), dtypes=FLOAT_DTYPES)
    check_tensor("x", x, shape=(n_tok, None), dtypes=FLOAT_DTYPES)
    check_tensor("w_g", w_g, shape=(n_heads * w_uv.shape[1], x.shape[1]), dtypes=FLOAT_DTYPES)
    o = mla_uv_project(o_latent, w_uv).reshape(n_tok, -1)
    acc, wd = acc_dtype(o), o.dtype
    gate = torch.sigmoid(linear(x.to(wd), w_g).to(acc)).to(wd)
    return (o.to(acc) * gate.to(acc)).to(wd)


def mla_attention_expanded(q_c, w_q_b, w_uk, w_uv, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """Non-absorbed MLA (HF eager form): per head k = [c W_UK^T, k_rot], v = c W_UV^T, attention in Dh space.

    q_c[B,Q,q_lora] -> o[B,Q,H,Dh]. Equal to mla_uv_project(mla_decode_attn(mla_q_absorb(..))) in exact math.
    """
    check_tensor("q_c", q_c, ndim=3, dtypes=FLOAT_DTYPES)
    n_seq, n_q, _ = q_c.shape
    n_heads, head_dim, _ = w_uk.shape
    q = linear(q_c.reshape(n_seq * n_q, -1), w_q_b).view(n_seq, n_q, n_heads, -1)
    _check_decode_inputs(q[..., :1].expand(-1, -1, -1, cache.shape[-1]), cache, block_table, seq_lens)
    acc, wd = acc_dtype(q), q.dtype
    out = torch.zeros(n_seq, n_q, n_heads, head_dim, dtype=acc)
    for b in range(n_seq):
        length = int(seq_lens[b])
        kv = paged_cache_read(cache, block_table[b], length)
        c, k_rot = kv[:, :kv_lora_rank].to(acc), kv[:, kv_lora_rank:]
        k_nope = torch.einsum("tc,hdc->thd", c, w_uk.to(acc)).to(wd)           # kv_b_proj output in wd
        v = torch.einsum("tc,hdc->thd", c, w_uv.to(acc)).to(wd)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(-1, n_heads, -1).to(wd)], dim=-1)
        s = torch.einsum("qhe,the->qht", q[b].to(acc), k.to(acc)) * scale
        s = s.masked_fill(~causal_visible(length, n_q, 0, length, s.device)[:, None, :], float("-inf"))
        out[b] = torch.einsum("qht,thd->qhd", torch.softmax(s, dim=-1), v.to(acc))
    return out.to(wd)


def mla_attention_step(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, w_q_b, w_uk, w_uv, w_g, w_o, cache, block_table,
                       seq_lens, slot_mapping, eps: float, scale: float):
    """One MLA layer's attention half for N = B*Q tokens (sequence-major): -> out[N, D] (before the all-reduce
    at T=1 there is nothing to reduce). The new tokens' latents are written to `cache` (state) first."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    n_seq = block_table.shape[0]
    if n_seq == 0 or x.shape[0] % n_seq:
        raise ValueError(f"x: {x.shape[0]} tokens is not a multiple of the {n_seq} sequences in block_table")
    n_q, kv_lora = x.shape[0] // n_seq, kv_a_norm_w.shape[0]
    q_c, kv_c, k_rot = mla_qkv_a(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps)
    q_abs = mla_q_absorb(q_c, w_q_b, w_uk)
    mla_cache_write(torch.cat([kv_c, k_rot], dim=-1), cache, slot_mapping)
    o_latent = mla_decode_attn(q_abs.view(n_seq, n_q, *q_abs.shape[1:]), cache, block_table, seq_lens, scale, kv_lora)
    o = mla_out_gate(o_latent.reshape(x.shape[0], -1, kv_lora), w_uv, x, w_g)
    return linear(o, w_o)


# ---- tensor parallelism, simulated in one process --------------------------------------------------------------

def shard_heads(t, n_heads: int, tp: int, dim: int, name: str) -> list:
    """T contiguous head blocks of `t` along `dim` (which holds n_heads x per-head width), rank order."""
    if tp <= 0 or n_heads % tp:
        raise ValueError(f"tp={tp}: n_heads={n_heads} is not divisible by it; pick T dividing {n_heads}")
    if t.shape[dim] % n_heads:
        raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} is not a multiple of n_heads={n_heads}")
    return list(torch.chunk(t, tp, dim=dim))


def sum_partials_rank_order(partials: list):
    """The all-reduce of row-parallel partial outputs in the declared order (primitives.fold_ranks)."""
    return fold_ranks(partials)


def mla_attention_step_tp(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, w_q_b, w_uk, w_uv, w_g, w_o, cache, block_table,
                          seq_lens, slot_mapping, eps: float, scale: float, tp: int, *, return_partials=False):
    """mla_attention_step on T simulated ranks: qkv_a and the cache replicated; q_b/W_UK/attention/W_UV/g_proj by
    head; o_proj row-split, each rank's partial rounded to wd, then summed rank 0..T-1 in fp32 (acc).
    return_partials=True gives the unreduced partials [T, N, D] instead, for a fused all-reduce op to fold."""
    n_heads = w_uk.shape[0]
    n_seq, kv_lora = block_table.shape[0], kv_a_norm_w.shape[0]
    n_q = x.shape[0] // max(n_seq, 1)
    q_c, kv_c, k_rot = mla_qkv_a(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps)      # replicated: same on every rank
    # Every rank writes identical bits into its replica of the cache, so one shared replica stands for all.
    mla_cache_write(torch.cat([kv_c, k_rot], dim=-1), cache, slot_mapping)
    shards = zip(shard_heads(w_q_b, n_heads, tp, 0, "w_q_b"), shard_heads(w_uk, n_heads, tp, 0, "w_uk"),
                 shard_heads(w_uv, n_heads, tp, 0, "w_uv"), shard_heads(w_g, n_heads, tp, 0, "w_g"),
                 shard_heads(w_o, n_heads, tp, 1, "w_o"))
    partials = []
    for w_q_b_r, w_uk_r, w_uv_r, w_g_r, w_o_r in shards:
        q_abs = mla_q_absorb(q_c, w_q_b_r, w_uk_r)
        o_lat = mla_decode_attn(q_abs.view(n_seq, n_q, *q_abs.shape[1:]), cache, block_table, seq_lens, scale,
                                kv_lora)
        o = mla_out_gate(o_lat.reshape(x.shape[0], -1, kv_lora), w_uv_r, x, w_g_r)
        partials.append(linear(o, w_o_r))
    return torch.stack(partials) if return_partials else sum_partials_rank_order(partials)
