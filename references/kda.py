"""Kimi Delta Attention (KDA), one decode token per sequence: shared/reference/kimi-k3-math.md §1.1.

Small primitives first (conv, gate, delta step, gated norm), then the three ops built from them:
`kda_in_proj` (merged projection GEMM), `kda_decode` (conv + gate + recurrence + gated norm, the
fused kernel's signature in docs/ARCHITECTURE.md) and `kda_attention_step` (in_proj + decode +
o_proj, the attention half of one KDA layer). dtype-generic: float64 tensors give the oracle.

Layouts:
  state        [B, H, V, K] (V-first, fla `state_v_first=True`); mathematically S = state^T is K x V.
  conv_state   [B, 3, C, W-1] for q, k, v (C = H*Dh), the W-1 past raw inputs, oldest first.
  w_in         merged in-projection rows, top to bottom (vLLM `in_proj_qkvgfab` order, no padding):
               q [C] | k [C] | v [C] | z = g_proj [C] | f_a [r] | beta = b_proj [H]
               -> w_in [4*C + r + H, D]; see `in_proj_layout`.
"""
from __future__ import annotations

import torch

from references.primitives import FLOAT_DTYPES, acc_dtype, check_tensor, l2_normalize, linear, silu

PARAM_DTYPES = (torch.float32, torch.float64)   # conv_w, A_log, dt_bias, o_norm_w, state: fp32 (fp64 oracle)
QKV = ("q", "k", "v")                           # conv_state / conv_w index 0, 1, 2


# ----------------------------------------------------------------------------------------------
# primitives


