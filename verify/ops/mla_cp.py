"""Registry entry for mla_decode_attn_cp (references/mla_cp.py): decode context parallelism of the MLA
decode attention, the cache of each sequence split over T ranks by slot ranges.

The unsplit inputs are mla_decode_attn's (lengths at page edges, 1..8 causal query tokens, -1 padded
block tables over a permuted cache with spare pages) with the whole sequence as the window. The split
is the context split: rank r gets its pages only (its own cache and block table) and its window;
ranks past a short sequence's end get an empty window (o = 0, lse = -inf) that the combine must
weigh to zero. The combine is the split-KV combine in rank order (references.mla_cp.combine_context).
"""
from __future__ import annotations

import math

import torch

from references.mla_cp import combine_context, context_shards
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, RankShard, SplitRule
from verify.ops.mla import decode_attn_magnitude, make_decode_attn_inputs

COMBINE_ORDER = ("rank 0..T-1: lse = logsumexp over the ranks' lse, o = left fold of exp(lse_r - lse) o_r in fp32 "
                 "(float64 for the oracle) over the ranks' wd partials, rounded once to wd")


def make_mla_decode_attn_cp_inputs(case: Case) -> OpInputs:
    base = make_decode_attn_inputs(case)
    t = dict(base.tensors)
    t["kv_start"] = torch.zeros_like(t["seq_lens"])
    t["kv_len"] = t["seq_lens"].clone()
    return OpInputs(t, dict(base.params))


def context_split() -> SplitRule:
    def shard(inputs: OpInputs, T: int) -> list[RankShard]:
        t = inputs.tensors
        if bool((t["kv_start"] != 0).any()) or not torch.equal(t["kv_len"], t["seq_lens"]):
            raise ValueError("kv_start/kv_len: the context split cuts whole sequences; give kv_start = 0 and "
                             "kv_len = seq_lens")
        return [RankShard({"q_abs": t["q_abs"], "seq_lens": t["seq_lens"], **part}, dict(inputs.params))
                for part in context_shards(t["cache"], t["block_table"], t["seq_lens"], T)]

    def combine(per_rank: list[dict], inputs: OpInputs) -> dict:
        o, lse = combine_context([(r["o_latent"], r["lse"]) for r in per_rank])
        return {"o_latent": o, "lse": lse}

    return SplitRule(kind="context", shard=shard, combine=combine, reduction_order=COMBINE_ORDER)


def cp_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """o_latent: mla_decode_attn's (decode_attn_magnitude). lse (fp32, units of fp32): |lse| + the
    softmax-weighted score magnitude sum_t p_t A_t + log L, A_t = scale sqrt(C sum_c (q_c k_tc)^2): any
    order of a C-long fp32 score sum errs by ~u A_t, which moves lse by sum_t p_t ds_t, and the max,
    exp and log of the logsumexp (and of the combine over ranks) round at |lse| and log L."""
    from references.mla import causal_visible, paged_cache_read

    mags = decode_attn_magnitude(inputs, cand)
    t = inputs.tensors
    q, cache, scale = t["q_abs"].to(torch.float64), t["cache"].to(torch.float64), inputs.params["scale"]
    n_q, width = q.shape[1], q.shape[3]
    mag = torch.zeros(q.shape[:3], dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        length = int(t["seq_lens"][b])
        kv = paged_cache_read(cache, t["block_table"][b], length)
        vis = causal_visible(length, n_q, 0, length).to(q.device)[:, None, :]
        s = (torch.einsum("qhc,tc->qht", q[b], kv) * scale).masked_fill(~vis, float("-inf"))
        p, lse = torch.softmax(s, -1), torch.logsumexp(s, -1)
        a = (torch.einsum("qhc,tc->qht", q[b].square(), kv.square()) * width).sqrt() * abs(scale)
        mag[b] = lse.abs() + (p * a).sum(-1) + math.log(length)
    return {**mags, "lse": mag}


def mla_decode_attn_cp_bytes(inputs: OpInputs) -> int:
    """q_abs, block_table and the window bounds read; of the cache, each sequence's window (the whole
    sequence unsplit); o_latent and lse written."""
    t, p = inputs.tensors, inputs.params
    B, Q, H, C = t["q_abs"].shape
    es = t["q_abs"].element_size()
    idx = sum(t[k].numel() * t[k].element_size() for k in ("block_table", "kv_start", "kv_len", "seq_lens"))
    cache = int(t["kv_len"].sum()) * C * t["cache"].element_size()
    return t["q_abs"].numel() * es + idx + cache + B * Q * H * (p["kv_lora_rank"] * es + 4)


OPS = [
    OpDef(
        name="mla_decode_attn_cp", family="mla_cp", reference="references.mla_cp:mla_decode_attn_cp",
        make_inputs=make_mla_decode_attn_cp_inputs, outputs=("o_latent", "lse"),
        signature=("q_abs[B,Q,H,C] wd (Q = 1..8)\ncache[P,page,C] wd (the rank's pages)\nblock_table[B,pages] int32 "
                   "(the window's pages from its start, -1 padded)\nkv_start[B] int32 (page-aligned window start)\n"
                   "kv_len[B] int32 (window slots)\nseq_lens[B] int32 (whole lengths: the causal mask)\n"
                   "scale: float\nkv_lora_rank: int\n-> o_latent[B,Q,H,kv_lora] wd, lse[B,Q,H] fp32"),
        batch_dims={"q_abs": 0, "block_table": 0, "kv_start": 0, "kv_len": 0, "seq_lens": 0, "o_latent": 0, "lse": 0},
        split=context_split(), collective="split", magnitudes=cp_magnitude, moved_bytes=mla_decode_attn_cp_bytes,
        notes=("The rank-local op of decode context parallelism; unsplit (kv_start = 0, kv_len = seq_lens) it is "
               "mla_decode_attn with its LSE. T > 1 cases shard by slot ranges (context_shards: ceil(pages / T) "
               "pages per rank, ranks past a sequence's end empty) and combine by the split-KV combine in rank "
               "order. Inputs as mla_decode_attn (knob q_per_seq); its long-context knob is not swept here (the "
               "float64 oracle of a 2^16-slot sequence costs ~85 s a case on a CPU).")),
]
