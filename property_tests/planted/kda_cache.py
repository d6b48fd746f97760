"""Planted bugs in the input-cache design's step (references.kda_spec_cache.kda_cache_step): each is the
reference step through a design with one bug (property_tests.planted.kda_spec's input-cache variants
where they exist). Every token runs the planted kda_decode helper (property_tests.planted.kda: one
dense batch row at a time; the reference's whole-batch CPU launches give other bits at other batch
positions, which the spec's batch-invariance claim rejects). `kda_cache_step_control` is the same
machinery with no bug (it must certify)."""
from __future__ import annotations

import torch

from property_tests.planted.kda import _decode
from property_tests.planted.kda_spec import _SkipsOldest, _WritebackAt
from references.kda_spec_cache import KdaInputCache, cache_step


def _step_through(make_design, doc: str):
    """A candidate with the reference's signature whose step runs through make_design(window), each token
    through the dense-row decode."""
    def step(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, accepted, conv_w, A_log, dt_bias, o_norm_w, cache,
             fill, base_conv, base_state, lower_bound: float, l2_eps: float, norm_eps: float, window: int,
             validate: bool = True):
        design = make_design(window)
        design.decode = _decode
        return cache_step(design, q_raw=q_raw, k_raw=k_raw, v_raw=v_raw, g_raw=g_raw,
                          beta_raw=beta_raw, z=z, n_tokens=n_tokens, accepted=accepted, conv_w=conv_w, A_log=A_log,
                          dt_bias=dt_bias, o_norm_w=o_norm_w, cache=cache, fill=fill, base_conv=base_conv,
                          base_state=base_state, lower_bound=lower_bound, l2_eps=l2_eps, norm_eps=norm_eps,
                          validate=validate)
    step.__doc__ = doc
    return step


class _AcceptsOneShort(KdaInputCache):
    def accept(self, accepted):
        super().accept((accepted - 1).clamp(min=0))


class _NeighboursAccept(KdaInputCache):
    def accept(self, accepted):
        super().accept(torch.roll(accepted, 1))


class _DraftOneSlotLate(KdaInputCache):
    """Replays and writes back right, but leaves the draft's inputs one slot past where the next step's
    replay reads them (slot fill + t + 1; the slot at fill keeps its stale token)."""

    def verify(self, *, n_tokens, **draft):
        before = {n: v.clone() for n, v in self.cache.items()}
        y = super().verify(n_tokens=n_tokens, **draft)
        S = next(iter(self.cache.values())).shape[1]
        for b in range(n_tokens.shape[0]):
            lo, hi = int(self.fill[b]), min(int(self.fill[b]) + int(n_tokens[b]) + 1, S)
            for name, v in self.cache.items():
                v[b, lo + 1:hi] = v[b, lo:hi - 1].clone()
                v[b, lo] = before[name][b, lo]
        return y


kda_cache_step_control = _step_through(lambda w: _WritebackAt(at=w, slots=None, window=w),
                                       "No bug: _WritebackAt at the window, replaying all it holds.")
kda_cache_step_replay_skips_oldest = _step_through(
    _SkipsOldest, "The replay starts at the second cached token, dropping the oldest.")
kda_cache_step_writeback_late = _step_through(
    lambda w: _WritebackAt(at=w + 1, slots=None, window=w),
    "Writes back only once window + 1 tokens are cached: a cache filled to exactly the window stays.")
kda_cache_step_writeback_drops_overshoot = _step_through(
    lambda w: _WritebackAt(at=w, slots=w, window=w),
    "An accept that fills the cache past the window writes back only its first `window` tokens.")
kda_cache_step_accept_one_short = _step_through(
    _AcceptsOneShort, "Commits one token fewer than accepted (where any were).")
kda_cache_step_neighbours_accept = _step_through(
    _NeighboursAccept, "Each sequence commits its neighbour's accepted length.")
kda_cache_step_draft_one_slot_late = _step_through(_DraftOneSlotLate, _DraftOneSlotLate.__doc__)
