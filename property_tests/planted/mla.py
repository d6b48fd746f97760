"""Planted bugs in the MLA ops (references/mla.py)."""
from __future__ import annotations

import torch

from property_tests.planted import FP16_SAFETY_CLAMP
from references.mla import causal_visible, mla_decode_attn, mla_q_absorb, mla_qkv_a, paged_cache_read
from references.primitives import acc_dtype, linear

# ---------------------------------------------------------------------------------- mla_qkv_a


def _rms_norm_no_eps(x, weight, eps):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True))      # eps forgotten
    return weight.to(x.dtype) * y.to(x.dtype)


def mla_qkv_a_norm_without_eps(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float):
    """Latent RMSNorms written without eps: a zero row gives 0 * inf = NaN."""
    q_lora, kv_lora = q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
    qkv = linear(x, w_qkv_a)
    q_c = _rms_norm_no_eps(qkv[:, :q_lora], q_a_norm_w, eps)
    kv_c = _rms_norm_no_eps(qkv[:, q_lora:q_lora + kv_lora], kv_a_norm_w, eps)
    return q_c.contiguous(), kv_c.contiguous(), qkv[:, q_lora + kv_lora:].contiguous()


def mla_qkv_a_fp16_activation_clamp(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float):
    """The fp16 build's input clamp (+-64504, T5's clamp_value) kept on every dtype: bf16 / fp32 rows past
    it are clipped before the projection."""
    return mla_qkv_a(x.clamp(-FP16_SAFETY_CLAMP, FP16_SAFETY_CLAMP), w_qkv_a, q_a_norm_w, kv_a_norm_w, eps)


def _qkv_a_fused(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, *, kv_stats_from_q=False, eps_after_sqrt=False):
    """mla_qkv_a as the fused kernel computes it: the GEMM rounded to wd (one token row at a time, the
    batch-invariant GEMM helper of planted/gemm.py), both mean squares in fp32 from that one buffer,
    then y = wd(x rsqrt(ms + eps)), wd(y w). kv_stats_from_q: the kv part normalised with the q part's
    mean square (a fused kernel that reads the wrong one of its two reductions); eps_after_sqrt:
    x / (sqrt(ms) + eps) instead of x rsqrt(ms + eps)."""
    from property_tests.planted.gemm import linear as row_linear

    q_lora, kv_lora = q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
    qkv = row_linear(x, w_qkv_a)
    q32, kv32 = qkv[:, :q_lora].float(), qkv[:, q_lora:q_lora + kv_lora].float()
    ms_q, ms_kv = q32.pow(2).mean(-1, keepdim=True), kv32.pow(2).mean(-1, keepdim=True)
    if kv_stats_from_q:
        ms_kv = ms_q
    scale = (lambda ms: 1 / (ms.sqrt() + eps)) if eps_after_sqrt else (lambda ms: torch.rsqrt(ms + eps))
    norm = lambda v, ms, w: w.to(x.dtype) * (v * scale(ms)).to(x.dtype)
    return (norm(q32, ms_q, q_a_norm_w).contiguous(), norm(kv32, ms_kv, kv_a_norm_w).contiguous(),
            qkv[:, q_lora + kv_lora:].contiguous())


def mla_qkv_a_control(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float):
    """No bug: the helper mla_qkv_a_kv_norm_uses_q_stats plants its bug in (test_planted_bugs checks it certifies)."""
    return _qkv_a_fused(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps)


def mla_qkv_a_kv_norm_uses_q_stats(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float):
    """kv_c normalised by the q part's mean square instead of its own (the two reductions swapped)."""
    return _qkv_a_fused(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, kv_stats_from_q=True)


def mla_qkv_a_eps_after_sqrt(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float):
    """eps added after the square root, x / (sqrt(mean x^2) + eps): differs only where mean x^2 ~ eps."""
    return _qkv_a_fused(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, eps_after_sqrt=True)


# ---------------------------------------------------------------------------------- mla_q_absorb


