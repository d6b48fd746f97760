"""Speculative decoding through KDA: a verify step over up to n_q draft tokens per sequence, and the
accept that commits the state at each sequence's accepted length (shared/reference/kimi-k3-math.md
§1.1 for the step itself; references/kda.py).

The simplest rollback design, which every other design must match on what it shows the caller:

  kda_verify  runs each sequence's tokens one after another from the committed state, returns every
              token's output and writes the state after each token into checkpoint buffers the caller
              owns. The committed state (conv_state, state) is not changed.
  kda_accept  given how many of each sequence's tokens were accepted (0..n_tokens), makes the state
              after that many tokens the committed one: the checkpoint of token a-1 for a > 0, the
              committed state unchanged for a = 0.

Layouts (B sequences, n_q draft slots, C = H*Dh; the rest as references.kda.kda_decode):
  q_raw, k_raw, v_raw, g_raw, z   [B, n_q, C] wd       token t of sequence b in slot [b, t]
  beta_raw                        [B, n_q, H] wd
  n_tokens                        [B] int32 or int64   tokens to verify per sequence, 1..n_q (ragged)
  conv_ckpt                       [B, n_q, 3, C, W-1] wd       the conv window after token t
  state_ckpt                      [B, n_q, H, Dh, Dh] fp32     the recurrent state after token t
  y                               [B, n_q, C] wd       zero in the slots past n_tokens

A slot past a sequence's n_tokens holds no token: its inputs are never read into any result, its
output is zero, and its checkpoints are left as they were. Every step masks instead of indexing, so
the step runs on the inputs' device without reading a tensor's values on the host; the argument
checks that do read values (n_tokens and accepted in range) are `check_verify_counts` and
`check_accept_counts`, called by default and skippable by a captured step that validated its counts.
"""
from __future__ import annotations

import torch

from references.kda import PARAM_DTYPES, kda_decode
from references.primitives import FLOAT_DTYPES, check_tensor

COUNT_DTYPES = (torch.int32, torch.int64)


def _check_verify_args(q_raw, beta_raw, n_tokens, conv_state, state, conv_ckpt, state_ckpt) -> tuple[int, int]:
    """Shapes and dtypes of kda_verify's own arguments (a token's are kda_decode's); returns (B, n_q)."""
    check_tensor("q_raw", q_raw, ndim=3, dtypes=FLOAT_DTYPES)
    B, n_q, _ = q_raw.shape
    if n_q < 1:
        raise ValueError(f"q_raw: expected [B, n_q, H*Dh] with n_q >= 1 draft slots, got {tuple(q_raw.shape)}")
    check_tensor("beta_raw", beta_raw, ndim=3, dtypes=(q_raw.dtype,))
    check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("state", state, ndim=4, dtypes=PARAM_DTYPES)
    check_tensor("conv_state", conv_state, ndim=4, dtypes=(q_raw.dtype,))
    check_tensor("state_ckpt", state_ckpt, shape=(B, n_q) + tuple(state.shape[1:]), dtypes=(state.dtype,))
    check_tensor("conv_ckpt", conv_ckpt, shape=(B, n_q) + tuple(conv_state.shape[1:]), dtypes=(conv_state.dtype,))
    return B, n_q


def _first(bad: torch.Tensor) -> int | None:
    """The first sequence whose count is out of range, or None (reads `bad` on the host)."""
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def check_verify_counts(n_tokens: torch.Tensor, n_q: int) -> None:
    """Every sequence verifies 1..n_q tokens (reads n_tokens on the host)."""
    b = _first((n_tokens < 1) | (n_tokens > n_q))
    if b is not None:
        raise ValueError(f"n_tokens: sequence {b} verifies {int(n_tokens[b])} tokens; expected 1..{n_q} "
                         f"(the draft slots of q_raw)")


