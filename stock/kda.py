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
import torch.nn.functional as F


def fla_kda_decode(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
                   beta_raw: torch.Tensor, z: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor, state: torch.Tensor,
                   lower_bound: float, l2_eps: float, norm_eps: float) -> torch.Tensor:
    """One KDA decode step -> y [B, H*Dh] wd; conv_state and state updated in place (kda_decode's
    contract). The conv outputs are rounded to wd before the recurrence and o after it, as in the
    reference; fla's kernel fixes its own L2-norm epsilon (1e-6, K3's l2_eps)."""
    if q_raw.device.type != "cuda":
        raise ImportError(f"stock.kda.fla_kda_decode runs fla-core's Triton kernel on CUDA only, not on "
                          f"{q_raw.device.type}")
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception as e:  # noqa: BLE001  (missing package, or triton without a usable device)
        raise ImportError(f"fla-core is not importable here ({type(e).__name__}: {e}); "
                          "install it with `pip install fla-core`") from None
    B, C = q_raw.shape
    H = A_log.shape[0]
    Dh = C // H
    wd, acc = q_raw.dtype, torch.float32
    raw = torch.stack([q_raw, k_raw, v_raw], dim=1)                                 # [B, 3, C]
    window = torch.cat([conv_state, raw.unsqueeze(-1)], dim=-1)                    # [B, 3, C, W]
    conv = F.silu((window.to(acc) * conv_w.to(acc)).sum(-1)).to(wd)                # [B, 3, C] wd
    q, k, v = (conv[:, i].reshape(B, 1, H, Dh) for i in range(3))
    o, final = fused_recurrent_kda(
        q, k, v, g_raw.view(B, 1, H, Dh), beta_raw.reshape(B, 1, H), A_log=A_log, dt_bias=dt_bias,
        scale=Dh ** -0.5, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=float(lower_bound),
        state_v_first=True)
    o32 = o.view(B, H, Dh).to(wd).to(acc)
    y = (F.rms_norm(o32, (Dh,), eps=norm_eps) * o_norm_w.to(acc)
         * torch.sigmoid(z.view(B, H, Dh).to(acc))).to(wd).reshape(B, C)
    conv_state.copy_(window[..., 1:])
    state.copy_(final)
    return y
