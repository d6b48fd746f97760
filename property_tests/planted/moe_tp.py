"""Planted bugs in allreduce_latent_norm_up (references/moe_tp.py): the slips of a hand-fused MoE tail."""
from __future__ import annotations

from references.allreduce import allreduce_fold
from references.moe import latent_norm_up


def allreduce_latent_norm_up_no_residual(prefix, y_parts, shared_parts, norm_w, w_up, eps):
    """Returns the MoE output without the residual prefix (the epilogue's last add left out)."""
    return latent_norm_up(allreduce_fold(y_parts), norm_w, w_up, allreduce_fold(shared_parts), eps)


def allreduce_latent_norm_up_no_shared(prefix, y_parts, shared_parts, norm_w, w_up, eps):
    """The shared experts' output never added (a zero shared half)."""
    return prefix + latent_norm_up(allreduce_fold(y_parts), norm_w, w_up, 0 * allreduce_fold(shared_parts), eps)


def allreduce_latent_norm_up_drops_last_rank(prefix, y_parts, shared_parts, norm_w, w_up, eps):
    """The rank loop one short: the last rank's partials never added (T = 1 has no last rank to drop)."""
    n = max(1, y_parts.shape[0] - 1)
    return prefix + latent_norm_up(allreduce_fold(y_parts[:n]), norm_w, w_up, allreduce_fold(shared_parts[:n]), eps)


def allreduce_latent_norm_up_no_norm_weight(prefix, y_parts, shared_parts, norm_w, w_up, eps):
    """The RMSNorm's weight left out of the prologue (the normed latent times 1)."""
    return prefix + latent_norm_up(allreduce_fold(y_parts), norm_w.new_ones(norm_w.shape), w_up,
                                   allreduce_fold(shared_parts), eps)
