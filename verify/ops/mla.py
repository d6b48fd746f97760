"""Registry entries of the gated MLA family: input builders, outputs, batch dims and TP split rules.

Every tensor is drawn from its own generator (seed, salt) so one tensor's draw never shifts another's.
Weights are scaled by fan_in^-0.5 so every activation stays O(1); the case's dist shapes the activations
(x, q_c, q_abs, o_latent, latent, cache contents), weights stay normal.
"""
from __future__ import annotations

import math

import torch

from references.config import get_config
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, RankShard, SplitRule
from verify.ops.common_splits import scalar_param
from verify.model.values import draw, generator

_WORKING_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                   "float64": torch.float64}
# Longest context drawn per config, in pages. The float64 oracle of decode attention costs
# B x Q x H x L x C x 4 flops: at k3 (H=96, C=576) 64 sequences x 8 tokens x 4 pages of 64 is ~15 GFLOP.
MAX_CONTEXT_PAGES = {"tiny": 12, "small": 10, "k3": 4}
SPARE_PAGES = 2          # pages no sequence owns: a kernel that reads them gives wrong numbers
LARGE_CACHE_SLOTS = 1 << 16   # knob cache='large': the written slots straddle slot 2^16
# knob context='long' (mla_decode_attn): sequence 0 holds LONG_CONTEXT[config] + page + 1 slots and every
# sequence's pages sit past slot 2^16. Only tiny's sequence itself passes 2^16 slots: the guards call the
# reference ~120 times a case and the magnitudes cost Q x H x L x kv_lora (a tiny case: ~85 s of CPU)
LONG_CONTEXT = {"tiny": 1 << 16, "small": 1 << 10, "k3": 1 << 10}


def working_dtype(case: Case) -> torch.dtype:
    try:
        return _WORKING_DTYPES[case.dtype]
    except KeyError:
        raise ValueError(f"dtype={case.dtype!r} is unknown; choose one of {sorted(_WORKING_DTYPES)}") from None


def _weight(case, salt, shape, fan_in):
    return draw(generator(case.seed, salt), shape, "normal", scale=fan_in ** -0.5, dtype=working_dtype(case))


def _norm_weight(case, salt, n):
    # KimiRMSNorm weights sit near 1; the spread makes a dropped or misplaced weight visible.
    return (1.0 + draw(generator(case.seed, salt), (n,), "normal", scale=0.1, dtype=torch.float64)
            ).to(working_dtype(case))


def _activation(case, salt, shape, dist=None):
    return draw(generator(case.seed, salt), shape, dist or case.dist, dtype=working_dtype(case), row_seed=case.seed)


def latent_eps(case: Case) -> float:
    """q_a/kv_a RMSNorm eps: the `eps` knob, else 1e-6 (HF copies) or 1e-5 (vLLM) drawn from the seed."""
    eps = case.knob("eps")
    if eps is None:
        eps = (1e-6, 1e-5)[int(torch.randint(0, 2, (1,), generator=generator(case.seed, 90)))]
    return float(eps)


def q_per_seq(case: Case) -> int:
    """Query tokens per sequence (speculative decoding): the `q_per_seq` knob, else drawn in 1..8 from the seed."""
    n_q = case.knob("q_per_seq")
    if n_q is None:
        n_q = int(torch.randint(1, 9, (1,), generator=generator(case.seed, 91)))
    if not 1 <= int(n_q) <= 8:
        raise ValueError(f"q_per_seq={n_q!r}: decode takes 1..8 query tokens per sequence")
    return int(n_q)