def mla_q_absorb_rot_first(q_c, w_q_b, w_uk):
    """Epilogue stores [q_rot, ql] instead of [ql, q_rot] (the FlashMLA 'rope first' layout)."""
    out = mla_q_absorb(q_c, w_q_b, w_uk)
    kv_lora = w_uk.shape[2]
    return torch.cat([out[..., kv_lora:], out[..., :kv_lora]], dim=-1)


def _q_absorb_chunks(q_c, w_q_b, w_uk, *, chunk=8, rot_from_next=False):
    """q_b GEMM, then ql summed over Dh in `chunk`-row blocks (each block's sum in acc, the blocks added
    in acc), as a kernel that splits Dh over thread groups adds their partials. rot_from_next: q_rot of
    head h read from head h + 1's slice (the last head wraps to head 0), a head offset off by one in the
    epilogue's copy."""
    n_heads, head_dim, _ = w_uk.shape
    q = linear(q_c, w_q_b).view(q_c.shape[0], n_heads, -1)
    acc = acc_dtype(q)
    ql = torch.zeros(q.shape[0], n_heads, w_uk.shape[2], dtype=acc, device=q.device)
    for d in range(0, head_dim, chunk):
        part = torch.einsum("bhd,hdc->bhc", q[..., d:d + chunk].to(acc), w_uk[:, d:d + chunk].to(acc))
        ql = ql + part
    rot = q[..., head_dim:]
    if rot_from_next:
        rot = torch.roll(rot, -1, dims=1)      # BUG
    return torch.cat([ql.to(q.dtype), rot], dim=-1)


def mla_q_absorb_control(q_c, w_q_b, w_uk):
    """No bug: the chunked absorption the row below plants its bug in (test_planted_bugs checks it certifies)."""
    return _q_absorb_chunks(q_c, w_q_b, w_uk)


def mla_q_absorb_rot_from_next_head(q_c, w_q_b, w_uk):
    """q_rot copied from the neighbouring head's slice of q (head offset off by one): a rank holding one
    head still gets its own (the roll is the identity there), every other layout is wrong."""
    return _q_absorb_chunks(q_c, w_q_b, w_uk, rot_from_next=True)


# ---------------------------------------------------------------------------------- mla_cache_write


def _write_slots(flat, rows, slot_mapping, target=lambda s: s if s >= 0 else None) -> None:
    """flat[target(slot_mapping[i])] = rows[i], skipping a None target: the cache write the
    mla_cache_write rows plant their bugs in (by default the reference's: negative slots are padding)."""
    for i, s in enumerate(slot_mapping.tolist()):
        t = target(s)
        if t is not None:
            flat[t] = rows[i]


def mla_cache_write_pair_store(latent, cache, slot_mapping) -> None:
    """A 2-row vector store: writes latent[i] into its slot and zero-fills the other slot of the
    aligned pair (slot ^ 1), clobbering a neighbouring slot nobody asked to write."""
    flat = cache.view(-1, cache.shape[-1])
    for s in slot_mapping.tolist():
        if s >= 0:
            flat[s ^ 1] = 0
    _write_slots(flat, latent, slot_mapping)


def mla_cache_write_assumes_contiguous(latent, cache, slot_mapping) -> None:
    """Computes slot addresses as slot * C from the base pointer (ignores cache/latent strides):
    with padded rows it writes into the padding between rows."""
    P, page, C = cache.shape
    _write_slots(cache.as_strided((P * page, C), (C, 1), cache.storage_offset()),
                 latent.as_strided(latent.shape, (C, 1), latent.storage_offset()), slot_mapping)


# ---------------------------------------------------------------------------------- mla_decode_attn


