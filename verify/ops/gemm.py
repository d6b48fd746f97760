"""Registry entry for skinny_gemm (references/gemm.py), with its column and row TP splits.

The [N, K] shape is one of the K3 projections the skinny GEMM serves, picked by the seed (knob
'proj' overrides), or (knob 'proj': 'off_tile', run as explicit cases in every certification) an
o_proj-like shape whose N and K are odd multiples of 16: no multiple of 32, 64 or 128, so a kernel
that special-cases its tile (drops a K tail, leaves a last partial column block unwritten) fails,
while 16-byte rows and every T up to 16 still divide them. Column split: w rows over ranks, outputs concatenated (each output element is
the same dot product, so per rank it is the same computation). Row split: K over ranks, partial
outputs rounded to wd on each rank and all-reduced by the declared fold.
"""
from __future__ import annotations

import torch

from references.config import get_config
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, Peer, RankShard, SplitRule
from verify.ops.common_splits import (FOLD_ORDER, activation, check_divides, sum_outputs_combine, weight,
                                      working_dtype)

PROJECTIONS = ("o_proj", "g_proj", "latent_down", "latent_up")
KNOB_PROJECTIONS = PROJECTIONS + ("off_tile",)     # off_tile: by knob only (the explicit knob sweep)


def off_tile(d: int) -> int:
    """The smallest odd multiple of 16 at or above d: 64 -> 80, 7168 -> 7184, 12288 -> 12304."""
    q = -(-d // 16)
    return 16 * (q if q % 2 else q + 1)


def projection_shape(case: Case) -> tuple[int, int]:
    """(N, K) of the drawn projection."""
    cfg = get_config(case.config)
    heads = cfg.n_heads * cfg.head_dim
    name = case.knob("proj", PROJECTIONS[case.seed % len(PROJECTIONS)])
    shapes = {"o_proj": (cfg.hidden, heads), "g_proj": (heads, cfg.hidden),
              "latent_down": (cfg.latent, cfg.hidden), "latent_up": (cfg.hidden, cfg.latent),
              "off_tile": (off_tile(cfg.hidden), off_tile(heads))}
    if name not in shapes:
        raise ValueError(f"proj: {name!r} is unknown; choose one of {KNOB_PROJECTIONS}")
    return shapes[name]


def make_skinny_gemm_inputs(case: Case) -> OpInputs:
    wd = working_dtype(case)
    N, K = projection_shape(case)
    return OpInputs({"x": activation(case, "x", (case.batch, K), wd),
                     "w": weight(case, "w", (N, K), K, wd)})


def shard_columns(inputs: OpInputs, T: int) -> list[RankShard]:
    w = inputs.tensors["w"]
    check_divides(T, w.shape[0], "N (rows of w)")
    n = w.shape[0] // T
    return [RankShard({"x": inputs.tensors["x"].clone(), "w": w[r * n:(r + 1) * n].clone()})
            for r in range(T)]


def concat_columns(per_rank: list[dict], inputs: OpInputs) -> dict:
    return {"y": torch.cat([res["y"] for res in per_rank], dim=1)}


def shard_rows(inputs: OpInputs, T: int) -> list[RankShard]:
    x, w = inputs.tensors["x"], inputs.tensors["w"]
    check_divides(T, w.shape[1], "K (columns of w)")
    k = w.shape[1] // T
    return [RankShard({"x": x[:, r * k:(r + 1) * k].clone(), "w": w[:, r * k:(r + 1) * k].clone()})
            for r in range(T)]


def skinny_gemm_bytes(inputs: OpInputs) -> int:
    """x and w read, y [M, N] written, in the working dtype."""
    (M, K), N = inputs.tensors["x"].shape, inputs.tensors["w"].shape[0]
    return (M * K + N * K + M * N) * inputs.tensors["x"].element_size()


SKINNY_GEMM_COLUMN_SPLIT = SplitRule(kind="column", shard=shard_columns, combine=concat_columns,
                                     reduction_order="none: output columns concatenated in rank order")
SKINNY_GEMM_ROW_SPLIT = SplitRule(kind="row", shard=shard_rows, combine=sum_outputs_combine(("y",)),
                                  reduction_order=FOLD_ORDER, order_sensitive=True)

OPS = [
    OpDef(
        name="skinny_gemm", family="gemm", reference="references.gemm:skinny_gemm",
        make_inputs=make_skinny_gemm_inputs, outputs=("y",),
        signature="x[M,K] wd, w[N,K] wd -> y[M,N] wd (fp32 accumulate, one rounding)",
        batch_dims={"x": 0, "y": 0},
        split=SKINNY_GEMM_COLUMN_SPLIT, fused="fused.skinny_gemm:skinny_gemm",
        knob_sweep=({"proj": "off_tile"},),
        moved_bytes=skinny_gemm_bytes, bench_knobs=tuple({"proj": p} for p in PROJECTIONS),
        peers=(Peer("torch_linear", "verify.bench.peers:torch_linear"),),
        notes="Registry split is the column split (o_proj/g_proj/latent as column-parallel); the row "
              "split (RowParallel partial sums) is SKINNY_GEMM_ROW_SPLIT, tested in "
              "property_tests/test_tp_split_gemm.py. k3 weights are up to 12288 x 7168 (drawn in fp32).",
    ),
]