def draw_seq_lens(case: Case, n_seq: int, n_q: int, page: int) -> list[int]:
    """Lengths around page boundaries (m*page - 1, m*page, m*page + 1: every page-aligned KV split boundary is one),
    the shortest legal length (only the new query tokens), the longest, and uniform ones."""
    g = generator(case.seed, 92)
    longest = MAX_CONTEXT_PAGES[case.config] * page
    lengths = []
    for _ in range(n_seq):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        m = int(torch.randint(1, MAX_CONTEXT_PAGES[case.config] + 1, (1,), generator=g))
        delta = int(torch.randint(-1, 2, (1,), generator=g))
        uniform = int(torch.randint(n_q, longest + 1, (1,), generator=g))
        length = (m * page + delta, n_q, longest, uniform)[kind]
        lengths.append(min(max(length, n_q), longest))
    return lengths


def paged_layout(case: Case, lengths: list[int], page: int, first_page: int = 0):
    """Block tables from a random permutation of the pages; -1 pads each row past its last page (and one spare
    column), so a kernel that reads past a sequence's pages faults or reads garbage. Pages below `first_page`
    belong to no sequence (they put the sequences' slots past 2^16)."""
    need = [-(-n // page) for n in lengths]
    n_pages = sum(need) + SPARE_PAGES
    perm = torch.randperm(n_pages, generator=generator(case.seed, 93)) + first_page
    table = torch.full((len(lengths), max(need, default=0) + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
    return table, torch.tensor(lengths, dtype=torch.int32), n_pages + first_page


def make_qkv_a_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    d, rows = cfg.hidden, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_dim
    return OpInputs(
        tensors={"x": _activation(case, 1, (case.batch, d)), "w_qkv_a": _weight(case, 2, (rows, d), d),
                 "q_a_norm_w": _norm_weight(case, 3, cfg.q_lora_rank),
                 "kv_a_norm_w": _norm_weight(case, 4, cfg.kv_lora_rank)},
        params={"eps": latent_eps(case)})


def make_q_absorb_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    h, dh, rope, ql = cfg.n_heads, cfg.head_dim, cfg.qk_rope_dim, cfg.q_lora_rank
    return OpInputs(tensors={"q_c": _activation(case, 11, (case.batch, ql)),
                             "w_q_b": _weight(case, 12, (h * (dh + rope), ql), ql),
                             "w_uk": _weight(case, 13, (h, dh, cfg.kv_lora_rank), dh)})


def q_absorb_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """Running-error magnitude of q_abs (fp64), in units of the working dtype (cand's: fp32 if none).
    q = q_c @ w_q_b.T is rounded to wd, and an implementation that sums q_b in another order rounds some
    q_d the other way (by u_wd |q_d|, after fp32 sums that err by ~u_fp32 mq_d, mq = |q_c| @ |w_q_b|.T);
    ql_c = sum_d q_d w_dc moves by the sum of those over d, plus its own fp32 sum's error:
      m(ql_c) = |ql_c| + (1 + f) sum_d |q_d| |w_dc| + f sum_d mq_d |w_dc|,   m(q_rot) = |q_rot| + f mq_rot,
    f = u_fp32 / u_wd. Where ql_c cancels (|ql_c| << sum_d |q_d w_dc|) two correct orders differ by ulps
    of the terms, not of ql_c (fp32, a CPU probe: 7x the row's baseline error at another batch
    position, where the row maximum's ulp allowed 3x)."""
    t = inputs.tensors
    wd = next(iter(cand.values())).dtype if cand else torch.float32
    f = torch.finfo(torch.float32).eps / torch.finfo(wd).eps
    q_c, w_q_b, w_uk = (t[n].to(torch.float64) for n in ("q_c", "w_q_b", "w_uk"))
    n_heads, head_dim, _ = w_uk.shape
    q = (q_c @ w_q_b.T).view(q_c.shape[0], n_heads, -1)
    mq = (q_c.abs() @ w_q_b.abs().T).view_as(q)
    ql = torch.einsum("bhd,hdc->bhc", q[..., :head_dim], w_uk)
    terms = torch.einsum("bhd,hdc->bhc", q[..., :head_dim].abs(), w_uk.abs())
    carried = torch.einsum("bhd,hdc->bhc", mq[..., :head_dim], w_uk.abs())
    m_ql = ql.abs() + (1 + f) * terms + f * carried
    m_rot = q[..., head_dim:].abs() + f * mq[..., head_dim:]
    return {"q_abs": torch.cat([m_ql, m_rot], dim=-1)}


def mla_q_absorb_bytes(inputs: OpInputs) -> int:
    """q_c, w_q_b and w_uk read; q_abs[B, H, kv_lora + rope] written."""
    t = inputs.tensors
    H, Dh, kv_lora = t["w_uk"].shape
    written = t["q_c"].shape[0] * H * (kv_lora + t["w_q_b"].shape[0] // H - Dh)
    read = sum(t[k].numel() for k in ("q_c", "w_q_b", "w_uk"))
    return (read + written) * t["q_c"].element_size()


def make_cache_write_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    n, page, width = case.batch, cfg.page_size, cfg.cache_dim
    n_pages = -(-n // page) + SPARE_PAGES
    g = generator(case.seed, 23)
    if case.knob("cache") == "large":
        # slots past 2^16 (and the cache past 2^16 slots): a kernel that keeps the slot or the row
        # offset in 16 bits writes over a low slot (certified while every drawn cache held < 200 slots)
        n_pages = -(-(LARGE_CACHE_SLOTS + n) // page)
        slots = LARGE_CACHE_SLOTS - n + torch.randperm(2 * n, generator=g)[:n].to(torch.int64)
    elif n >= 2 and torch.rand(1, generator=g).item() < 1 / 3:
        # a run of consecutive slots across a page boundary (a prefill chunk, or one sequence's draft
        # tokens), no padding: a fast path for runs that wraps at the page's end was certified while
        # every drawn mapping was a random permutation
        h = max(1, n // 2)                                       # slots before the boundary
        lo, hi = -(-h // page), (n_pages * page - n + h) // page     # boundaries j * page the run fits around
        start = page * int(torch.randint(lo, hi + 1, (1,), generator=g)) - h
        return _cache_write_inputs(case, n_pages, page, width, start + torch.arange(n, dtype=torch.int64))
    else:
        slots = torch.randperm(n_pages * page, generator=g)[:n].to(torch.int64)
    padding = torch.rand(n, generator=g) < 0.15      # padding tokens of a CUDA-graph batch
    # any negative slot is padding (OPS.md), -1 the usual one: half the padded slots take another
    # (a kernel that skips only -1 was certified while every padded slot held -1)
    other = torch.rand(n, generator=g) < 0.5
    slots[padding] = torch.where(other, -torch.randint(2, 2**31, (n,), generator=g), torch.full((n,), -1))[padding]
    return _cache_write_inputs(case, n_pages, page, width, slots)


def _cache_write_inputs(case: Case, n_pages: int, page: int, width: int, slots: torch.Tensor) -> OpInputs:
    # The cache starts full of other values, so a write to a wrong slot or a stray write shows.
    return OpInputs(tensors={"latent": _activation(case, 21, (slots.shape[0], width)),
                             "cache": draw(generator(case.seed, 22), (n_pages, page, width), "normal",
                                           dtype=working_dtype(case)),
                             "slot_mapping": slots})


def make_decode_attn_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    n_q, page = q_per_seq(case), cfg.page_size
    lengths = draw_seq_lens(case, case.batch, n_q, page)
    first_page = 0
    if case.knob("context") == "long":
        # slot indices past 2^16 (page ids and a sequence's own positions): a kernel that keeps a slot, a
        # position or a row offset in 16 bits reads another slot
        lengths[0] = LONG_CONTEXT[case.config] + page + 1
        first_page = -(-LARGE_CACHE_SLOTS // page)
    block_table, seq_lens, n_pages = paged_layout(case, lengths, page, first_page)
    return OpInputs(
        tensors={"q_abs": _activation(case, 31, (case.batch, n_q, cfg.n_heads, cfg.cache_dim)),
                 # nonfinite: NaN / inf in q only. The cache's slots past a sequence's length are never
                 # read by the reference, and whether a kernel may multiply a masked slot by p = 0 (NaN
                 # there if the slot holds NaN) is not declared: the cache stays finite
                 "cache": _activation(case, 32, (n_pages, page, cfg.cache_dim),
                                      dist="normal" if case.dist == "nonfinite" else None),
                 "block_table": block_table, "seq_lens": seq_lens},
        params={"scale": scalar_param(case, "scale", cfg.mla_scale, (1.5 * cfg.mla_scale, 0.125)),
                "kv_lora_rank": cfg.kv_lora_rank})


def decode_attn_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """Running-error magnitude of o_latent (fp64), in units of the working dtype (cand's: fp32 if none):
    o_i = sum_t p_t v_ti over a sequence's visible positions t, p = softmax(s), s_t = scale * q . k_t, so
      m(o_i) = |o_i| + f ((1 + 2 lse) sum_t p_t |v_ti| + sum_t p_t A_t |v_ti - o_i|),
      A_t = scale sqrt(C sum_c (q_c k_tc)^2),  lse = max_t |s_t| + log L,  f = u_fp32 / u_wd
    Any fp32 order of the C-long score sum errs by ds_t ~ u A_t (each of ~C additions rounds at the partial
    sum's size: sqrt(C) x the terms' rms for random-signed terms, sqrt(C) x an outlier term that sits in the
    sum from its first addition; A_t >= the l1 norm by Cauchy-Schwarz), which moves o_i by
    sum_t p_t ds_t (v_ti - o_i) (the softmax's first order). exp's arguments are rounded at the size of the
    max or LSE subtracted from them: a split-KV combine o = sum_c exp(lse_c - lse) o_c (FlashDecoding) scales
    each chunk's output by a weight that errs by ~u (|lse_c| + |lse|), which sum_t p_t |v_ti| bounds; any
    order of P @ V errs by ulps of sum_t p_t |v_ti| too. All are fp32 sums: against a bf16/fp16 output's
    ulps (f = 2^-16 / 2^-13) they vanish and |o_i|, the final rounding, is the scale; in fp32 they are most
    of the error a correct kernel makes (torch's SDPA, the C axis reversed, the split-KV reference: up to
    10x the floor of max |o| on outlier rows without them; property_tests/legit.py)."""
    from references.mla import causal_visible, paged_cache_read
    t = inputs.tensors
    wd = next(iter(cand.values())).dtype if cand else torch.float32
    f = torch.finfo(torch.float32).eps / torch.finfo(wd).eps
    q, cache, scale = t["q_abs"].to(torch.float64), t["cache"].to(torch.float64), inputs.params["scale"]
    lora, (n_q, width) = inputs.params["kv_lora_rank"], q.shape[1::2]
    mag = torch.zeros(*q.shape[:3], lora, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        length = int(t["seq_lens"][b])
        kv = paged_cache_read(cache, t["block_table"][b], length)                     # [L, C]
        v = kv[:, :lora]
        vis = causal_visible(length, n_q, 0, length).to(q.device)[:, None, :]
        s = torch.einsum("qhc,tc->qht", q[b], kv) * scale
        lse = s.masked_fill(~vis, 0.0).abs().amax(-1, keepdim=True) + math.log(length)  # [Q, H, 1]
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)                      # [Q, H, L]
        a = (torch.einsum("qhc,tc->qht", q[b].square(), kv.square()) * width).sqrt() * abs(scale)
        o = torch.einsum("qht,tc->qhc", p, v)
        step = max(1, (1 << 24) // o.numel())                    # [Q, H, L, lora] summed in ~128 MB slices
        spread = sum(((p * a)[..., t:t + step, None] * (v[t:t + step] - o.unsqueeze(2)).abs()).sum(2)
                     for t in range(0, length, step))
        mag[b] = o.abs() + f * ((1 + 2 * lse) * torch.einsum("qht,tc->qhc", p, v.abs()) + spread)
    return {"o_latent": mag}


def make_out_gate_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    h, dh, kv, d = cfg.n_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.hidden
    return OpInputs(tensors={"o_latent": _activation(case, 41, (case.batch, h, kv)),
                             "w_uv": _weight(case, 42, (h, dh, kv), kv),
                             "x": _activation(case, 43, (case.batch, d)),
                             "w_g": _weight(case, 44, (h * dh, d), d)})


# ---- split rules -------------------------------------------------------------------------------------------------

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical bits (so -0.0 != +0.0), any NaN equal to any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = a.isnan(), b.isnan()
    bits = _INT_VIEW[a.element_size()]
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a].view(bits), b[~nan_b].view(bits))


def replicated_split(state: tuple[str, ...] = ()) -> SplitRule:
    """Every rank gets the whole op (state cloned per rank: each rank holds its own replica); the ranks must agree
    bitwise, and rank 0's results stand for all."""
    def shard(inputs: OpInputs, tp: int) -> list[RankShard]:
        return [RankShard({k: v.clone() if k in state else v for k, v in inputs.tensors.items()},
                          dict(inputs.params)) for _ in range(tp)]

    def combine(per_rank: list[dict], inputs: OpInputs) -> dict:
        for r, res in enumerate(per_rank[1:], start=1):
            for name, t in res.items():
                if not same_bits(t, per_rank[0][name]):
                    raise ValueError(f"rank {r}: replicated result {name!r} differs from rank 0's")
        return dict(per_rank[0])

    return SplitRule(kind="replicated", shard=shard, combine=combine, reduction_order="none: replicated, no sum")


def head_split(n_heads_of, shard_dims: dict[str, int], out_dims: dict[str, int]) -> SplitRule:
    """Contiguous blocks of n_heads/T heads per rank: tensors in shard_dims are chunked along that dim (which holds
    heads x per-head width), the rest replicated; outputs concatenate along out_dims in rank order. No sums."""
    def shard(inputs: OpInputs, tp: int) -> list[RankShard]:
        n_heads = n_heads_of(inputs)
        if tp <= 0 or n_heads % tp:
            raise ValueError(f"tp={tp}: n_heads={n_heads} is not divisible by it; pick T dividing {n_heads}")
        parts = {k: torch.chunk(v, tp, dim=shard_dims[k]) for k, v in inputs.tensors.items() if k in shard_dims}
        return [RankShard({k: parts[k][r] if k in parts else v for k, v in inputs.tensors.items()},
                          dict(inputs.params)) for r in range(tp)]

    def combine(per_rank: list[dict], inputs: OpInputs) -> dict:
        return {name: torch.cat([res[name] for res in per_rank], dim=dim) for name, dim in out_dims.items()}

    return SplitRule(kind="heads", shard=shard, combine=combine,
                     reduction_order="none: heads concatenate in rank order, nothing is summed across ranks")


def mla_cache_write_bytes(inputs: OpInputs) -> int:
    """latent and slot_mapping read; one cache row written per slot >= 0 (padding writes nothing)."""
    t = inputs.tensors
    N, C = t["latent"].shape
    written = int((t["slot_mapping"] >= 0).sum())
    return (N + written) * C * t["latent"].element_size() + N * t["slot_mapping"].element_size()


def mla_qkv_a_bytes(inputs: OpInputs) -> int:
    """x, w_qkv_a and both norm weights read; q_c, kv_c and k_rot (one [B, rows of w_qkv_a] row each
    token, all told) written."""
    t = inputs.tensors
    read = sum(t[k].numel() * t[k].element_size() for k in ("x", "w_qkv_a", "q_a_norm_w", "kv_a_norm_w"))
    return read + t["x"].shape[0] * t["w_qkv_a"].shape[0] * t["x"].element_size()


def mla_out_gate_bytes(inputs: OpInputs) -> int:
    """o_latent, w_uv, x and w_g read once; o [B, H*Dh] written (the gate scratch between the two launches
    is the implementation's own traffic, not the op's)."""
    t = inputs.tensors
    read = sum(t[k].numel() * t[k].element_size() for k in ("o_latent", "w_uv", "x", "w_g"))
    return read + t["x"].shape[0] * t["w_g"].shape[0] * t["x"].element_size()


def grow_paged_lengths(inputs: OpInputs) -> dict[str, torch.Tensor] | None:
    """seq_lens grown by 1..3 tokens per sequence; a sequence whose last page is full takes a spare page
    (one not in any block table) into its table's first free column, as an engine appends a page
    (guard:grown_inputs); None when nothing can grow."""
    page = inputs.tensors["cache"].shape[1]
    table, lens = inputs.tensors["block_table"].clone(), inputs.tensors["seq_lens"].clone()
    used = set(int(p) for p in table.flatten().tolist() if p >= 0)
    spare = [p for p in range(inputs.tensors["cache"].shape[0]) if p not in used]
    for b in range(lens.shape[0]):
        n_pages = int((table[b] >= 0).sum())
        room = n_pages * page - int(lens[b])
        if room == 0 and spare and n_pages < table.shape[1]:
            table[b, n_pages] = spare.pop(0)
            room = page
        lens[b] += min(room, 1 + b % 3)
    if torch.equal(lens, inputs.tensors["seq_lens"]):
        return None
    return {"block_table": table, "seq_lens": lens}


def mla_decode_attn_bytes(inputs: OpInputs) -> int:
    """q_abs, block_table and seq_lens read; of the cache, each sequence's first seq_len slots (the
    keys and values it attends to: the rest of its pages is never read); o_latent written."""
    t, p = inputs.tensors, inputs.params
    B, Q, H, C = t["q_abs"].shape
    es = t["q_abs"].element_size()
    slots = int(t["seq_lens"].to(torch.int64).sum())
    small = sum(t[k].numel() * t[k].element_size() for k in ("q_abs", "block_table", "seq_lens"))
    return small + slots * C * t["cache"].element_size() + B * Q * H * p["kv_lora_rank"] * es


_NOTE_TOKENS = "batch = decode tokens (rows)."
OPS: list[OpDef] = [
    OpDef(
        name="mla_qkv_a", family="mla", reference="references.mla:mla_qkv_a", make_inputs=make_qkv_a_inputs,
        outputs=("q_c", "kv_c", "k_rot"),
        signature=("x[B,D] wd\nw_qkv_a[q_lora+kv_lora+rope, D] wd\nq_a_norm_w[q_lora] wd\nkv_a_norm_w[kv_lora] wd\n"
                   "eps: float (1e-6 HF / 1e-5 vLLM)\n-> q_c[B,q_lora] wd, kv_c[B,kv_lora] wd, k_rot[B,rope] wd"),
        batch_dims={"x": 0, "q_c": 0, "kv_c": 0, "k_rot": 0}, split=replicated_split(),
        fused="fused.mla_qkv_a:mla_qkv_a", moved_bytes=mla_qkv_a_bytes,
        notes=_NOTE_TOKENS + " eps drawn from {1e-6, 1e-5} unless the `eps` knob is set."),
    OpDef(
        name="mla_q_absorb", family="mla", reference="references.mla:mla_q_absorb", make_inputs=make_q_absorb_inputs,
        outputs=("q_abs",),
        signature="q_c[B,q_lora] wd\nw_q_b[H*(Dh+rope), q_lora] wd\nw_uk[H,Dh,kv_lora] wd\n-> q_abs[B,H,kv_lora+rope] wd",
        batch_dims={"q_c": 0, "q_abs": 0},
        split=head_split(lambda i: i.tensors["w_uk"].shape[0], {"w_q_b": 0, "w_uk": 0}, {"q_abs": 1}),
        magnitudes=q_absorb_magnitude, fused="fused.mla_q_absorb:mla_q_absorb", moved_bytes=mla_q_absorb_bytes,
        notes=_NOTE_TOKENS),
    OpDef(
        name="mla_cache_write", family="mla", reference="references.mla:mla_cache_write",
        make_inputs=make_cache_write_inputs, outputs=(), state=("cache",),
        signature="latent[N,C] wd\ncache[P,page,C] wd (state)\nslot_mapping[N] int64 (-1 = padding)\n-> None",
        batch_dims={"latent": 0, "slot_mapping": 0}, split=replicated_split(state=("cache",)),
        fused="fused.mla_cache_write:mla_cache_write", knob_sweep=({"cache": "large"},),
        moved_bytes=mla_cache_write_bytes,
        notes=_NOTE_TOKENS + " Slots are a random permutation of the cache's slots, about 15% set to -1; "
              "knob cache='large' (in every run): a cache of 2^16 + N slots, the written ones straddling slot 2^16. "
              "Half the padded slots hold a negative other than -1."),
    OpDef(
        name="mla_decode_attn", family="mla", reference="references.mla:mla_decode_attn",
        make_inputs=make_decode_attn_inputs, outputs=("o_latent",),
        signature=("q_abs[B,Q,H,C] wd (Q = 1..8 query tokens per sequence)\ncache[P,page,C] wd\n"
                   "block_table[B,max_pages] int32 (-1 padded)\nseq_lens[B] int32 (>= Q)\nscale: float (192^-0.5)\n"
                   "kv_lora_rank: int\n-> o_latent[B,Q,H,kv_lora] wd"),
        batch_dims={"q_abs": 0, "block_table": 0, "seq_lens": 0, "o_latent": 0},
        split=head_split(lambda i: i.tensors["q_abs"].shape[2], {"q_abs": 2}, {"o_latent": 2}),
        magnitudes=decode_attn_magnitude, fused="fused.mla_decode_attn:mla_decode_attn",
        moved_bytes=mla_decode_attn_bytes, grow_inputs=grow_paged_lengths,
        knob_sweep=({"context": "long"},),
        notes=("batch = sequences, each with Q query tokens (knob `q_per_seq`, else drawn 1..8 from the seed); the "
               "cache is shared by all sequences and never permuted. Context is capped at MAX_CONTEXT_PAGES pages "
               "(k3: 4 x 64 = 256) because the float64 oracle costs B*Q*H*L*C*4 flops (~15 GFLOP at k3, B=64, Q=8); "
               "page-boundary lengths still cover every page-aligned split boundary up to that length. Knob "
               "context='long' (in every run): sequence 0 of 2^16 + page + 1 slots (small, k3: 2^10 + page + 1) and "
               "every sequence's pages past slot 2^16.")),
    OpDef(
        name="mla_out_gate", family="mla", reference="references.mla:mla_out_gate", make_inputs=make_out_gate_inputs,
        outputs=("o",),
        signature="o_latent[B,H,kv_lora] wd\nw_uv[H,Dh,kv_lora] wd\nx[B,D] wd\nw_g[H*Dh,D] wd\n-> o[B,H*Dh] wd",
        batch_dims={"o_latent": 0, "x": 0, "o": 0},
        split=head_split(lambda i: i.tensors["o_latent"].shape[1], {"o_latent": 1, "w_uv": 0, "w_g": 0}, {"o": 1}),
        fused="fused.mla_out_gate:mla_out_gate", moved_bytes=mla_out_gate_bytes,
        notes=_NOTE_TOKENS + " At k3 w_g is 12288 x 7168 (88M values): about 2 s of CPU to draw and apply."),
]
