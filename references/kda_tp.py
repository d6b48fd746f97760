"""Tensor-parallel forms of the KDA ops (kimi-k3-math.md §1.2, vLLM nvidia/kda.py), run in one process.

Every KDA head is independent, so the ops shard by head: rank r of T owns heads
[r*H/T, (r+1)*H/T) and the matching H/T*Dh channels of q, k, v, z, g, conv and dt_bias, its
A_log entries, beta columns and state heads. f_a is replicated (every rank computes the same
low-rank gate input) and o_norm_w is shared by all heads. o_proj is row-parallel: each rank's
partial [B, D] is rounded to wd, and the partials are summed rank 0..T-1 (left fold) in fp32
(fp64 for the oracle) and rounded once to wd, as allreduce_attn_res_rmsnorm consumes them.

Shard functions take (tensors, params, T) and return T (tensors, params) pairs in rank order;
sharded state is a fresh contiguous copy, so a rank's in-place update never writes the unsplit
input. Combine functions take the per-rank result dicts (outputs and state after the call).
"""
from __future__ import annotations

import torch

from references.kda import in_proj_layout
from references.primitives import fold_ranks

Tensors = dict[str, torch.Tensor]
IN_PROJ_OUTPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")


def heads_per_rank(n_heads: int, T: int) -> int:
    if not isinstance(T, int) or T <= 0 or n_heads % T:
        raise ValueError(f"T: {T!r} does not divide n_heads={n_heads}; pick T in the divisors of {n_heads}")
    return n_heads // T


def _rank_slices(n_heads: int, head_dim: int, T: int, rank: int) -> tuple[slice, slice]:
    """(head slice, channel slice) owned by `rank`."""
    hl = heads_per_rank(n_heads, T)
    return slice(rank * hl, (rank + 1) * hl), slice(rank * hl * head_dim, (rank + 1) * hl * head_dim)


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().clone()


def shard_in_proj_weights(w_in: torch.Tensor, w_fb: torch.Tensor, n_heads: int, T: int) -> list[Tensors]:
    """Per rank: w_in rows [q_r | k_r | v_r | z_r | f_a (all) | beta_r] (same layout, H/T heads), w_fb rows."""
    C, r = w_fb.shape
    head_dim = C // n_heads
    layout = in_proj_layout(n_heads, head_dim, r)
    out = []
    for rank in range(T):
        hs, cs = _rank_slices(n_heads, head_dim, T, rank)
        rows = [w_in[layout[p]][cs] for p in ("q", "k", "v", "z")]
        rows += [w_in[layout["f_a"]], w_in[layout["beta"]][hs]]
        out.append({"w_in": torch.cat(rows, 0).contiguous(), "w_fb": _own(w_fb[cs])})
    return out


def shard_decode_tensors(t: Tensors, T: int) -> list[Tensors]:
    """Shard kda_decode's per-head tensors (any of those present in `t`); o_norm_w is replicated."""
    H, Dh = t["state"].shape[1], t["state"].shape[-1]
    out = []
    for rank in range(T):
        hs, cs = _rank_slices(H, Dh, T, rank)
        r: Tensors = {}
        for name in ("q_raw", "k_raw", "v_raw", "g_raw", "z", "dt_bias"):
            if name in t:
                r[name] = _own(t[name][..., cs])
        if "beta_raw" in t:
            r["beta_raw"] = _own(t["beta_raw"][:, hs])
        r["conv_w"] = _own(t["conv_w"][:, cs])
        r["conv_state"] = _own(t["conv_state"][:, :, cs])
        r["A_log"] = _own(t["A_log"][hs])
        r["state"] = _own(t["state"][:, hs])
        r["o_norm_w"] = t["o_norm_w"]
        out.append(r)
    return out


def fold_partial_sums(partials: list[torch.Tensor]) -> torch.Tensor:
    """o_proj partial outputs summed in the declared order (primitives.fold_ranks)."""
    return fold_ranks(partials)


# ---------------------------------------------------------------------------------------------- kda_in_proj


def shard_kda_in_proj(tensors: Tensors, params: dict, T: int) -> list[tuple[Tensors, dict]]:
    H = params["n_heads"]
    hl = heads_per_rank(H, T)
    ws = shard_in_proj_weights(tensors["w_in"], tensors["w_fb"], H, T)
    return [({"x": tensors["x"], **w}, {**params, "n_heads": hl}) for w in ws]


def combine_kda_in_proj(per_rank: list[Tensors]) -> Tensors:
    """Every piece is per head (or per channel): concatenate along the last dim in rank order."""
    return {name: torch.cat([r[name] for r in per_rank], -1) for name in IN_PROJ_OUTPUTS}


# ---------------------------------------------------------------------------------------------- kda_decode


def shard_kda_decode(tensors: Tensors, params: dict, T: int) -> list[tuple[Tensors, dict]]:
    return [(r, dict(params)) for r in shard_decode_tensors(tensors, T)]


def combine_kda_decode(per_rank: list[Tensors]) -> Tensors:
    return {"y": torch.cat([r["y"] for r in per_rank], -1),
            "conv_state": torch.cat([r["conv_state"] for r in per_rank], 2),
            "state": torch.cat([r["state"] for r in per_rank], 1)}


# ---------------------------------------------------------------------------------------------- kda_attention_step


def shard_kda_attention_step(tensors: Tensors, params: dict, T: int) -> list[tuple[Tensors, dict]]:
    """In-proj columns and decode tensors by head, o_proj by input columns (row-parallel)."""
    H = params["n_heads"]
    hl = heads_per_rank(H, T)
    Dh = tensors["o_norm_w"].shape[0]
    ws = shard_in_proj_weights(tensors["w_in"], tensors["w_fb"], H, T)
    ds = shard_decode_tensors(tensors, T)
    out = []
    for rank in range(T):
        _, cs = _rank_slices(H, Dh, T, rank)
        r = {"x": tensors["x"], **ws[rank], **ds[rank], "w_o": _own(tensors["w_o"][:, cs])}
        out.append((r, {**params, "n_heads": hl}))
    return out


def combine_kda_attention_step(per_rank: list[Tensors]) -> Tensors:
    """out = fold of the per-rank partial o_proj sums (rank-ascending, fp32); state by head."""
    return {"out": fold_partial_sums([r["out"] for r in per_rank]),
            "conv_state": torch.cat([r["conv_state"] for r in per_rank], 2),
            "state": torch.cat([r["state"] for r in per_rank], 1)}
