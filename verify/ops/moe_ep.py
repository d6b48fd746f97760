"""Registry entry for moe_experts_mxfp4_ep: the routed experts under expert parallelism (EP).

The op is moe_experts_mxfp4 (same reference, inputs and fused kernel); what differs is its split:
rank r of T holds the experts of expert_ranges(E, T)[r] and sees the global ids remapped to its own
(ids of other ranks' experts become -1, padding), returns its partial latent y_r in wd, and the
partials are folded in rank order (verify.ops.moe_splits.MOE_EXPERTS_EP_SPLIT). So the harness judges
a kernel on EP's inputs: most slots padding at large T, tokens with no expert on the rank (a zero
row), ranks with one or two experts. moe_experts_mxfp4's own entry certifies the TP split over the
intermediate dimension.
"""
from __future__ import annotations

from verify.model.values import GENERIC_DISTS
from verify.model.opdef import OpDef
from verify.ops.moe import make_moe_experts_inputs, moe_experts_mxfp4_bytes
from verify.ops.moe_splits import MOE_EXPERTS_EP_SPLIT

OPS = [
    OpDef(
        name="moe_experts_mxfp4_ep", family="moe_ep", reference="references.moe:moe_experts_mxfp4", collective="split",
        make_inputs=make_moe_experts_inputs, outputs=("y",),
        signature=("z[B,L] wd, ids[B,k] int64 (-1 = padding: another rank's expert), weights[B,k] fp32, "
                   "w13_packed[E_r,2I,L/2] u8, w13_scale[E_r,2I,L/32] u8, w2_packed[E_r,L,I/2] u8, "
                   "w2_scale[E_r,L,I/32] u8, situ_beta: float, situ_linear_beta: float -> y[B,L] wd"),
        batch_dims={"z": 0, "ids": 0, "weights": 0, "y": 0},
        split=MOE_EXPERTS_EP_SPLIT, fused="fused.moe_experts_mxfp4:moe_experts_mxfp4",
        moved_bytes=moe_experts_mxfp4_bytes,
        configs=("tiny", "small"), compile_heavy=True, cpu_ok=False, max_batch=32,
        dists=GENERIC_DISTS + ("mxfp4_grid",),
        knob_sweep=({"routing": "edges"}, {"routing": "same"}),
        notes="moe_experts_mxfp4 split by experts (EP): rank r holds the experts of expert_ranges(E, T)[r], "
              "ids of other ranks' experts are -1 on it, partials folded in rank order. Inputs, configs and "
              "budget as moe_experts_mxfp4 (whose entry certifies the TP split over the intermediate dim); "
              "knob routing='edges' and 'same' (every run): verify/ops/moe_edges.py.",
    ),
]
