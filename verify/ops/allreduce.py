"""Registry entry for allreduce_fold (references/allreduce.py): the rank-order fold of T gathered partials.

The partials are the MoE's [B, L + D] row of one rank (the latent and shared-experts partials the
layer folds in one all-reduce), T = case.tp, or knob 'partials' when the case is unsplit. The
order_sensitive dist draws partials ~2^24 apart that cancel, so any other summation order gives
other bits; the knob sweep reaches T = 1, T = 16 and a row of no whole 16-byte vectors.
"""
from __future__ import annotations

import torch

from references.config import get_config
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs
from verify.model.values import EDGE_DISTS, GENERIC_DISTS
from verify.ops.attn_res import DEFAULT_PARTIALS, order_sensitive_deltas
from verify.ops.common_splits import FOLD_ORDER, activation, replicated_split, working_dtype

MAX_PARTIALS = 16                      # K3's largest tensor-parallel degree


def fold_width(case: Case) -> int:
    """N: the MoE's latent + hidden row, or one less (knob width='odd': no 16-byte vector divides it)."""
    cfg = get_config(case.config)
    width = case.knob("width", "moe")
    if width not in ("moe", "odd"):
        raise ValueError(f"knob width: {width!r}; choose 'moe' (latent + hidden) or 'odd' (one less)")
    return cfg.latent + cfg.hidden - (width == "odd")


def make_allreduce_fold_inputs(case: Case) -> OpInputs:
    wd = working_dtype(case)
    n_parts = case.tp if case.tp > 1 else int(case.knob("partials", DEFAULT_PARTIALS))
    shape = (case.batch, fold_width(case))
    if case.dist == "order_sensitive":
        parts, _ = order_sensitive_deltas(case, n_parts, shape, wd)
    else:
        # one rank's share of a sub-layer output ~ 1/sqrt(T): the sum stays O(1)
        parts = torch.stack([activation(case, f"part{r}", shape, wd, scale=n_parts ** -0.5) for r in range(n_parts)])
    return OpInputs({"parts": parts})


def allreduce_fold_bytes(inputs: OpInputs) -> int:
    """The T partial rows read and the folded row written."""
    parts = inputs.tensors["parts"]
    T, B, N = parts.shape
    return (T + 1) * B * N * parts.element_size()


OPS = [
    OpDef(
        name="allreduce_fold", family="allreduce", reference="references.allreduce:allreduce_fold",
        make_inputs=make_allreduce_fold_inputs, outputs=("out",),
        signature="parts[T,B,N] wd (the T ranks' partials, rank order) -> out[B,N] wd (rank 0..T-1 fold in fp32)",
        batch_dims={"parts": 1, "out": 0},
        split=replicated_split(FOLD_ORDER, order_sensitive=True),
        dists=GENERIC_DISTS + EDGE_DISTS + ("order_sensitive",),
        knob_sweep=({"partials": 1}, {"partials": MAX_PARTIALS}, {"width": "odd"}),
        fused="fused.allreduce_fold:allreduce_fold", moved_bytes=allreduce_fold_bytes,
        bench_knobs=({"partials": 8}, {"partials": 16}),
        notes="Replicated over TP: every rank folds the same gathered partials and must give the same bits. "
              "parts has T = case.tp partials, or knob 'partials' (default 4) when tp=1; N = latent + hidden "
              "(the MoE's concatenated partials), knob width='odd' one less; dist order_sensitive draws "
              "partials with cancelling magnitudes ~2^24 apart.",
    ),
]
