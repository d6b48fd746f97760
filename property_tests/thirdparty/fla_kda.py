"""fla-core's Triton KDA recurrence (`fla.ops.kda.fused_recurrent_kda`) adapted to `kda_decode`'s
signature: the short convs and the gated output norm are the reference's own (references/kda.py);
the gate, beta sigmoid, q/k L2 norm, delta-rule update and read-out run in fla's kernel.

fla's kernel fixes the q/k L2-norm eps at 1e-6 (`b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)`), where
kda_decode takes `l2_eps` as a parameter: the module declares that scope, and its verdict says
"scope: l2_eps = 1e-06 only". fla_kda_undeclared.py is the same adapter without the declaration.
Needs a CUDA device, triton and fla-core (property_tests/thirdparty/gpu_fla_kda.sh installs it).
"""
from __future__ import annotations

import torch
from fla.ops.kda import fused_recurrent_kda

from references.kda import gated_rms_norm, short_conv_update

PARAMS = {"l2_eps": (1e-6,)}


def kda_decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state,
               lower_bound, l2_eps, norm_eps):
    B, H, Dh = state.shape[0], state.shape[1], state.shape[-1]
    new_conv = conv_state.clone()
    q, k, v = (short_conv_update(x, conv_w[i], new_conv[:, i]).reshape(B, 1, H, Dh).contiguous()
               for i, x in enumerate((q_raw, k_raw, v_raw)))
    o, final = fused_recurrent_kda(
        q, k, v, g_raw.reshape(B, 1, H, Dh).contiguous(), beta_raw.reshape(B, 1, H).contiguous(),
        A_log=A_log.float().contiguous(), dt_bias=dt_bias.float().contiguous(), scale=Dh ** -0.5,
        initial_state=state.float().contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=float(lower_bound),
        state_v_first=True)                            # kda_decode's state is [B, H, V, K]
    y = gated_rms_norm(o.reshape(B, H, Dh), o_norm_w, z.reshape(B, H, Dh), norm_eps).reshape(B, H * Dh)
    conv_state.copy_(new_conv)
    state.copy_(final)
    return y