def mla_decode_attn_scale_128(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """Hard-codes the softmax scale as head_dim^-0.5 = 128^-0.5, not (nope + rope)^-0.5 = 192^-0.5."""
    return mla_decode_attn(q_abs, cache, block_table, seq_lens, 128 ** -0.5, kv_lora_rank)


def _attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, *, causal_shift=0, probs_dtype=None,
          safe_softmax=False):
    n_seq, n_q, n_heads, _ = q_abs.shape
    acc = acc_dtype(q_abs)
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc)
    for b in range(n_seq):
        length = int(seq_lens[b])
        kv = paged_cache_read(cache, block_table[b], length).to(acc)
        s = torch.einsum("qhc,tc->qht", q_abs[b].to(acc), kv) * scale
        pos = torch.arange(length)
        last = length - n_q + torch.arange(n_q) + causal_shift
        s = s.masked_fill(~(pos[None, :] <= last[:, None])[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        if safe_softmax:                      # "no NaN out of attention": a row of NaN weights becomes zeros
            p = torch.nan_to_num(p, nan=0.0)
        p = p if probs_dtype is None else p.to(probs_dtype).to(acc)
        out[b] = torch.einsum("qht,tc->qhc", p, kv[:, :kv_lora_rank])
    return out.to(q_abs.dtype)


def mla_decode_attn_control(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """No bug: the helper the causal row plants its bug in (test_planted_bugs checks it certifies)."""
    return _attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)


def mla_decode_attn_safe_softmax(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """A "safe" softmax that turns NaN weights into zeros (written for rows with every key masked): a
    NaN or infinite query comes out as zeros instead of NaN."""
    return _attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, safe_softmax=True)


def mla_decode_attn_causal_off_by_one(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """Causal mask built with `<= last + 1`: each speculative query token also sees the next one."""
    return _attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, causal_shift=1)


def _split_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, *, drop_last_lse=False):
    """Split-KV over 2 page-aligned chunks and an LSE combine; drop_last_lse: the combine's logsumexp
    omits the last split's LSE (taking only the max with it)."""
    n_seq, n_q, n_heads, _ = q_abs.shape
    page, acc = cache.shape[1], acc_dtype(q_abs)
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc)
    for b in range(n_seq):
        length = int(seq_lens[b])
        kv_all = paged_cache_read(cache, block_table[b], length).to(acc)
        n_pages = -(-length // page)
        chunk = -(-n_pages // 2) * page
        parts_o, parts_lse = [], []
        for start in range(0, length, chunk):
            stop = min(length, start + chunk)
            kv = kv_all[start:stop]
            s = torch.einsum("qhc,tc->qht", q_abs[b].to(acc), kv) * scale
            s = s.masked_fill(~causal_visible(length, n_q, start, stop)[:, None, :], float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)
            d = e.sum(-1, keepdim=True)
            parts_o.append(torch.einsum("qht,tc->qhc", e, kv[:, :kv_lora_rank]) / torch.where(d > 0, d, 1))
            parts_lse.append((m + torch.log(d)).squeeze(-1))
        lse_i = torch.stack(parts_lse)
        if drop_last_lse and len(parts_lse) > 1:
            lse = torch.maximum(torch.logsumexp(lse_i[:-1], dim=0), lse_i[-1])      # BUG: last term's mass
        else:
            lse = torch.logsumexp(lse_i, dim=0)
        out[b] = (torch.exp(lse_i - lse)[..., None] * torch.stack(parts_o)).sum(0)
    return out.to(q_abs.dtype)


def mla_decode_attn_lse_drops_last_split(q_abs, cache, block_table, seq_lens, scale: float,
                                         kv_lora_rank: int):
    """Split-KV over 2 page-aligned chunks; the combine's logsumexp omits the last split's LSE, so
    the last chunk is weighted as if it held all the probability mass."""
    return _split_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, drop_last_lse=True)


def mla_decode_attn_split_control(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """No bug: the split-KV helper the dropped-LSE row plants its bug in (test_planted_bugs checks it certifies)."""
    return _split_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)


def _attn_rows(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, *, token_rows=False):
    """One query token at a time, its keys gathered through a block-table row with page ids clamped into
    the cache (a kernel's out-of-bounds guard). token_rows: the row is the flattened query-token index
    b * n_q + j (clamped to the last row), not the sequence b."""
    n_seq, n_q, n_heads, _ = q_abs.shape
    page, acc = cache.shape[1], acc_dtype(q_abs)
    out = torch.zeros(n_seq, n_q, n_heads, kv_lora_rank, dtype=acc)
    for b in range(n_seq):
        length = int(seq_lens[b])
        vis = causal_visible(length, n_q, 0, length)
        for j in range(n_q):
            row = min(b * n_q + j, n_seq - 1) if token_rows else b           # BUG when token_rows
            ids = block_table[row, :-(-length // page)].long().clamp(0, cache.shape[0] - 1)
            kv = cache[ids].reshape(-1, cache.shape[-1])[:length].to(acc)
            s = torch.einsum("hc,tc->ht", q_abs[b, j].to(acc), kv) * scale
            s = s.masked_fill(~vis[j][None, :], float("-inf"))
            out[b, j] = torch.einsum("ht,tc->hc", torch.softmax(s, dim=-1), kv[:, :kv_lora_rank])
    return out.to(q_abs.dtype)


def mla_decode_attn_token_indexed_block_table(q_abs, cache, block_table, seq_lens, scale: float,
                                              kv_lora_rank: int):
    """Page ids read from the block-table row of the flattened query token (b * n_q + j, clamped), not of
    the sequence: with drafts (n_q > 1) a sequence's later query tokens attend over another sequence's pages."""
    return _attn_rows(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, token_rows=True)


def mla_decode_attn_rows_control(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """No bug: the per-token gather the block-table row bug is planted in (test_planted_bugs checks it certifies)."""
    return _attn_rows(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32's 10 mantissa bits (round to nearest even), what a tensor core reads of fp32."""
    i = t.float().contiguous().view(torch.int32)
    i = (i + 0xFFF + ((i >> 13) & 1)) & ~0x1FFF
    return i.view(torch.float32)


def mla_decode_attn_fp32_tf32_scores(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """fp32 scores on TF32 operands (allow_tf32 left on for the score GEMM): exact for bf16/fp16 inputs
    (<= 10 mantissa bits), ~2^-11 relative per product in fp32."""
    if q_abs.dtype != torch.float32:
        return mla_decode_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)
    return mla_decode_attn(_tf32(q_abs), _tf32(cache), block_table, seq_lens, scale, kv_lora_rank)


def mla_decode_attn_fp32_bf16_probs(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """P rounded to bf16 before P @ V whatever the working dtype (a bf16 MMA for P @ V): legitimate for a
    bf16 kernel, 2^-9 relative per weight in an fp32 one."""
    return _attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, probs_dtype=torch.bfloat16)


def mla_decode_attn_flat_tokens(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """Returns the output in the kernel's token-major layout [B*Q, H, kv_lora], not [B, Q, H, kv_lora]."""
    o = mla_decode_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)
    return o.reshape(-1, o.shape[2], o.shape[3])


_CALLS = [0]


def mla_decode_attn_last_bit_race(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """Split-KV combine by atomics: which partial lands last changes from launch to launch, flipping
    the last bit of an output element (simulated by the launch count's parity)."""
    o = mla_decode_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)
    _CALLS[0] += 1
    if _CALLS[0] % 2:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
        flat = o.view(-1).view(bits)
        flat[0] += 1
    return o


# ---------------------------------------------------------------------------------- mla_out_gate


def _out_gate_rows(o_latent, w_uv, x, w_g, fused, gate_head_shift=0):
    """gate_head_shift: output columns of head h take the gate of head (h + shift) mod H."""
    acc = torch.float32
    wd = o_latent.dtype
    o = torch.einsum("bhc,hdc->bhd", o_latent.to(acc), w_uv.to(acc))
    g = x.to(acc) @ w_g.to(acc).T
    g = g.roll(-gate_head_shift * w_uv.shape[1], dims=1)
    if fused:               # one rounding at the end
        return (o.reshape(o.shape[0], -1) * torch.sigmoid(g)).to(wd)
    o = o.to(wd).reshape(o.shape[0], -1)
    gate = torch.sigmoid(g.to(wd).to(acc)).to(wd)
    return (o.to(acc) * gate.to(acc)).to(wd)


def mla_out_gate_row_parity_path(o_latent, w_uv, x, w_g):
    """Two CTAs per row pair: even rows keep the four K3 roundings, odd rows take a fused
    one-rounding epilogue. Both are within tolerance, but a row's bits depend on its batch index."""
    a = _out_gate_rows(o_latent, w_uv, x, w_g, fused=False)
    b = _out_gate_rows(o_latent, w_uv, x, w_g, fused=True)
    odd = (torch.arange(a.shape[0]) % 2 == 1)[:, None]
    return torch.where(odd, b, a)


def mla_out_gate_control(o_latent, w_uv, x, w_g):
    """No bug: the helper the neighbour-head gate row plants its bug in (test_planted_bugs checks it certifies)."""
    return _out_gate_rows(o_latent, w_uv, x, w_g, fused=False)


def mla_out_gate_next_head_gate(o_latent, w_uv, x, w_g):
    """The epilogue reads the gate at column (h + 1) * Dh + d (the next head's block of g, the last head
    wrapping to head 0): a CTA's gate pointer advanced by one head too many. Exact where a rank holds
    one head; every split with two or more heads per rank is wrong by whole gate values."""
    return _out_gate_rows(o_latent, w_uv, x, w_g, fused=False, gate_head_shift=1)


def mla_out_gate_swapped_rows(o_latent, w_uv, x, w_g):
    """Token index from blockIdx with the pair order reversed: rows 2i and 2i+1 are swapped."""
    y = _out_gate_rows(o_latent, w_uv, x, w_g, fused=False)
    B = y.shape[0]
    idx = torch.arange(B)
    pairs = idx[: B - B % 2].view(-1, 2).flip(-1).reshape(-1)
    idx[: B - B % 2] = pairs
    return y[idx].contiguous()


def mla_cache_write_flushes_denormals(latent, cache, slot_mapping) -> None:
    """Sets flush-to-zero for speed (torch.set_flush_denormal) and leaves it on: the copy is still
    bitwise right, but every later float32 op of this thread reads denormals as zero."""
    torch.set_flush_denormal(True)
    _write_slots(cache.view(-1, cache.shape[-1]), latent, slot_mapping)


def mla_cache_write_slot_u16(latent, cache, slot_mapping) -> None:
    """Slots staged through a 16-bit table: a slot at or past 2^16 wraps onto a low slot."""
    _write_slots(cache.view(-1, cache.shape[-1]), latent, slot_mapping, lambda s: s & 0xFFFF if s >= 0 else None)


def mla_cache_write_loses_negative_zero(latent, cache, slot_mapping) -> None:
    """The copy goes through an fp32 multiply-add (x * 1 + 0, a fused scale epilogue): -0.0 lands as +0.0."""
    _write_slots(cache.view(-1, cache.shape[-1]), (latent.float() * 1.0 + 0.0).to(latent.dtype), slot_mapping)


def mla_decode_attn_scale_from_shape(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """Softmax scale recomputed from the cache width (the rope part x 3)^-0.5, the scale argument ignored."""
    return mla_decode_attn(q_abs, cache, block_table, seq_lens, (3 * (cache.shape[-1] - kv_lora_rank)) ** -0.5,
                           kv_lora_rank)


def mla_cache_write_skips_only_minus1(latent, cache, slot_mapping) -> None:
    """Skips slot -1 only; another negative slot wraps like a Python index and lands in the cache."""
    flat = cache.view(-1, cache.shape[-1])
    _write_slots(flat, latent, slot_mapping, lambda s: s % flat.shape[0] if s != -1 else None)


def mla_cache_write_serving_path_wraps_pads(latent, cache, slot_mapping) -> None:
    """Under no_grad / inference_mode a path that masks only slot == -1: other negative padding slots
    wrap around (Python indexing) into the cache's last slots."""
    from references.mla import mla_cache_write
    if torch.is_grad_enabled():
        return mla_cache_write(latent, cache, slot_mapping)
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping != -1
    flat[slot_mapping[keep]] = latent[keep]
