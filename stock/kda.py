"""kda_decode as a serving engine composes it from fla-core without custom fusion: the short convs and
SiLU in torch, the gated delta rule through fla-core's fused_recurrent_kda (L2 norms, lower-bound gate
and sigmoid beta in its kernel, the fp32 V-first state updated through its final-state output), the
gated RMSNorm in torch. It has references.kda.kda_decode's signature, so it runs wherever a kda_decode
does: as a candidate of that op, and as the `one-token:stock.kda:fla_kda_decode` speculative-decoding
design (one launch chain per draft token, a checkpoint after each), the way an engine verifies a draft
with fla's one-token kernel.

Needs CUDA and fla-core (`pip install fla-core`); elsewhere it raises ImportError naming what is missing.
"""
from __future__ import annotations

import torch

from references.kda import gated_rms_norm, short_conv_update


def fla_kda_decode(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
                   beta_raw: torch.Tensor, z: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor, state: torch.Tensor,
                   lower_bound: float, l2_eps: float, norm_eps: float) -> torch.Tensor:
    """One KDA decode step -> y [B, H*Dh] wd; conv_state and state updated in place (kda_decode's
    contract), both only after the recurrence ran. The conv outputs are rounded to wd before the
    recurrence and o after it, as in the reference; fla's kernel fixes its own L2-norm epsilon (1e-6,
    K3's l2_eps). The fla call is the bench peers' (verify.bench.peers._recurrence)."""
    if q_raw.device.type != "cuda":
        raise ImportError(f"stock.kda.fla_kda_decode runs fla-core's Triton kernel on CUDA only, not on "
                          f"{q_raw.device.type}")
    from verify.bench.peers import _fla, _recurrence

    _, fused_recurrent_kda, _ = _fla()
    B, C = q_raw.shape
    H = A_log.shape[0]
    new_conv = conv_state.clone()
    q, k, v = (short_conv_update(x, conv_w[i], new_conv[:, i]) for i, x in enumerate((q_raw, k_raw, v_raw)))
    tensors = {"q_raw": q_raw, "g_raw": g_raw, "beta_raw": beta_raw, "A_log": A_log, "dt_bias": dt_bias,
               "state": state}
    o, final = _recurrence(fused_recurrent_kda, q, k, v, tensors, {"lower_bound": lower_bound})()
    y = gated_rms_norm(o.view(B, H, C // H).to(q_raw.dtype), o_norm_w, z.view(B, H, C // H), norm_eps)
    conv_state.copy_(new_conv)
    state.copy_(final)
    return y.reshape(B, C)
