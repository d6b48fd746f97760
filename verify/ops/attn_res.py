"""Registry entries for AttnRes: attn_res_rmsnorm and allreduce_attn_res_rmsnorm (references/attn_res.py).

Sources are drawn at per-block scales (block sums of up to 24 sub-layer outputs differ in size);
the query res_norm_w * res_proj_w has rms ~ 2/sqrt(D), so scores are O(1) and the softmax is
neither uniform nor one-hot. The slots of blocks beyond n_blocks hold values too: they must be
ignored, and they catch a kernel reading too many sources.
"""
from __future__ import annotations

import math

import torch

from references.attn_res import MAX_SOURCES, attn_res_probs
from references.config import get_config
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs
from verify.ops.common_splits import (FOLD_ORDER, RMS_EPS_DRAWS, activation, gen_for, norm_weight,
                                      replicated_split, scalar_param, working_dtype)
from verify.model.values import EDGE_DISTS, GENERIC_DISTS, draw

BLOCK_SLOTS = MAX_SOURCES - 1          # blocks[B, 8, D]
DEFAULT_PARTIALS = 4                   # partial deltas of the all-reduce when the case is unsplit (tp=1)


def _layout(case: Case) -> tuple[int, int]:
    """(n_blocks, block_write) from knobs or the seed: write slot n_blocks (HF appends) or -1."""
    g = gen_for(case, "layout")
    n_blocks = int(torch.randint(0, BLOCK_SLOTS + 1, (1,), generator=g))
    write = bool(torch.rand(1, generator=g) < 0.5) and n_blocks < BLOCK_SLOTS
    n_blocks = int(case.knob("n_blocks", n_blocks))
    block_write = int(case.knob("block_write", n_blocks if write else -1))
    return n_blocks, block_write


def _common(case: Case, scale: float) -> tuple[dict, dict]:
    cfg = get_config(case.config)
    wd, B, D = working_dtype(case), case.batch, cfg.hidden
    n_blocks, block_write = _layout(case)
    block_scales = torch.exp2(torch.randint(-2, 3, (BLOCK_SLOTS,), generator=gen_for(case, "block_scales")))
    blocks = torch.stack([activation(case, f"block{i}", (B, D), wd, scale=scale * float(block_scales[i]))
                          for i in range(BLOCK_SLOTS)], dim=1)
    proj = (torch.randn(D, generator=gen_for(case, "res_proj_w"), dtype=torch.float64) * 2 * D ** -0.5
            * float(case.knob("score_scale", 1.0)))
    tensors = {
        "prefix": activation(case, "prefix", (B, D), wd, scale=scale),
        "blocks": blocks,
        "res_norm_w": norm_weight(case, "res_norm_w", D, wd),
        "res_proj_w": proj.to(wd),
        "norm_w": norm_weight(case, "norm_w", D, wd),
    }
    params = {"n_blocks": n_blocks, "block_write": block_write,
              "eps": scalar_param(case, "eps", cfg.rms_eps, RMS_EPS_DRAWS),
              "norm_eps": scalar_param(case, "norm_eps", cfg.rms_eps, RMS_EPS_DRAWS)}
    return tensors, params


