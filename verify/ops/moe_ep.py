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

import dataclasses

from verify.ops.moe import OPS as _MOE_OPS
from verify.ops.moe_splits import MOE_EXPERTS_EP_SPLIT

_TP = next(op for op in _MOE_OPS if op.name == "moe_experts_mxfp4")

OPS = [
    dataclasses.replace(
        _TP, name="moe_experts_mxfp4_ep", family="moe_ep", split=MOE_EXPERTS_EP_SPLIT,
        signature=("z[B,L] wd, ids[B,k] int64 (-1 = padding: another rank's expert), weights[B,k] fp32, "
                   "w13_packed[E_r,2I,L/2] u8, w13_scale[E_r,2I,L/32] u8, w2_packed[E_r,L,I/2] u8, "
                   "w2_scale[E_r,L,I/32] u8, situ_beta: float, situ_linear_beta: float -> y[B,L] wd"),
        knob_sweep=({"routing": "edges"}, {"routing": "same"}),
        notes="moe_experts_mxfp4 split by experts (EP): rank r holds the experts of expert_ranges(E, T)[r], "
              "ids of other ranks' experts are -1 on it, partials folded in rank order. Inputs, configs and "
              "budget as moe_experts_mxfp4 (whose entry certifies the TP split over the intermediate dim); "
              "knob routing='edges' and 'same' (every run): verify/ops/moe_edges.py.",
    ),
]