def short_conv_update(x_raw: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv (kernel W) + SiLU for one new token; updates conv_state in place.

    x_raw [B, C] wd, conv_w [C, W] fp32, conv_state [B, C, W-1] wd (oldest first).
    y = silu(sum_j window[..., j] * conv_w[:, j]) with window = past W-1 inputs then x_raw;
    accumulated in acc dtype, rounded once to wd. The new state is a bitwise copy of raw inputs.
    """
    acc = acc_dtype(x_raw)
    window = torch.cat([conv_state, x_raw.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    y = silu((window.to(acc) * conv_w.to(acc)).sum(-1)).to(x_raw.dtype)
    conv_state.copy_(window[..., 1:])
    return y


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower-bound gate: g = lb * sigmoid(exp(A_log)[h] * (g_raw + dt_bias)) in (lb, 0), alpha = exp(g).

    g_raw [..., H, Dh] (any float dtype), A_log [H], dt_bias [H, Dh] or [H*Dh]. Both results in
    acc dtype of g_raw. With the lower bound set, K3 *replaces* the softplus gate (fla gate.py).
    """
    acc = acc_dtype(g_raw)
    H, Dh = g_raw.shape[-2], g_raw.shape[-1]
    A = A_log.to(acc).exp().view(H, 1)
    g = lower_bound * torch.sigmoid(A * (g_raw.to(acc) + dt_bias.to(acc).view(H, Dh)))
    return g, g.exp()


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta-rule step; returns (o, new_state), leaves `state` untouched.

    state [B, H, V, K] V-first; q, k [B, H, K] (normalised, q already scaled); v [B, H, V];
    alpha [B, H, K] per key channel; beta [B, H]. All in one dtype (acc).
      S' = Diag(alpha) S                      decay the key rows
      u  = beta * (v - S'^T k)                delta against the *decayed* state
      S  = S' + k u^T                         rank-1 write
      o  = S^T q                              read-out of the updated state
    """
    decayed = state * alpha.unsqueeze(-2)                                # scales the K axis
    u = beta.unsqueeze(-1) * (v - (decayed * k.unsqueeze(-2)).sum(-1))  # [B, H, V]
    new_state = decayed + u.unsqueeze(-1) * k.unsqueeze(-2)
    o = (new_state * q.unsqueeze(-2)).sum(-1)                            # [B, H, V]
    return o, new_state


def gated_rms_norm(o: torch.Tensor, w: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """fla FusedRMSNormGated(activation='sigmoid'): o_hat * w * sigmoid(z), per head over the last dim.

    Normalises in acc dtype of `o`; the result is rounded once to o.dtype.
    """
    acc = acc_dtype(o)
    o32 = o.to(acc)
    o_hat = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    return (o_hat * w.to(acc) * torch.sigmoid(z.to(acc))).to(o.dtype)


# ----------------------------------------------------------------------------------------------
# ops


def in_proj_layout(n_heads: int, head_dim: int, f_rank: int) -> dict[str, slice]:
    """Rows of the merged in-projection weight (and columns of its output), in order."""
    C = n_heads * head_dim
    sizes = (("q", C), ("k", C), ("v", C), ("z", C), ("f_a", f_rank), ("beta", n_heads))
    layout, start = {}, 0
    for name, n in sizes:
        layout[name] = slice(start, start + n)
        start += n
    return layout


def kda_in_proj(x: torch.Tensor, w_in: torch.Tensor, w_fb: torch.Tensor, n_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged skinny GEMM + f_b: returns (q_raw, k_raw, v_raw, g_raw, beta_raw, z), all wd.

    x [B, D] wd; w_in [4*C + r + H, D] wd (layout: `in_proj_layout`); w_fb [C, r] wd; C = H*Dh.
    One fp32-accumulated GEMM rounded once to wd; g_raw = f_b(f_a(x)) with f_a rounded to wd in
    between, as two nn.Linear do in K3 (no activation between them).
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("w_fb", w_fb, ndim=2, dtypes=(x.dtype,))
    if not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads: expected a positive int, got {n_heads!r}")
    C, r = w_fb.shape
    if C % n_heads:
        raise ValueError(f"w_fb: {C} rows (H*Dh) is not a multiple of n_heads={n_heads}")
    check_tensor("w_in", w_in, shape=(4 * C + r + n_heads, x.shape[1]), dtypes=(x.dtype,))
    layout = in_proj_layout(n_heads, C // n_heads, r)
    merged = linear(x, w_in)
    g_raw = linear(merged[:, layout["f_a"]], w_fb)
    return (merged[:, layout["q"]], merged[:, layout["k"]], merged[:, layout["v"]], g_raw,
            merged[:, layout["beta"]], merged[:, layout["z"]])


def _check_decode_args(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias,
                       o_norm_w, state, lower_bound) -> tuple[int, int, int, int]:
    """Validate kda_decode's arguments; returns (B, H, Dh, W). H and Dh come from `state`."""
    check_tensor("state", state, ndim=4, dtypes=PARAM_DTYPES)
    check_tensor("q_raw", q_raw, ndim=2, dtypes=FLOAT_DTYPES)
    B, C = q_raw.shape
    _, H, V, K = state.shape
    if V != K or H * K != C:
        raise ValueError(f"state: expected shape (B, H, Dh, Dh) with H*Dh = {C} (q_raw width), "
                         f"got {tuple(state.shape)}; shard state by the same heads as q_raw")
    check_tensor("state", state, shape=(B, H, K, K))
    for name, t in (("k_raw", k_raw), ("v_raw", v_raw), ("g_raw", g_raw), ("z", z)):
        check_tensor(name, t, shape=(B, C), dtypes=(q_raw.dtype,))
    check_tensor("beta_raw", beta_raw, shape=(B, H), dtypes=(q_raw.dtype,))
    check_tensor("conv_w", conv_w, ndim=3, dtypes=PARAM_DTYPES)
    W = conv_w.shape[-1]
    check_tensor("conv_w", conv_w, shape=(3, C, W))
    if W < 2:
        raise ValueError(f"conv_w: kernel width {W} < 2; expected [3, H*Dh, W] with W = 4 in K3")
    check_tensor("conv_state", conv_state, shape=(B, 3, C, W - 1), dtypes=(q_raw.dtype,))
    check_tensor("A_log", A_log, shape=(H,), dtypes=PARAM_DTYPES)
    check_tensor("dt_bias", dt_bias, shape=(C,), dtypes=PARAM_DTYPES)
    check_tensor("o_norm_w", o_norm_w, shape=(K,), dtypes=PARAM_DTYPES)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound: expected a negative float (K3: -5.0), got {lower_bound!r}")
    return B, H, K, W


def kda_decode(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
               beta_raw: torch.Tensor, z: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor, state: torch.Tensor,
               lower_bound: float, l2_eps: float, norm_eps: float) -> torch.Tensor:
    """One KDA decode step for B sequences -> y [B, H*Dh] wd; updates conv_state and state in place.

    Shapes/dtypes: docs/ARCHITECTURE.md. Rounding points (the K3/fla ones): the three conv outputs
    and the read-out o are rounded to wd (fla stores o in q's dtype); everything else runs in acc
    dtype; y is rounded once to wd; the new state is stored in state.dtype (fp32).
    """
    B, H, Dh, _ = _check_decode_args(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log,
                                     dt_bias, o_norm_w, state, lower_bound)
    acc, wd = acc_dtype(q_raw), q_raw.dtype
    # Convolve into a scratch copy so a failure below leaves conv_state untouched.
    new_conv = conv_state.clone()
    q, k, v = (short_conv_update(x, conv_w[i], new_conv[:, i]).to(acc).view(B, H, Dh)
               for i, x in enumerate((q_raw, k_raw, v_raw)))
    q = l2_normalize(q, l2_eps) * Dh ** -0.5
    k = l2_normalize(k, l2_eps)
    _, alpha = kda_gate(g_raw.view(B, H, Dh), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_raw.to(acc))
    o, new_state = gated_delta_step(state.to(acc), q, k, v, alpha, beta)
    y = gated_rms_norm(o.to(wd), o_norm_w, z.view(B, H, Dh), norm_eps).reshape(B, H * Dh)
    conv_state.copy_(new_conv)
    state.copy_(new_state)
    return y


def kda_attention_step(x: torch.Tensor, w_in: torch.Tensor, w_fb: torch.Tensor, conv_w: torch.Tensor,
                       conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       o_norm_w: torch.Tensor, state: torch.Tensor, w_o: torch.Tensor, n_heads: int,
                       lower_bound: float, l2_eps: float, norm_eps: float) -> torch.Tensor:
    """The attention half of a KDA layer: in_proj -> kda_decode -> o_proj. Returns out [B, D] wd.

    x is the normed layer input [B, D]; w_o [D, H*Dh] wd. Updates conv_state and state in place.
    On a tensor-parallel rank this returns the rank's partial o_proj sum (references.kda_tp).
    """
    q_raw, k_raw, v_raw, g_raw, beta_raw, z = kda_in_proj(x, w_in, w_fb, n_heads)
    check_tensor("w_o", w_o, shape=(x.shape[1], w_fb.shape[0]), dtypes=(x.dtype,))   # before any state write
    y = kda_decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, conv_state, A_log, dt_bias, o_norm_w,
                   state, lower_bound, l2_eps, norm_eps)
    return linear(y, w_o)
