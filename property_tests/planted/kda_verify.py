"""Planted bugs in the speculative-decoding verify step (references.kda_spec.kda_verify): the ways a
multi-token KDA kernel with per-token checkpoints goes wrong.

Every candidate runs the planted kda_decode helper (property_tests.planted.kda: one dense batch row
at a time, so the guards' strided, batch-position and determinism checks see the same bits) token by
token and sequence by sequence; `kda_verify_control` is that helper with no bug (it must certify)."""
from __future__ import annotations

import torch

from property_tests.planted.kda import _decode

TOKEN = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")


def _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
            state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps, *, ckpt_before=False, past_count=False,
            neighbour=False, bf16_carry=False, gate_slot0=False):
    B, n_q = q_raw.shape[:2]
    counts = [int(c) for c in n_tokens.cpu()]
    y = torch.zeros_like(q_raw)
    tok = dict(q_raw=q_raw, k_raw=k_raw, v_raw=v_raw, g_raw=g_raw, beta_raw=beta_raw, z=z)
    for b in range(B):
        n = n_q if past_count else counts[(b + 1) % B if neighbour else b]
        cs, st = conv_state[b:b + 1].clone(), state[b:b + 1].clone()
        for t in range(n):
            before = st.clone()
            args = {k: v[b:b + 1, t].contiguous() for k, v in tok.items()}
            if gate_slot0:
                args["g_raw"] = g_raw[b:b + 1, 0].contiguous()
            y[b, t] = _decode(**args, conv_w=conv_w, conv_state=cs, A_log=A_log, dt_bias=dt_bias, o_norm_w=o_norm_w,
                              state=st, lower_bound=lower_bound, l2_eps=l2_eps, norm_eps=norm_eps)[0]
            if bf16_carry:
                st = st.to(torch.bfloat16).to(st.dtype)
            conv_ckpt[b, t] = cs[0]
            state_ckpt[b, t] = (before if ckpt_before else st)[0]
    return y


def kda_verify_control(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias,
                       o_norm_w, state, conv_ckpt, state_ckpt, lower_bound: float, l2_eps: float,
                       norm_eps: float, validate: bool = True):
    """No bug: the helper the kda_verify rows plant theirs in (test_planted_bugs checks it certifies)."""
    return _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps)


def kda_verify_checkpoint_before_update(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state,
                                        A_log, dt_bias, o_norm_w, state, conv_ckpt, state_ckpt, lower_bound: float,
                                        l2_eps: float, norm_eps: float, validate: bool = True):
    """The state checkpoint of token t is stored before the token's delta-rule update (y is right)."""
    return _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps, ckpt_before=True)


def kda_verify_runs_every_slot(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log,
                               dt_bias, o_norm_w, state, conv_ckpt, state_ckpt, lower_bound: float, l2_eps: float,
                               norm_eps: float, validate: bool = True):
    """Every sequence runs all n_q slots: outputs and checkpoints written past its count."""
    return _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps, past_count=True)


def kda_verify_neighbours_count(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log,
                                dt_bias, o_norm_w, state, conv_ckpt, state_ckpt, lower_bound: float, l2_eps: float,
                                norm_eps: float, validate: bool = True):
    """Sequence b verifies as many tokens as sequence b + 1 was given (a count indexed off by one)."""
    return _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps, neighbour=True)


def kda_verify_bf16_state_between_tokens(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state,
                                         A_log, dt_bias, o_norm_w, state, conv_ckpt, state_ckpt, lower_bound: float,
                                         l2_eps: float, norm_eps: float, validate: bool = True):
    """The state is carried from token to token (and checkpointed) rounded to bf16, e.g. kept in
    shared memory as bf16 to fit more heads per SM."""
    return _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps, bf16_carry=True)


def kda_verify_gate_of_slot_zero(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log,
                                 dt_bias, o_norm_w, state, conv_ckpt, state_ckpt, lower_bound: float, l2_eps: float,
                                 norm_eps: float, validate: bool = True):
    """Every token decays the state with the first draft token's gate (the gate computed once per launch)."""
    return _verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps, gate_slot0=True)