def kda_verify(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
               beta_raw: torch.Tensor, z: torch.Tensor, n_tokens: torch.Tensor, conv_w: torch.Tensor,
               conv_state: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor,
               state: torch.Tensor, conv_ckpt: torch.Tensor, state_ckpt: torch.Tensor, lower_bound: float,
               l2_eps: float, norm_eps: float, validate: bool = True) -> torch.Tensor:
    """The verify step -> y [B, n_q, C] wd; writes conv_ckpt[b, t] and state_ckpt[b, t] for t < n_tokens[b].

    Token t of every sequence is one kda_decode step from the state after token t-1 (the committed
    state for t = 0), so a sequence's outputs and checkpoints are those of its tokens run alone, one
    launch each. conv_state and state are read, never written: the caller commits with kda_accept.
    """
    B, n_q = _check_verify_args(q_raw, beta_raw, n_tokens, conv_state, state, conv_ckpt, state_ckpt)
    if validate:
        check_verify_counts(n_tokens, n_q)
    cs, st = conv_state.clone(), state.clone()
    y = torch.zeros_like(q_raw)
    for t in range(n_q):
        cs_t, st_t = cs.clone(), st.clone()
        y_t = kda_decode(q_raw[:, t], k_raw[:, t], v_raw[:, t], g_raw[:, t], beta_raw[:, t], z[:, t], conv_w, cs_t,
                         A_log, dt_bias, o_norm_w, st_t, lower_bound, l2_eps, norm_eps)
        live = n_tokens > t                                               # [B]: sequences with a token t
        cs = torch.where(live.view(B, 1, 1, 1), cs_t, cs)
        st = torch.where(live.view(B, 1, 1, 1), st_t, st)
        y[:, t] = torch.where(live.view(B, 1), y_t, torch.zeros_like(y_t))
        conv_ckpt[:, t] = torch.where(live.view(B, 1, 1, 1), cs, conv_ckpt[:, t])
        state_ckpt[:, t] = torch.where(live.view(B, 1, 1, 1), st, state_ckpt[:, t])
    return y


def check_accept_counts(accepted: torch.Tensor, n_tokens: torch.Tensor) -> None:
    """Each sequence accepts 0..n_tokens of its verified tokens (reads both on the host)."""
    b = _first((accepted < 0) | (accepted > n_tokens))
    if b is not None:
        raise ValueError(f"accepted: sequence {b} accepts {int(accepted[b])} tokens of the {int(n_tokens[b])} "
                         f"it verified; expected 0..{int(n_tokens[b])}")


def kda_accept(accepted: torch.Tensor, n_tokens: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
               conv_ckpt: torch.Tensor, state_ckpt: torch.Tensor, validate: bool = True) -> None:
    """Commit each sequence's state after its accepted tokens, in place: conv_state[b] and state[b]
    become the checkpoints of token accepted[b] - 1, or stay as they are where accepted[b] = 0.
    Nothing in the checkpoint slots at or past accepted[b] reaches the result (poison there is
    harmless: slot 0 is gathered for a = 0 and dropped by the select)."""
    check_tensor("accepted", accepted, ndim=1, dtypes=COUNT_DTYPES)
    B = accepted.shape[0]
    check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("state", state, ndim=4, dtypes=PARAM_DTYPES)
    check_tensor("state", state, shape=(B,) + tuple(state.shape[1:]))
    check_tensor("conv_state", conv_state, shape=(B,) + tuple(conv_state.shape[1:]), dtypes=FLOAT_DTYPES)
    check_tensor("state_ckpt", state_ckpt, shape=(B, None) + tuple(state.shape[1:]), dtypes=(state.dtype,))
    n_q = state_ckpt.shape[1]
    check_tensor("conv_ckpt", conv_ckpt, shape=(B, n_q) + tuple(conv_state.shape[1:]), dtypes=(conv_state.dtype,))
    if validate:
        check_accept_counts(accepted, n_tokens)
    keep = (accepted > 0).view(B, 1, 1, 1)
    slot = (accepted.long() - 1).clamp(min=0)                             # a = 0 reads slot 0, then drops it
    rows = torch.arange(B, device=accepted.device)
    conv_state.copy_(torch.where(keep, conv_ckpt[rows, slot], conv_state))
    state.copy_(torch.where(keep, state_ckpt[rows, slot], state))
