"""A kda_decode whose q/k L2 norm uses a fixed eps of 1e-6 whatever `l2_eps` says (as fla-core's KDA
kernel does), declaring it: PARAMS scopes its certification to l2_eps = 1e-6."""
from __future__ import annotations

from references.kda import kda_decode as _reference

PARAMS = {"l2_eps": (1e-6,)}
FIXED_L2_EPS = 1e-6


def kda_decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state,
               lower_bound, l2_eps, norm_eps):
    return _reference(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state,
                      lower_bound, FIXED_L2_EPS, norm_eps)
