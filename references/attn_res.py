"""Attention Residuals (AttnRes): the K3 `_apply_attn_res` mix and the fused decode ops around it.

Math: shared/reference/kimi-k3-math.md §3. Signatures: docs/ARCHITECTURE.md. dtype-generic: float64
inputs give the oracle, bf16/fp16/fp32 the working-precision baseline ("fp32" steps use acc_dtype).
"""
from __future__ import annotations

import torch

from references.primitives import FLOAT_DTYPES, acc_dtype, check_tensor, rms_norm, fold_ranks

MAX_SOURCES = 9  # 8 block snapshots + the running prefix (K3: 93 layers, block size 12)


def attn_res_mix(sources: torch.Tensor, res_norm_w: torch.Tensor, res_proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """K3 `_apply_attn_res` over sources[B,S,D] (last source = the prefix) -> [B,D] in sources.dtype.

    Keys are RMS-normalised sources (acc), the query is res_norm_w * res_proj_w (acc), scores have no
    temperature, the softmax weights mix the RAW sources in acc, rounded once to the working dtype.
    """
    check_tensor("sources", sources, ndim=3, dtypes=FLOAT_DTYPES)
    D = sources.shape[-1]
    check_tensor("res_norm_w", res_norm_w, shape=(D,), dtypes=FLOAT_DTYPES)
    check_tensor("res_proj_w", res_proj_w.reshape(-1) if res_proj_w.dim() == 2 else res_proj_w,
                 shape=(D,), dtypes=FLOAT_DTYPES)
    probs = attn_res_probs(sources, res_norm_w, res_proj_w, eps)
    return torch.matmul(probs.unsqueeze(1), sources.to(probs.dtype)).squeeze(1).to(sources.dtype)


def attn_res_probs(sources: torch.Tensor, res_norm_w: torch.Tensor, res_proj_w: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The mix's softmax weights [B, S] (acc): keys are the RMS-normalised sources, the query is
    res_norm_w * res_proj_w, scores have no temperature."""
    acc = acc_dtype(sources)
    v = sources.to(acc)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    query = res_norm_w.to(acc) * res_proj_w.reshape(-1).to(acc)
    scores = (keys * query).sum(-1)                                   # [B, S]
    return scores.softmax(-1)


def attn_res_mix_online(sources: torch.Tensor, res_norm_w: torch.Tensor, res_proj_w: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Same mix as `attn_res_mix`, as a one-pass online softmax (the fused kernels' formulation).

    Independent of `attn_res_mix` on purpose (tests compare the two): running max m, running
    denominator l and running weighted sum o, rescaled by exp(m_old - m_new) at every new source.
    """
    acc = acc_dtype(sources)
    query = res_norm_w.to(acc) * res_proj_w.reshape(-1).to(acc)
    B, S, D = sources.shape
    m = torch.full((B, 1), float("-inf"), dtype=acc, device=sources.device)
    l = torch.zeros((B, 1), dtype=acc, device=sources.device)
    o = torch.zeros((B, D), dtype=acc, device=sources.device)
    for s in range(S):
        v = sources[:, s].to(acc)
        logit = (v * query).sum(-1, keepdim=True) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        m_new = torch.maximum(m, logit)
        rescale = torch.exp(m - m_new)
        p = torch.exp(logit - m_new)
        l = l * rescale + p
        o = o * rescale + p * v
        m = m_new
    return (o / l).to(sources.dtype)


def _check_attn_res_args(prefix, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write):
    check_tensor("prefix", prefix, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = prefix.shape
    wd = (prefix.dtype,)
    check_tensor("blocks", blocks, shape=(B, None, D), dtypes=wd)
    for name, w in (("res_norm_w", res_norm_w), ("res_proj_w", res_proj_w), ("norm_w", norm_w)):
        check_tensor(name, w, shape=(D,), dtypes=wd)
    if not isinstance(n_blocks, int) or n_blocks < 0 or n_blocks + 1 > MAX_SOURCES:
        raise ValueError(f"n_blocks: {n_blocks!r} gives {n_blocks!r}+1 sources; K3 allows at most "
                         f"{MAX_SOURCES} (8 blocks + prefix), so use 0 <= n_blocks <= {MAX_SOURCES - 1}")
    if n_blocks > blocks.shape[1]:
        raise ValueError(f"n_blocks: {n_blocks} exceeds the {blocks.shape[1]} block slots of blocks {tuple(blocks.shape)}")
    if not isinstance(block_write, int) or block_write >= blocks.shape[1] or block_write < -1:
        raise ValueError(f"block_write: {block_write!r} is out of range; use -1 (no write) or a slot in "
                         f"0..{blocks.shape[1] - 1} of blocks {tuple(blocks.shape)}")


def _mix_norm_and_update(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write,
                         eps, norm_eps):
    sources = torch.cat([blocks[:, :n_blocks], p.unsqueeze(1)], dim=1)
    out = rms_norm(attn_res_mix(sources, res_norm_w, res_proj_w, eps), norm_w, norm_eps)
    if block_write >= 0:
        blocks[:, block_write] = p
        prefix.zero_()              # the next delta starts the new block (HF: prefix = None)
    else:
        prefix.copy_(p)
    return out


def attn_res_rmsnorm(prefix: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor,
                     res_norm_w: torch.Tensor, res_proj_w: torch.Tensor, norm_w: torch.Tensor,
                     n_blocks: int, block_write: int, eps: float, norm_eps: float) -> torch.Tensor:
    """p = wd(prefix + delta); out = rms_norm(AttnRes mix of [blocks[:, :n_blocks], p]); state update.

    State (in place): block_write >= 0 -> blocks[:, block_write] = p and prefix = 0; else prefix = p.
    """
    _check_attn_res_args(prefix, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write)
    check_tensor("delta", delta, shape=tuple(prefix.shape), dtypes=(prefix.dtype,))
    p = prefix + delta               # one rounding to the working dtype, as the HF bf16 add
    return _mix_norm_and_update(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks,
                                block_write, eps, norm_eps)


def fold_partials(deltas: torch.Tensor) -> torch.Tensor:
    """Declared all-reduce order of the T partial deltas [T, B, D] (primitives.fold_ranks)."""
    return fold_ranks(deltas)


def allreduce_attn_res_rmsnorm(prefix: torch.Tensor, deltas: torch.Tensor, blocks: torch.Tensor,
                               res_norm_w: torch.Tensor, res_proj_w: torch.Tensor, norm_w: torch.Tensor,
                               n_blocks: int, block_write: int, eps: float, norm_eps: float) -> torch.Tensor:
    """`attn_res_rmsnorm` with delta = the all-reduce of deltas[T,B,D] (see `fold_partials`)."""
    _check_attn_res_args(prefix, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write)
    check_tensor("deltas", deltas, shape=(None,) + tuple(prefix.shape), dtypes=(prefix.dtype,))
    if deltas.shape[0] < 1:
        raise ValueError("deltas: needs at least one partial delta (dim 0 = ranks), got 0")
    p = prefix + fold_partials(deltas)
    return _mix_norm_and_update(prefix, p, blocks, res_norm_w, res_proj_w, norm_w, n_blocks,
                                block_write, eps, norm_eps)
