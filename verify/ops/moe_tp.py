"""Registry entry for allreduce_latent_norm_up (references/moe_tp.py): the MoE's tail on a rank, from the
gathered partials of the latent output and the shared experts to the layer's output.

The partials are T ranks' shares (T = case.tp, or knob 'partials' when the case is unsplit) of a
sub-layer output: each ~ 1/sqrt(T) so the folds stay O(1). The order_sensitive dist draws partials
~2^24 apart that cancel (allreduce_fold's), in both halves; the knob sweep reaches T = 1 (the
unsplit layer: the folds are copies) and T = 16 (K3's largest degree).
"""
from __future__ import annotations

import torch

from references.config import get_config
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, Peer
from verify.model.values import EDGE_DISTS, GENERIC_DISTS, draw
from verify.ops.common_splits import (FOLD_ORDER, RMS_EPS_DRAWS, activation, gen_for, norm_weight,
                                      replicated_split, scalar_param, weight, working_dtype)

DEFAULT_PARTIALS = 4                   # partials of each half when the case is unsplit (tp=1)
MAX_PARTIALS = 16                      # K3's largest tensor-parallel degree


def _partials(case: Case, name: str, n_parts: int, shape: tuple, wd: torch.dtype) -> torch.Tensor:
    """[T, *shape]: each rank's share of an O(1) sum, or (dist order_sensitive) [big, s1, -big, s3, ...]
    with |big| / |s| ~ 2^24 (2^12 / 2^-12 in fp16): a left fold in fp32 loses s1 to big + s1's rounding."""
    if case.dist != "order_sensitive":
        return torch.stack([activation(case, f"{name}{r}", shape, wd, scale=n_parts ** -0.5) for r in range(n_parts)])
    g = gen_for(case, name)
    big_scale, small = (2.0 ** 12, 2.0 ** -12) if wd == torch.float16 else (2.0 ** 24, 1.0)
    parts = [draw(g, shape, "normal", scale=big_scale if r in (0, 2) else small, dtype=wd) for r in range(n_parts)]
    if n_parts >= 3:
        parts[2] = -parts[0]
    return torch.stack(parts)


def make_allreduce_latent_norm_up_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, D, L = working_dtype(case), case.batch, cfg.hidden, cfg.latent
    n_parts = case.tp if case.tp > 1 else int(case.knob("partials", DEFAULT_PARTIALS))
    return OpInputs({"prefix": activation(case, "prefix", (B, D), wd),
                     "y_parts": _partials(case, "y_part", n_parts, (B, L), wd),
                     "shared_parts": _partials(case, "shared_part", n_parts, (B, D), wd),
                     "norm_w": norm_weight(case, "norm_w", L, wd),
                     "w_up": weight(case, "w_up", (D, L), L, wd)},
                    {"eps": scalar_param(case, "eps", cfg.rms_eps, RMS_EPS_DRAWS)})


def allreduce_latent_norm_up_bytes(inputs: OpInputs) -> int:
    """prefix, both halves' T partials, norm_w and w_up read once; out [B, D] written."""
    t = inputs.tensors
    read = sum(v.numel() * v.element_size() for v in t.values())
    return read + t["prefix"].numel() * t["prefix"].element_size()


OPS = [
    OpDef(
        name="allreduce_latent_norm_up", family="moe_tp", reference="references.moe_tp:allreduce_latent_norm_up",
        make_inputs=make_allreduce_latent_norm_up_inputs, outputs=("out",),
        signature=("prefix[B,D] wd, y_parts[T,B,L] wd, shared_parts[T,B,D] wd (the T ranks' partials, rank "
                   "order), norm_w[L] wd, w_up[D,L] wd, eps: float -> out[B,D] wd = prefix + "
                   "latent_norm_up(fold(y_parts), norm_w, w_up, fold(shared_parts), eps)"),
        batch_dims={"prefix": 0, "y_parts": 1, "shared_parts": 1, "out": 0},
        split=replicated_split(FOLD_ORDER, order_sensitive=True),
        dists=GENERIC_DISTS + EDGE_DISTS + ("order_sensitive",),
        knob_sweep=({"partials": 1}, {"partials": MAX_PARTIALS}),
        fused="fused.allreduce_latent_norm_up:allreduce_latent_norm_up", moved_bytes=allreduce_latent_norm_up_bytes,
        bench_knobs=({"partials": 1}, {"partials": 8}, {"partials": 16}),
        peers=(Peer("fold_norm_up_add", "verify.bench.peers:fold_norm_up_add"),),
        notes="Replicated over TP: every rank folds the same gathered partials (the MoE's [T, B, L + D] "
              "all-gather, its two column halves) and must give the same bits. y_parts and shared_parts have "
              "T = case.tp partials, or knob 'partials' (default 4) when tp=1; dist order_sensitive draws "
              "partials with cancelling magnitudes ~2^24 apart. The fold order is judged bitwise by "
              "allreduce_fold; here the folds feed the RMSNorm and the adds, and out is judged by its bound.",
    ),
]
