"""What a speculative-decoding rollback design implements for the harness, and the designs shipped.

A design holds the committed KDA state of B sequences its own way (per-token checkpoints, snapshot and
replay, an input cache, ...) and shows the harness five methods:

  begin(*, conv_state, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, l2_eps, norm_eps, n_q)
        the committed state in kda_decode's layout (conv_state [B, 3, C, W-1] wd, state [B, H, Dh, Dh]
        fp32), the layer's weights and scalars, and the draft slots n_q of every later verify. The
        design copies what it keeps; the harness's tensors are its own.
  verify(*, q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens) -> y [B, n_q, C]
        token inputs [B, n_q, ...] (slot t = draft token t; the slots past n_tokens[b] hold no token
        and are NaN), n_tokens [B] int 1..n_q. Returns every verified token's output; the slots past
        n_tokens are not read. Changes nothing the harness can see through committed().
  accept(accepted)
        accepted [B] int 0..n_tokens: the state after that many of the last verify's tokens becomes the
        committed one.
  committed() -> (conv_state, state)
        the committed state in kda_decode's layout, called before a verify and after an accept.
  rollback_buffers() -> [(name, tensor, kept), ...]
        every tensor the design keeps for rolling back, [B, S, ...] with a token slot axis 1, and kept
        [B] int: slots [0, kept[b]) of sequence b hold committed data, and the last verify's draft
        token t lies in slot kept[b] + t. The harness overwrites (poisons) slots kept[b] + accepted[b]
        on between a verify and its accept, and slots kept[b] on after the accept: a design that reads
        them later answers differently than when they are left alone. Float slots get NaN, integer
        slots garbage. A design that keeps nothing beyond its committed state returns [].

The harness forks a design (the same design, a second draft from the same committed state) with
copy.deepcopy, or with the design's fork() where it has one.

Named designs (`resolve_design`): `checkpoints` (references.kda_spec: kda_verify + kda_accept),
`one-token` (one kda_decode launch per draft token and a checkpoint after each, over the reference's
kda_decode; `one-token:MODULE:ATTR` over any function with kda_decode's signature, e.g.
fused.kda_decode:kda_decode), `replay` (snapshot + replay: the draft runs on scratch copies, accept
replays the accepted prefix; `replay:MODULE:ATTR` over any kda_decode), `compiled` (`checkpoints` with
references.kda_spec.kda_verify under torch.compile: the bench's compiled-reference peer), `input-cache`
(references.kda_spec_cache, window 6; `input-cache:W` another window), or `MODULE:ATTR` naming a
callable that returns a design (a class, a factory; e.g. `lambda: CheckpointDesign(my_verify,
my_accept)` for a fused pair with kda_verify's and kda_accept's signatures). The rollback_buffers
tensors are the design's own storage, not copies: poison written to a copy proves nothing.
"""
from __future__ import annotations

import functools
from typing import Callable, Protocol, Sequence

import torch

from references.layers_spec import CheckpointDesign  # noqa: F401  (the reference design; a layer's default)

LAYER = ("conv_w", "A_log", "dt_bias", "o_norm_w")
TOKEN_INPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
NAMED = ("checkpoints", "one-token", "replay", "input-cache", "compiled")


