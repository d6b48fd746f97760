"""Planted bugs in the KDA ops (references/kda.py)."""
from __future__ import annotations

import torch

from property_tests.planted import FP16_SAFETY_CLAMP
from property_tests.planted._cache import TensorKeyed
from references.kda import gated_rms_norm, in_proj_layout, kda_in_proj
from references.primitives import linear, silu

TUNED_M = (1, 2, 4, 8, 16, 32, 64)


def _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state,
            lower_bound, l2_eps, norm_eps, **bugs):
    """The planted rows' decode, one dense batch row at a time: torch's CPU kernels sum strided views
    and other batch sizes in other orders, and the spec's deterministic and batch-invariant claims hold
    candidates to the same bits there; computed on the whole batch, the strided-view and batch-position
    guards rejected this helper itself, so a planted bug was "caught" whether it was there or not
    (kda_decode_control checks the helper certifies)."""
    ys = []
    for b in range(state.shape[0]):
        row = lambda t: t[b:b + 1].contiguous()
        cs, st = row(conv_state), row(state)
        ys.append(_decode_rows(row(q_raw), row(k_raw), row(v_raw), row(g_raw), row(beta_raw), row(z), conv_w, cs,
                               A_log, dt_bias, o_norm_w, st, lower_bound, l2_eps, norm_eps, **bugs))
        conv_state[b:b + 1].copy_(cs)
        state[b:b + 1].copy_(st)
    return torch.cat(ys) if ys else torch.empty(0, state.shape[1] * state.shape[-1], dtype=q_raw.dtype)


def _decode_rows(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state,
                 lower_bound, l2_eps, norm_eps, *, decay=True, use_beta=True, shift=True, bounded_gate=True,
                 eps_inside=True, state_clamp=None, reset_nonfinite=False):
    B, H, Dh = state.shape[0], state.shape[1], state.shape[-1]
    acc, wd = torch.float32, q_raw.dtype
    new_conv = conv_state.clone()
    outs = []
    for i, x in enumerate((q_raw, k_raw, v_raw)):
        window = torch.cat([conv_state[:, i], x.unsqueeze(-1)], dim=-1)
        outs.append(silu((window.to(acc) * conv_w[i].to(acc)).sum(-1)).to(wd).to(acc).view(B, H, Dh))
        if shift:
            new_conv[:, i] = window[..., 1:]
    q, k, v = outs

    def l2(t):
        if eps_inside:
            return t / torch.sqrt((t * t).sum(-1, keepdim=True) + l2_eps)
        return t / (torch.sqrt((t * t).sum(-1, keepdim=True)) + l2_eps)

    q = l2(q) * Dh ** -0.5
    k = l2(k)
    A = A_log.to(acc).exp().view(H, 1)
    pre = A * (g_raw.view(B, H, Dh).to(acc) + dt_bias.to(acc).view(H, Dh))
    g = lower_bound * torch.sigmoid(pre) if bounded_gate else -torch.nn.functional.softplus(pre)
    alpha = g.exp()
    beta = torch.sigmoid(beta_raw.to(acc)) if use_beta else torch.ones_like(beta_raw, dtype=acc)
    S = state.to(acc)
    if reset_nonfinite:                   # "a poisoned sequence restarts": NaN / inf state rows read as 0
        S = torch.nan_to_num(S, nan=0.0, posinf=0.0, neginf=0.0)
    decayed = S * alpha.unsqueeze(-2) if decay else S
    u = beta.unsqueeze(-1) * (v - (decayed * k.unsqueeze(-2)).sum(-1))
    new_state = decayed + u.unsqueeze(-1) * k.unsqueeze(-2)
    if state_clamp is not None:
        new_state = new_state.clamp(-state_clamp, state_clamp)
    o = (new_state * q.unsqueeze(-2)).sum(-1)
    y = gated_rms_norm(o.to(wd), o_norm_w, z.view(B, H, Dh), norm_eps).reshape(B, H * Dh)
    conv_state.copy_(new_conv)
    state.copy_(new_state)
    return y


def kda_decode_control(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                       state, lower_bound: float, l2_eps: float, norm_eps: float):
    """No bug: the helper the kda_decode rows plant theirs in (test_planted_bugs checks it certifies)."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps)


def kda_decode_misaligned_state_not_written_back(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state,
                                                 A_log, dt_bias, o_norm_w, state, lower_bound: float,
                                                 l2_eps: float, norm_eps: float):
    """A state whose base is not 16-byte aligned is copied to fresh storage for the kernel's bulk
    copies, and the update is never copied back: the caller's state is left as it was."""
    if state.data_ptr() % 16:
        state = state.clone()
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps)


def kda_decode_no_decay(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
                        o_norm_w, state, lower_bound: float, l2_eps: float, norm_eps: float):
    """The state is never multiplied by alpha = exp(g) before the delta-rule update."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, decay=False)


def kda_decode_no_beta(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
                       o_norm_w, state, lower_bound: float, l2_eps: float, norm_eps: float):
    """beta = sigmoid(beta_raw) is computed but never applied to the delta (beta = 1)."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, use_beta=False)


