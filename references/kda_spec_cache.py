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

`kda_cache_step` is one step of the design (verify, then accept) on buffers the caller owns, the
registry op `kda_cache_step`: the cache as one [B, window - 1 + n_q, 5C + H] buffer whose column
blocks are cache.q_raw, k_raw, v_raw, g_raw, z (C each), then beta_raw (H), fill [B] int32, and the
base (base_conv, base_state), all updated in place.
"""
from __future__ import annotations

import torch

from references.kda import PARAM_DTYPES, kda_decode
from references.kda_spec import (COUNT_DTYPES, _first, check_accept_counts, check_verify_counts)
from references.primitives import FLOAT_DTYPES, check_tensor

TOKEN_INPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
CACHE_COLUMNS = ("q_raw", "k_raw", "v_raw", "g_raw", "z")        # C columns each, then beta_raw's H


def _select(keep: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new where keep[b] (a [B] bool), else old."""
    return torch.where(keep.view((-1,) + (1,) * (new.dim() - 1)), new, old)


def store_draft(cache: dict[str, torch.Tensor], draft: dict[str, torch.Tensor], fill: torch.Tensor,
                n_tokens: torch.Tensor) -> None:
    """Draft token t of sequence b into cache slot fill[b] + t for t < n_tokens[b], in place; every other
    slot keeps what it holds (cache[name] [B, S, ...], draft[name] [B, n_q, ...])."""
    B, n_q = next(iter(draft.values())).shape[:2]
    fill, n_tokens = fill.long(), n_tokens.long()
    rows = torch.arange(B, device=fill.device)
    for s in range(next(iter(cache.values())).shape[1]):     # slot s of sequence b: its draft token s - fill[b]
        t = s - fill
        take = (t >= 0) & (t < n_tokens)
        for name, x in draft.items():
            cache[name][:, s] = _select(take, x[rows, t.clamp(0, n_q - 1)], cache[name][:, s])


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
        store_draft(self.cache, draft, self.fill, n_tokens)
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


def cache_views(cache: torch.Tensor, C: int) -> dict[str, torch.Tensor]:
    """The packed cache [B, S, 5C + H] as the design's cache.<name> tensors (views: writes land in it)."""
    views = {name: cache[:, :, i * C:(i + 1) * C] for i, name in enumerate(CACHE_COLUMNS)}
    views["beta_raw"] = cache[:, :, 5 * C:]
    return views


def _check_cache_step_args(q_raw, beta_raw, n_tokens, accepted, cache, fill, base_conv, base_state,
                           window) -> None:
    """Shapes and dtypes of kda_cache_step's own arguments (a token's are kda_decode's)."""
    check_tensor("q_raw", q_raw, ndim=3, dtypes=FLOAT_DTYPES)
    B, n_q, C = q_raw.shape
    if n_q < 1:
        raise ValueError(f"q_raw: expected [B, n_q, H*Dh] with n_q >= 1 draft slots, got {tuple(q_raw.shape)}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window: expected an int >= 1 (cached tokens that trigger a write-back), got {window!r}")
    check_tensor("base_state", base_state, ndim=4, dtypes=PARAM_DTYPES)
    H = base_state.shape[1]
    check_tensor("beta_raw", beta_raw, shape=(B, n_q, H), dtypes=(q_raw.dtype,))
    check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("accepted", accepted, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("cache", cache, shape=(B, window - 1 + n_q, 5 * C + H), dtypes=(q_raw.dtype,))
    check_tensor("fill", fill, shape=(B,), dtypes=(torch.int32,))
    check_tensor("base_conv", base_conv, ndim=4, dtypes=(q_raw.dtype,))
    check_tensor("base_state", base_state, shape=(B, H, C // H, C // H))


def check_fill(fill: torch.Tensor, window: int) -> None:
    """Between steps every sequence holds 0..window-1 committed cached tokens (reads fill on the host)."""
    b = _first((fill < 0) | (fill >= window))
    if b is not None:
        raise ValueError(f"fill: sequence {b} holds {int(fill[b])} cached tokens; expected 0..{window - 1} "
                         f"(a cache of window={window} writes back when full)")


def kda_cache_step(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
                   beta_raw: torch.Tensor, z: torch.Tensor, n_tokens: torch.Tensor, accepted: torch.Tensor,
                   conv_w: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor,
                   cache: torch.Tensor, fill: torch.Tensor, base_conv: torch.Tensor, base_state: torch.Tensor,
                   lower_bound: float, l2_eps: float, norm_eps: float, window: int,
                   validate: bool = True) -> torch.Tensor:
    """One speculative step of the input-cache design -> y [B, n_q, C] wd (zero past n_tokens).

    KdaInputCache's verify (the fill[b] cached tokens replayed from the base, then the n_tokens[b]
    draft tokens, whose inputs go to cache slots fill[b] + t) and accept (fill += accepted; a sequence
    holding `window` tokens or more replays them into its base and empties its cache), on the caller's
    cache, fill, base_conv and base_state, updated in place. Cache slots other than the drafts' are
    left as they were."""
    _check_cache_step_args(q_raw, beta_raw, n_tokens, accepted, cache, fill, base_conv, base_state, window)
    return cache_step(KdaInputCache(window), q_raw=q_raw, k_raw=k_raw, v_raw=v_raw, g_raw=g_raw, beta_raw=beta_raw,
                      z=z, n_tokens=n_tokens, accepted=accepted, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias,
                      o_norm_w=o_norm_w, cache=cache, fill=fill, base_conv=base_conv, base_state=base_state,
                      lower_bound=lower_bound, l2_eps=l2_eps, norm_eps=norm_eps, validate=validate)


def cache_step(design: KdaInputCache, *, q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, accepted, conv_w, A_log,
               dt_bias, o_norm_w, cache, fill, base_conv, base_state, lower_bound, l2_eps, norm_eps,
               validate: bool = True) -> torch.Tensor:
    """kda_cache_step through `design` (a KdaInputCache, or a variant of one): the caller's buffers
    loaded into it, its verify and accept run, fill and the base written back."""
    B, n_q, C = q_raw.shape
    if validate:
        check_verify_counts(n_tokens, n_q)
        check_accept_counts(accepted, n_tokens)
        check_fill(fill, design.window)
    design.begin(conv_state=base_conv, state=base_state, conv_w=conv_w, A_log=A_log, dt_bias=dt_bias,
                 o_norm_w=o_norm_w, lower_bound=lower_bound, l2_eps=l2_eps, norm_eps=norm_eps, n_q=n_q)
    design.fill = fill.to(torch.int64)
    design.cache = cache_views(cache, C)
    y = design.verify(q_raw=q_raw, k_raw=k_raw, v_raw=v_raw, g_raw=g_raw, beta_raw=beta_raw, z=z,
                      n_tokens=n_tokens)
    design.accept(accepted)
    fill.copy_(design.fill)
    base_conv.copy_(design.base_conv)
    base_state.copy_(design.base_state)
    return y