class SpecDecodeDesign(Protocol):
    def begin(self, *, conv_state: torch.Tensor, state: torch.Tensor, conv_w: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor, o_norm_w: torch.Tensor, lower_bound: float, l2_eps: float, norm_eps: float,
              n_q: int) -> None: ...

    def verify(self, *, q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
               beta_raw: torch.Tensor, z: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor: ...

    def accept(self, accepted: torch.Tensor) -> None: ...

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rollback_buffers(self) -> Sequence[tuple[str, torch.Tensor, torch.Tensor]]: ...


class DesignError(ValueError):
    """--design names no design: one line naming the value and the choices."""


def per_token_verify(decode: Callable) -> Callable:
    """A verify with kda_verify's signature over any one-token step with kda_decode's: token t of every
    sequence is one `decode` launch over the batch from the state after token t-1, its state kept as
    checkpoint t; sequences past their n_tokens keep theirs (masked, as kda_verify)."""

    def verify(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, conv_w, conv_state, A_log, dt_bias, o_norm_w,
               state, conv_ckpt, state_ckpt, lower_bound, l2_eps, norm_eps):
        B, n_q = q_raw.shape[:2]
        cs, st = conv_state.clone(), state.clone()
        y = torch.zeros_like(q_raw)
        for t in range(n_q):
            cs_t, st_t = cs.clone(), st.clone()
            y_t = decode(q_raw=q_raw[:, t], k_raw=k_raw[:, t], v_raw=v_raw[:, t], g_raw=g_raw[:, t],
                         beta_raw=beta_raw[:, t], z=z[:, t], conv_w=conv_w, conv_state=cs_t, A_log=A_log,
                         dt_bias=dt_bias, o_norm_w=o_norm_w, state=st_t, lower_bound=lower_bound, l2_eps=l2_eps,
                         norm_eps=norm_eps)
            live = (n_tokens > t).view(B, 1, 1, 1)
            cs, st = torch.where(live, cs_t, cs), torch.where(live, st_t, st)
            y[:, t] = torch.where(live.view(B, 1), y_t, torch.zeros_like(y_t))
            conv_ckpt[:, t] = torch.where(live, cs, conv_ckpt[:, t])
            state_ckpt[:, t] = torch.where(live, st, state_ckpt[:, t])
        return y

    return verify


def _step(decode: Callable, token: dict, layer: dict, params: dict, conv: torch.Tensor, state: torch.Tensor,
          live: torch.Tensor):
    """One `decode` launch over the batch from (conv, state): (y, conv, state), rows where live [B] is False
    keeping their state."""
    cs, st = conv.clone(), state.clone()
    y = decode(**token, **layer, conv_state=cs, state=st, **params)
    keep = live.view(-1, 1, 1, 1)
    return y, torch.where(keep, cs, conv), torch.where(keep, st, state)


class ReplayDesign:
    """Snapshot + replay over any one-token step with kda_decode's signature: verify runs the draft from
    the committed state on scratch copies and keeps the draft's inputs; accept replays each sequence's
    accepted prefix from the committed state, one launch per token. The kept draft inputs [B, n_q, ...]
    are the rollback storage (kept = 0: only the accepted prefix of the draft is read again)."""

    def __init__(self, decode: Callable | None = None):
        if decode is None:
            from references.kda import kda_decode as decode
        self.decode = decode

    def begin(self, *, conv_state, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, l2_eps, norm_eps, n_q):
        self.conv_state, self.state = conv_state.clone(), state.clone()
        self.layer = {"conv_w": conv_w, "A_log": A_log, "dt_bias": dt_bias, "o_norm_w": o_norm_w}
        self.params = {"lower_bound": lower_bound, "l2_eps": l2_eps, "norm_eps": norm_eps}
        self.draft: dict[str, torch.Tensor] = {}

    def verify(self, *, n_tokens, **tokens):
        self.draft = {name: t.clone() for name, t in tokens.items()}
        conv, state = self.conv_state, self.state
        y = torch.zeros_like(tokens["q_raw"])
        for t in range(y.shape[1]):
            live = n_tokens > t
            y_t, conv, state = _step(self.decode, {n: x[:, t] for n, x in tokens.items()}, self.layer, self.params,
                                     conv, state, live)
            y[:, t] = torch.where(live.view(-1, 1), y_t, torch.zeros_like(y_t))
        return y

    def accept(self, accepted):
        conv, state = self.conv_state, self.state
        for t in range(self.draft["q_raw"].shape[1]):
            _, conv, state = _step(self.decode, {n: x[:, t] for n, x in self.draft.items()}, self.layer, self.params,
                                   conv, state, accepted > t)
        self.conv_state, self.state = conv, state

    def committed(self):
        return self.conv_state.clone(), self.state.clone()

    def rollback_buffers(self):
        none = torch.zeros(self.state.shape[0], dtype=torch.int64, device=self.state.device)
        return [(f"draft.{name}", t, none) for name, t in self.draft.items()]


def one_token_design(decode: Callable | None = None) -> CheckpointDesign:
    """One `decode` launch per draft token (the reference's kda_decode by default), a checkpoint after
    each, committed by references.kda_spec.kda_accept: any kda_decode kernel judged as a design."""
    if decode is None:
        from references.kda import kda_decode as decode
    return CheckpointDesign(per_token_verify(decode))


@functools.cache
def _compiled_verify() -> Callable:
    from references.kda_spec import kda_verify

    return torch.compile(kda_verify, dynamic=True, fullgraph=False)   # as verify.judge.candidates compiles


def compiled_design() -> CheckpointDesign:
    """`checkpoints` with the reference kda_verify under torch.compile (compiled once per process)."""
    return CheckpointDesign(_compiled_verify())


def input_cache_design(window: int = 6):
    from references.kda_spec_cache import KdaInputCache

    return KdaInputCache(window)


def _import(path: str, device: str):
    """import_checked (verify.judge.candidates): a module whose import changed the torch the reference
    runs on is refused, as for any candidate."""
    from verify.judge.candidates import CandidateImportError, import_checked

    try:
        return import_checked(path, device)
    except CandidateImportError as e:
        raise ImportError(str(e)) from None


def resolve_design(name: str, device: str = "cpu") -> Callable[[], SpecDecodeDesign]:
    """--design's value -> a factory of fresh designs; DesignError (one line) when it names none."""
    if name == "checkpoints":
        return CheckpointDesign
    if name.startswith("checkpoints:"):
        path = name.removeprefix("checkpoints:")
        try:
            fns = [_import(f"{path}:{attr}", device) for attr in ("kda_verify", "kda_accept")]
        except ImportError as e:
            raise DesignError(f"--design {name!r}: the module after 'checkpoints:' must hold kda_verify and "
                              f"kda_accept with references.kda_spec's signatures: {e}") from None
        return lambda: CheckpointDesign(*fns)
    if name == "one-token":
        return one_token_design
    if name == "compiled":
        return compiled_design
    if name == "replay":
        return ReplayDesign
    for prefix, make in (("one-token:", one_token_design), ("replay:", ReplayDesign)):
        if name.startswith(prefix):
            try:
                decode = _import(name.removeprefix(prefix), device)
            except ImportError as e:
                raise DesignError(f"--design {name!r}: the kda_decode after {prefix!r} does not import: {e}") from None
            return lambda: make(decode)
    if name == "input-cache" or name.startswith("input-cache:"):
        w = name.partition(":")[2] or "6"
        if not w.isdigit() or int(w) < 1:
            raise DesignError(f"--design {name!r}: the window after 'input-cache:' must be an int >= 1, got {w!r}")
        return lambda: input_cache_design(int(w))
    if ":" not in name:
        raise DesignError(f"--design {name!r} is unknown; choose one of {', '.join(NAMED)}, checkpoints:MODULE (its "
                          f"kda_verify and kda_accept), one-token:MODULE:ATTR or "
                          f"replay:MODULE:ATTR (over a kda_decode), input-cache:W, or MODULE:ATTR (a callable "
                          f"returning a design)")
    try:
        factory = _import(name, device)
    except ImportError as e:
        raise DesignError(f"--design {name!r}: {e}") from None
    return factory