def attn_res_out_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """Running-error magnitude of out (fp64), in units of the working dtype (cand's: fp32 if none):
    out_i = norm_w_i r mix_i, mix_i = sum_s a_s v_si, so
      m(out_i) = |norm_w_i| r (sum_s a_s |v_si| + f sum_s a_s A_s |v_si - mix_i| + a_p P |p_i - mix_i|),
      A_s = |key_s * q|_2,  f = u_fp32 / u_wd,  P = (A_p + |score_p| |p^2|_2 / |p|_2^2) / sqrt(3)
    (a = the softmax weights, r = the RMSNorm scale, A_s the l2 norm of the score's terms: any order of
    a length-D fp32 sum errs by about sqrt(D) u A_s, and the floor's ulps carry the sqrt(D)). Where the
    sources cancel at i (|mix_i| << sum_s a_s |v_si|), the rounding of p = prefix + delta to the working
    dtype, which every implementation shares and the fp64 oracle does not, moves out_i by ulps of the
    terms, not of out_i. A score error ds_s (fp32: ~sqrt(D) u_fp32 A_s, ~2^-15 relative at |score| ~ 300,
    the score_scale case) moves mix_i by sum_s a_s ds_s (v_si - mix_i) (the softmax's first order), far more
    than ulps of out in fp32; f puts that fp32 term in the working dtype's ulps. The last term is the
    rounding of p (the last source) to wd through its own score: each p_i moves by up to 0.5 ulp_wd
    (std u / sqrt(3) relative), its score by u P (the dot's terms and the key norm's mean p^2), the mix by
    a_p ds_p (p_i - mix_i); with a few large terms (wide_range) that is ulps of out: a fused kernel 1.6
    ulp from the exact result on the rounded p stood 2.7 fp16 ulps from the oracle, 1.07x the rule
    without it (H200, seed 20, k3, B = 20)."""
    t, p = inputs.tensors, inputs.params
    wd = next(iter(cand.values())).dtype if cand else torch.float32
    f = torch.finfo(torch.float32).eps / torch.finfo(wd).eps
    d = {n: v.to(torch.float64) for n, v in t.items()}
    delta = d["delta"] if "delta" in d else d["deltas"].sum(0)
    src = torch.cat([d["blocks"][:, :p["n_blocks"]], (d["prefix"] + delta).unsqueeze(1)], dim=1)
    probs = attn_res_probs(src, d["res_norm_w"], d["res_proj_w"], p["eps"])
    keys = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + p["eps"])
    query = d["res_norm_w"] * d["res_proj_w"].reshape(-1)
    score_mag = (keys * query).norm(dim=-1)                                                  # A_s [B, S]
    mix = torch.matmul(probs.unsqueeze(1), src).squeeze(1)
    r = torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + p["norm_eps"])
    spread = torch.matmul((probs * score_mag).unsqueeze(1), (src - mix.unsqueeze(1)).abs()).squeeze(1)
    terms = torch.matmul(probs.unsqueeze(1), src.abs()).squeeze(1) + f * spread
    # p's own rounding to wd moves its score, by ds_p ~ u_wd / sqrt(3) (A_p + |score_p| |p^2|_2 / |p|^2)
    # (the dot's terms, and the key norm through mean p^2), and the mix by a_p ds_p (p_i - mix_i):
    # shared by every implementation (p is state, bitwise), absent from the oracle, at u_wd, not f u_wd
    pv = src[:, -1]
    p2 = pv.pow(2).sum(-1)
    flat = torch.where(p2 > 0, pv.pow(2).norm(dim=-1) / p2.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    score_p = (keys[:, -1] * query).sum(-1)
    ds_p = (score_mag[:, -1] + score_p.abs() * flat) / math.sqrt(3.0)
    terms = terms + (probs[:, -1] * ds_p).unsqueeze(-1) * (pv - mix).abs()
    return {"out": terms * r * d["norm_w"].abs()}


def make_attn_res_rmsnorm_inputs(case: Case) -> OpInputs:
    tensors, params = _common(case, 1.0)
    delta = activation(case, "delta", tensors["prefix"].shape, working_dtype(case))
    return OpInputs({"prefix": tensors.pop("prefix"), "delta": delta, **tensors}, params)


def order_sensitive_deltas(case: Case, n_parts: int, shape, wd: torch.dtype) -> tuple[torch.Tensor, float]:
    """Partials [big, s1, -big, s3, s4, ...] with |big| / |s| ~ 2^24: a left fold in fp32 loses s1
    to the rounding of big + s1, another order loses other terms, so the sum depends on order.
    Returns (deltas, scale of the small terms); fp16 uses big ~ 2^12, small ~ 2^-12 to stay finite."""
    g = gen_for(case, "deltas")
    big_scale, small = (2.0 ** 12, 2.0 ** -12) if wd == torch.float16 else (2.0 ** 24, 1.0)
    big = draw(g, shape, "normal", scale=big_scale, dtype=wd)
    parts = [draw(g, shape, "normal", scale=small, dtype=wd) for _ in range(n_parts)]
    parts[0] = big
    if n_parts >= 3:
        parts[2] = -big
    return torch.stack(parts), small


def make_allreduce_attn_res_rmsnorm_inputs(case: Case) -> OpInputs:
    wd = working_dtype(case)
    n_parts = case.tp if case.tp > 1 else int(case.knob("partials", DEFAULT_PARTIALS))
    B, D = case.batch, get_config(case.config).hidden
    if case.dist == "order_sensitive":
        deltas, small = order_sensitive_deltas(case, n_parts, (B, D), wd)
        tensors, params = _common(case, small)      # sources as small as the surviving sum
    else:
        tensors, params = _common(case, 1.0)
        # partials of one sub-layer output: each rank's share ~ 1/sqrt(T) so the sum stays O(1)
        deltas = torch.stack([activation(case, f"delta{r}", (B, D), wd, scale=n_parts ** -0.5)
                              for r in range(n_parts)])
    return OpInputs({"prefix": tensors.pop("prefix"), "deltas": deltas, **tensors}, params)


_SIG = ("prefix[B,D] wd (state), {delta}, blocks[B,8,D] wd (state), res_norm_w[D] wd, res_proj_w[D] wd, "
        "norm_w[D] wd, n_blocks: int (0..8), block_write: int (-1 or slot), eps: float, norm_eps: float "
        "-> out[B,D] wd")
_NOTES = ("Replicated over TP: every rank runs the same op on the same inputs and must produce the same "
          "bits. n_blocks/block_write come from the seed (knobs 'n_blocks', 'block_write' override); knob "
          "'score_scale' multiplies res_proj_w (64 with 7 blocks in every run: scores past exp's fp32 range).")

# Scores ~64x the drawn ones (|score| up to a few hundred) over 7 blocks: exp overflows fp32 without
# the softmax's running max (a probe that dropped the max was certified while every score stayed O(1)).
SCORE_SWEEP = ({"score_scale": 64.0, "n_blocks": 7},)

def attn_res_rmsnorm_bytes(inputs: OpInputs) -> int:
    """prefix read and written, delta (or the T partial deltas) and the n_blocks live blocks read, the three weights read, out
    written, and the block slot written when block_write >= 0."""
    t, p = inputs.tensors, inputs.params
    B, D = t["prefix"].shape
    e = t["prefix"].element_size()
    n_deltas = t["deltas"].shape[0] if "deltas" in t else 1
    rows = 2 + n_deltas + p["n_blocks"] + 1 + (1 if p["block_write"] >= 0 else 0)   # prefix rw, deltas, blocks, out, write
    return (rows * B * D + 3 * D) * e


OPS = [
    OpDef(
        name="attn_res_rmsnorm", family="attn_res", reference="references.attn_res:attn_res_rmsnorm",
        make_inputs=make_attn_res_rmsnorm_inputs, outputs=("out",), state=("prefix", "blocks"),
        signature=_SIG.format(delta="delta[B,D] wd"),
        batch_dims={"prefix": 0, "delta": 0, "blocks": 0, "out": 0},
        split=replicated_split(), fused="fused.attn_res_rmsnorm:attn_res_rmsnorm",
        notes=_NOTES, knob_sweep=SCORE_SWEEP, magnitudes=attn_res_out_magnitude,
        moved_bytes=attn_res_rmsnorm_bytes, bench_knobs=({"n_blocks": 8, "block_write": -1},),
    ),
    OpDef(
        name="allreduce_attn_res_rmsnorm", family="attn_res", collective="gathered_partials",
        reference="references.attn_res:allreduce_attn_res_rmsnorm",
        make_inputs=make_allreduce_attn_res_rmsnorm_inputs, outputs=("out",), state=("prefix", "blocks"),
        signature=_SIG.format(delta="deltas[T,B,D] wd (partials, summed rank 0..T-1 in fp32)"),
        batch_dims={"prefix": 0, "deltas": 1, "blocks": 0, "out": 0},
        split=replicated_split(FOLD_ORDER, order_sensitive=True),
        dists=GENERIC_DISTS + EDGE_DISTS + ("order_sensitive",), knob_sweep=SCORE_SWEEP, magnitudes=attn_res_out_magnitude,
        fused="fused.allreduce_attn_res_rmsnorm:allreduce_attn_res_rmsnorm", moved_bytes=attn_res_rmsnorm_bytes,
        bench_knobs=({"n_blocks": 8, "block_write": -1},),
        notes=_NOTES + " deltas has T partials (T = case.tp, or knob 'partials' (default 4) when tp=1); "
              "dist order_sensitive draws partials with cancelling magnitudes ~2^24 apart.",
    ),
]
