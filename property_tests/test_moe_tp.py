"""allreduce_latent_norm_up (references/moe_tp.py): the MoE tail of a rank is the layer's own composition
of it, bit for bit, on the column halves of the gathered row; T = 1 is the unsplit layer's tail."""
from __future__ import annotations

import pytest
import torch

from references.allreduce import allreduce_fold
from references.moe import latent_norm_up
from references.moe_tp import allreduce_latent_norm_up

B, L, D = 3, 16, 24


def _inputs(T: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    return rnd(B, D), rnd(T, B, L + D), 1 + 0.1 * rnd(L), rnd(D, L) / L ** 0.5


@pytest.mark.parametrize("T", [1, 2, 4])
def test_the_tail_is_the_rank_steps_composition_on_the_gathered_halves(T):
    """fused.layers_tp's MoE tail: folds of parts[..., :L] and parts[..., L:] (strided views of the
    gathered row), latent_norm_up, then prefix + mlp."""
    prefix, parts, norm_w, w_up = _inputs(T)
    want = prefix + latent_norm_up(allreduce_fold(parts[..., :L]), norm_w, w_up, allreduce_fold(parts[..., L:]), 1e-5)
    got = allreduce_latent_norm_up(prefix, parts[..., :L], parts[..., L:], norm_w, w_up, 1e-5)
    assert torch.equal(got, want)


def test_one_rank_is_the_unsplit_layers_tail():
    prefix, parts, norm_w, w_up = _inputs(1)
    y, shared = parts[0, :, :L].clone(), parts[0, :, L:].clone()
    got = allreduce_latent_norm_up(prefix, y[None], shared[None], norm_w, w_up, 1e-5)
    assert torch.equal(got, prefix + latent_norm_up(y, norm_w, w_up, shared, 1e-5))


def test_the_partials_fold_in_rank_order():
    """Order-sensitive partials: folding rank T-1..0 gives other bits."""
    prefix, parts, norm_w, w_up = _inputs(4)
    parts[0, :, :L] *= 2 ** 24
    parts[2, :, :L] = -parts[0, :, :L]
    y, s = parts[..., :L], parts[..., L:]
    got = allreduce_latent_norm_up(prefix, y, s, norm_w, w_up, 1e-5)
    assert not torch.equal(got, allreduce_latent_norm_up(prefix, y.flip(0), s, norm_w, w_up, 1e-5))


@pytest.mark.parametrize("bad, match", [
    (lambda a: dict(a, y_parts=a["y_parts"][:, :2]), "y_parts"),
    (lambda a: dict(a, shared_parts=a["shared_parts"][:2]), "shared_parts"),
    (lambda a: dict(a, y_parts=a["y_parts"][:0]), "y_parts"),
    (lambda a: dict(a, norm_w=a["norm_w"][:-1]), "norm_w"),
    (lambda a: dict(a, w_up=a["w_up"].float()), "w_up"),
    (lambda a: dict(a, prefix=a["prefix"][0]), "prefix"),
])
def test_bad_arguments_are_named(bad, match):
    prefix, parts, norm_w, w_up = _inputs(4)
    args = dict(prefix=prefix, y_parts=parts[..., :L], shared_parts=parts[..., L:], norm_w=norm_w, w_up=w_up)
    with pytest.raises((ValueError, TypeError), match=f"^{match}"):
        allreduce_latent_norm_up(**bad(args), eps=1e-5)