def kda_decode_conv_state_not_shifted(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log,
                                      dt_bias, o_norm_w, state, lower_bound: float, l2_eps: float,
                                      norm_eps: float):
    """Convolves correctly but never writes the shifted window back to conv_state."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, shift=False)


def kda_decode_gate_unbounded(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
                              o_norm_w, state, lower_bound: float, l2_eps: float, norm_eps: float):
    """fla's default gate g = -softplus(A (g_raw + dt_bias)) instead of the K3 lower-bound gate."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, bounded_gate=False)


def kda_decode_l2_eps_outside_sqrt(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log,
                                   dt_bias, o_norm_w, state, lower_bound: float, l2_eps: float,
                                   norm_eps: float):
    """q/k L2 norm as x / (sqrt(sum x^2) + eps) (torch F.normalize style), not x / sqrt(sum x^2 + eps)."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, eps_inside=False)


def kda_decode_state_fp16_clamp(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log,
                                dt_bias, o_norm_w, state, lower_bound: float, l2_eps: float,
                                norm_eps: float):
    """The new state clamped to +-(finfo(fp16).max - 1000) (an fp16 build's overflow guard kept on
    every dtype): right while |state| < 64504, wrong on the range_edges dist's huge rows."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, state_clamp=FP16_SAFETY_CLAMP)


def kda_decode_resets_nonfinite_state(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log,
                                      dt_bias, o_norm_w, state, lower_bound: float, l2_eps: float,
                                      norm_eps: float):
    """NaN / inf in the incoming state read as zeros (a "self-healing" recurrent state): the sequence's
    corruption is hidden instead of propagated."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps, reset_nonfinite=True)


def kda_in_proj_no_variant(x, w_in, w_fb, n_heads: int):
    """Dispatches on a table of tuned M; any other batch size raises instead of falling back."""
    if x.shape[0] not in TUNED_M:
        raise RuntimeError(f"kda_in_proj: no tuned kernel variant for M={x.shape[0]} (have {TUNED_M})")
    return tuple(t.clone() for t in kda_in_proj(x, w_in, w_fb, n_heads))


def kda_in_proj_beta_before_fa(x, w_in, w_fb, n_heads: int):
    """Slices the merged output with beta before f_a (the HF module order), not the vLLM row order."""
    C, r = w_fb.shape
    lay = in_proj_layout(n_heads, C // n_heads, r)
    merged = linear(x, w_in)
    start = lay["f_a"].start
    beta_raw = merged[:, start:start + n_heads]
    f_a = merged[:, start + n_heads:start + n_heads + r]
    g_raw = linear(f_a, w_fb)
    return tuple(t.clone() for t in (merged[:, lay["q"]], merged[:, lay["k"]], merged[:, lay["v"]], g_raw, beta_raw,
                                      merged[:, lay["z"]]))



def _in_proj_fused(x, w_in, w_fb, n_heads: int, *, beta_from_next=False):
    """kda_in_proj as the fused kernel computes it: the merged GEMM rounded to wd (one token row at a
    time, the batch-invariant GEMM helper of planted/gemm.py), sliced into contiguous outputs, then f_b
    on the wd f_a. beta_from_next: beta_raw of head h read from head h + 1's column (the beta copy's
    head index off by one, wrapping): a rank holding one head still gets its own."""
    from property_tests.planted.gemm import linear as row_linear

    C, r = w_fb.shape
    lay = in_proj_layout(n_heads, C // n_heads, r)
    merged = row_linear(x, w_in)
    beta = merged[:, lay["beta"]]
    if beta_from_next:
        beta = beta.roll(-1, dims=1)
    g_raw = row_linear(merged[:, lay["f_a"]], w_fb)
    return tuple(t.contiguous() for t in (merged[:, lay["q"]], merged[:, lay["k"]], merged[:, lay["v"]], g_raw,
                                          beta, merged[:, lay["z"]]))


def kda_in_proj_control(x, w_in, w_fb, n_heads: int):
    """No bug: the helper kda_in_proj_beta_from_next_head plants its bug in (test_planted_bugs checks it
    certifies)."""
    return _in_proj_fused(x, w_in, w_fb, n_heads)


def kda_in_proj_beta_from_next_head(x, w_in, w_fb, n_heads: int):
    """beta_raw of each head copied from the neighbouring head's column of the merged output."""
    return _in_proj_fused(x, w_in, w_fb, n_heads, beta_from_next=True)

_OWN_CONV = TensorKeyed()


def kda_decode_private_conv_state(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log,
                                  dt_bias, o_norm_w, state, lower_bound: float, l2_eps: float,
                                  norm_eps: float):
    """Keeps its own copy of the conv window per conv_state tensor (a kernel that owns a state
    workspace) and mirrors its updates into the caller's tensor, but reads only its copy: state the
    caller writes (a new sequence in the slot, a restored snapshot) is never read."""
    own = _OWN_CONV.get(conv_state)
    if own is None:
        own = conv_state.clone()
        _OWN_CONV.put(conv_state, own)
    out = _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, own, A_log, dt_bias, o_norm_w, state,
                  lower_bound, l2_eps, norm_eps)
    conv_state.copy_(own)
    return out


def kda_decode_fixed_params(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
                            o_norm_w, state, lower_bound: float, l2_eps: float, norm_eps: float):
    """The gate's lower bound and both eps baked in at the config's values; the arguments are ignored."""
    return _decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, -5.0, 1e-6, 1e-5)
