"""Speculative decoding through KDA with an input cache: the second rollback design, in plain PyTorch,
beside the per-token checkpoints of references/kda_spec.py (same step, shared/reference/kimi-k3-math.md
§1.1 and references/kda.py).

Instead of a state per draft token, the design keeps the *inputs* of the tokens committed since the
last write-back, and the state as it was at that write-back (the base):

  begin      the committed state becomes the base; the cache is empty (fill = 0 per sequence).
  verify     rebuilds the committed state by replaying the fill cached tokens from the base, runs the
             draft tokens from it (their outputs are the step's), and appends the draft tokens' inputs
             to the cache after the committed ones. Neither the base nor fill changes.
  accept     fill += accepted: the accepted draft tokens are now committed cached tokens, the rejected
             ones lie past fill and are never read again. A sequence whose cache holds `window` tokens
             or more writes back: its base becomes the replay of all its fill tokens, fill becomes 0.
  committed  the replay of the fill cached tokens from the base, in kda_decode's layout.

Layouts (B sequences, n_q draft slots, C = H*Dh, the rest as references.kda.kda_decode):
  cache[name]   [B, window - 1 + n_q, ...] wd   the inputs of token s since the write-back in slot s
                (name: q_raw, k_raw, v_raw, g_raw, z [.., C]; beta_raw [.., H]); between steps
                fill < window, so a verify's n_q draft tokens always fit after the fill committed ones.
  fill          [B] int64                      committed cached tokens per sequence
  base_conv     [B, 3, C, W-1] wd, base_state [B, H, Dh, Dh] fp32

Every replay runs whole-batch kda_decode launches and keeps each sequence's rows by mask (rows past a
sequence's count are computed and dropped), so a sequence's bits are those of its tokens run one
kda_decode launch each; the one value read on the host is the longest replay's length.
"""
from __future__ import annotations

import torch

from references.kda import kda_decode

TOKEN_INPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")


def _select(keep: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new where keep[b] (a [B] bool), else old."""
    return torch.where(keep.view((-1,) + (1,) * (new.dim() - 1)), new, old)


class KdaInputCache:
    """The input-cache rollback design (module docstring). `window`: the cached tokens that trigger a
    write-back (>= 1); `decode`: the one-token step, kda_decode's signature."""

    def __init__(self, window: int = 6, decode=kda_decode):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: expected an int >= 1 (cached tokens that trigger a write-back), got {window!r}")
        self.window, self.decode = window, decode

    def begin(self, *, conv_state: torch.Tensor, state: torch.Tensor, conv_w: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor, o_norm_w: torch.Tensor, lower_bound: float, l2_eps: float, norm_eps: float,
              n_q: int) -> None:
        self.base_conv, self.base_state = conv_state.clone(), state.clone()
        self.layer = {"conv_w": conv_w, "A_log": A_log, "dt_bias": dt_bias, "o_norm_w": o_norm_w}
        self.params = {"lower_bound": lower_bound, "l2_eps": l2_eps, "norm_eps": norm_eps}
        self.n_q = n_q
        self.fill = torch.zeros(state.shape[0], dtype=torch.int64, device=state.device)
        self.cache: dict[str, torch.Tensor] = {}        # allocated at the first verify (the token shapes)

    def _slots(self) -> int:
        return self.window - 1 + self.n_q

    def _step(self, token: dict, conv: torch.Tensor, state: torch.Tensor, live: torch.Tensor):
        """One kda_decode launch over the batch from (conv, state); rows where live is False keep theirs."""
        cs, st = conv.clone(), state.clone()
        y = self.decode(**token, **self.layer, conv_state=cs, state=st, **self.params)
        return y, _select(live, cs, conv), _select(live, st, state)

    def _rebuild(self, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state after replaying cached slots 0..count[b]-1 of each sequence from its base."""
        conv, state = self.base_conv.clone(), self.base_state.clone()
        if not self.cache:
            return conv, state
        for s in range(int(count.max())):                  # the longest replay (read on the host)
            token = {name: self.cache[name][:, s] for name in TOKEN_INPUTS}
            _, conv, state = self._step(token, conv, state, count > s)
        return conv, state

    def verify(self, *, q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens: torch.Tensor) -> torch.Tensor:
        """The draft tokens' outputs y [B, n_q, C] (zero past n_tokens); caches their inputs after fill."""
        draft = {"q_raw": q_raw, "k_raw": k_raw, "v_raw": v_raw, "g_raw": g_raw, "beta_raw": beta_raw, "z": z}
        B, n_q = q_raw.shape[:2]
        if n_q != self.n_q:
            raise ValueError(f"q_raw: {n_q} draft slots, but begin() was given n_q={self.n_q}")
        n_tokens = n_tokens.to(torch.int64)
        if not self.cache:
            self.cache = {name: torch.zeros((B, self._slots()) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
                          for name, t in draft.items()}
        conv, state = self._rebuild(self.fill)
        y = torch.zeros_like(q_raw)
        for t in range(n_q):
            y_t, conv, state = self._step({name: x[:, t] for name, x in draft.items()}, conv, state, n_tokens > t)
            y[:, t] = _select(n_tokens > t, y_t, torch.zeros_like(y_t))
        rows = torch.arange(B, device=q_raw.device)
        for s in range(self._slots()):                     # slot s of sequence b holds its draft token s - fill[b]
            t = s - self.fill
            take = (t >= 0) & (t < n_tokens)
            for name, x in draft.items():
                self.cache[name][:, s] = _select(take, x[rows, t.clamp(0, n_q - 1)], self.cache[name][:, s])
        return y

    def accept(self, accepted: torch.Tensor) -> None:
        """Commit accepted[b] of the tokens the last verify drafted; write back the full caches."""
        self.fill = self.fill + accepted.to(torch.int64)
        full = self.fill >= self.window
        conv, state = self._rebuild(torch.where(full, self.fill, torch.zeros_like(self.fill)))
        self.base_conv = _select(full, conv, self.base_conv)
        self.base_state = _select(full, state, self.base_state)
        self.fill = torch.where(full, torch.zeros_like(self.fill), self.fill)

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rebuild(self.fill)

    def rollback_buffers(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The cache: slots [0, fill[b]) hold committed tokens, draft token t goes to slot fill[b] + t."""
        return [(f"cache.{name}", self.cache[name], self.fill) for name in TOKEN_INPUTS if name in self.cache]
