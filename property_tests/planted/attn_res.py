"""Planted bugs in the AttnRes ops (references/attn_res.py)."""
from __future__ import annotations

import torch

from references.attn_res import attn_res_mix
from references.primitives import rms_norm


def _mix_unnormalised_keys(sources, res_norm_w, res_proj_w, eps):
    v = sources.float()
    query = res_norm_w.float() * res_proj_w.reshape(-1).float()
    probs = (v * query).sum(-1).softmax(-1)                 # keys = raw sources
    return torch.matmul(probs.unsqueeze(1), v).squeeze(1).to(sources.dtype)


def _mix_skips_nonfinite_sources(sources, res_norm_w, res_proj_w, eps):
    """The reference mix, except that a source whose score is NaN gets weight 0 and is never read (a
    kernel that skips zero-weight sources, with fmaxf's NaN-dropping max deciding the weights)."""
    v = sources.float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    scores = (keys * (res_norm_w.float() * res_proj_w.reshape(-1).float())).sum(-1)
    probs = torch.where(torch.isnan(scores), float("-inf"), scores).softmax(-1)
    read = torch.where((probs > 0).unsqueeze(-1), v, torch.zeros_like(v))
    return torch.matmul(probs.unsqueeze(1), read).squeeze(1).to(sources.dtype)


def _finish(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps,
            *, mix=attn_res_mix, reset_prefix=True):
    sources = torch.cat([blocks[:, :n_blocks], p.unsqueeze(1)], dim=1)
    out = rms_norm(mix(sources, res_norm_w, res_proj_w, eps), norm_w, norm_eps)
    if block_write >= 0:
        blocks[:, block_write] = p
        if reset_prefix:
            prefix.zero_()
        else:
            prefix.copy_(p)
    else:
        prefix.copy_(p)
    return out


def attn_res_rmsnorm_keys_unnormalised(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                       n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """Scores use the raw sources as keys (the RMS normalisation of the keys is skipped)."""
    p = prefix + delta
    return _finish(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps,
                   mix=_mix_unnormalised_keys)


def attn_res_rmsnorm_skips_nonfinite_sources(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                              n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """Sources with a NaN score are dropped from the mix (weight 0, never loaded): a NaN or infinity in
    a source no longer reaches out."""
    p = prefix + delta
    return _finish(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps,
                   mix=_mix_skips_nonfinite_sources)


def attn_res_rmsnorm_control(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                             n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """No bug: the helper the attn_res rows plant theirs in (test_planted_bugs checks it certifies)."""
    return _finish(prefix, prefix + delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps,
                   norm_eps)


def attn_res_rmsnorm_prefix_not_reset(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                      n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """On a block write the snapshot is stored but the prefix keeps p instead of restarting at 0."""
    p = prefix + delta
    return _finish(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps,
                   reset_prefix=False)


def attn_res_rmsnorm_accumulates_into_delta(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                            n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """Computes p in place in the delta buffer (`delta += prefix`), treating delta as dead."""
    p = delta.add_(prefix)
    return _finish(prefix, p.clone(), blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps,
                   norm_eps)


def attn_res_rmsnorm_out_in_delta(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                  n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """Writes the output into delta's buffer and returns it (an 'in-place' residual kernel)."""
    p = prefix + delta
    out = _finish(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps)
    delta.copy_(out)
    return delta


def allreduce_attn_res_rmsnorm_reverse_fold(prefix, deltas, blocks, res_norm_w, res_proj_w, norm_w,
                                            n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """All-reduce folds the partials rank T-1..0 (ring order seen from the last rank), not 0..T-1."""
    total = deltas[-1].float()
    for r in range(deltas.shape[0] - 2, -1, -1):
        total = total + deltas[r].float()
    p = prefix + total.to(deltas.dtype)
    return _finish(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps)


_RING: dict[tuple, list] = {}


def attn_res_rmsnorm_output_ring(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks: int,
                                 block_write: int, eps: float, norm_eps: float):
    """Returns `out` from a ring of three preallocated buffers per shape (a double-buffering scheme
    one slot too shallow for its caller): a result is overwritten three calls later."""
    from references.attn_res import attn_res_rmsnorm as ref

    y = ref(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps, norm_eps)
    ring = _RING.setdefault((tuple(y.shape), y.dtype, y.device), [])
    slot = torch.empty_like(y) if len(ring) < 3 else ring.pop(0)      # the oldest slot is reused
    ring.append(slot)
    slot.copy_(y)
    return slot


def attn_res_rmsnorm_swapped_eps(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                 n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """The key-norm eps and the output RMSNorm eps passed in swapped order (equal in every config)."""
    return _finish(prefix, prefix + delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write,
                   norm_eps, eps)


def _mix_without_max(sources, res_norm_w, res_proj_w, eps):
    v = sources.float()
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    query = res_norm_w.float() * res_proj_w.reshape(-1).float()
    e = (keys * query).sum(-1).exp()                       # no running max: exp overflows at scores > 88
    return torch.matmul((e / e.sum(-1, keepdim=True)).unsqueeze(1), v).squeeze(1).to(sources.dtype)


def attn_res_rmsnorm_softmax_without_max(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                         n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """Online softmax without its running max: inf / inf = NaN once a score passes fp32 exp's range."""
    return _finish(prefix, prefix + delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps,
                   norm_eps, mix=_mix_without_max)


def attn_res_rmsnorm_row_fixed_point_out(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                         n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """out stored as fixed point with one scale per row (the dtype's mantissa bits of the row maximum):
    small elements lose all relative precision. The row rule admitted it; the element rule does not."""
    out = _finish(prefix, prefix + delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write, eps,
                  norm_eps)
    levels = 1 / torch.finfo(out.dtype).eps - 1                      # 2^mantissa bits - 1
    y = out.float()
    step = (y.abs().amax(-1, keepdim=True) / levels).clamp_min(1e-30)
    return (torch.round(y / step) * step).to(out.dtype)


def attn_res_rmsnorm_returns_list(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w,
                                  n_blocks: int, block_write: int, eps: float, norm_eps: float):
    """The right out and state, out returned inside a list of one."""
    return [attn_res_rmsnorm_control(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write,
                                     eps, norm_eps)]
