"""mla_decode_attn_cp: one rank's window of decode context parallelism through fused/mla_decode_attn.py.

references.mla_cp.mla_decode_attn_cp is what a rank computes: the paged latent MQA over the keys at
positions [kv_start, kv_start + kv_len) of each sequence (its own pages, its own block table from the
window's start), causal by absolute position, with the natural-log LSE; a query that sees none of the
window gets o = 0 and lse = -inf, which the split-KV combine across ranks weighs to zero.

Query token j of a length-L sequence sees the window's first
    V_j = clamp(L - Q + j + 1 - kv_start, 0, kv_len)
keys, a prefix of the window whatever the rank. So each (sequence, token) is a one-token sequence of
the fused decode kernel over that prefix: q_abs [B, Q, H, C] read as [B * Q, 1, H, C] (the same bytes),
the block table repeated per token, lengths V_j. One launch of the kernel (two with its split-KV
combine) and a few element-wise ops, no host read: capturable in a CUDA graph. A token that sees no key
is given length 1 over page 0 of the rank's cache (a page that exists: the kernel reads only valid
pages) and its o and lse are then set to 0 and -inf.

Across processes (`attention_over_ranks`): each rank computes its window's partial this way, the T
ranks' o and lse are all-gathered in rank order (a `gather` such as fused.layers_tp.ProcessGroupGather:
NCCL between GPUs, gloo on CPUs) and every rank folds them by the declared combine
(references.mla_cp.combine_context, rank 0..T-1, fp32): every rank holds the same bits, those of the
split the harness simulates in one process for the same partials.

What this costs: a token no longer shares its sequence's key stream with the other draft tokens, so a
window is read Q times (Q = 1, plain decode, reads it once). `attend` is the per-token kernel, the
fused one by default; property_tests drive the same composition with the reference attention on the
CPU.
"""
import torch

from fused.mla_decode_attn import DTYPES, mla_decode_attn    # noqa: F401  (DTYPES: the kernel's scope is ours)
from references.mla_cp import _check as _check_windows
from references.mla_cp import combine_context


def _fused_attend(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank):
    return mla_decode_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank, return_lse=True)


def compose(attend, q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float, kv_lora_rank: int):
    """The window attention through `attend(q[B', 1, H, C], cache, table[B', pages], lens[B'], scale,
    kv_lora_rank) -> (o wd, lse fp32)`, one one-token sequence per (sequence, token): see the module doc."""
    B, Q, H, C = q_abs.shape
    dev = q_abs.device
    if B == 0:
        return (torch.empty(0, Q, H, kv_lora_rank, dtype=q_abs.dtype, device=dev),
                torch.empty(0, Q, H, dtype=torch.float32, device=dev))
    j = torch.arange(Q, device=dev)
    sees = (seq_lens.long()[:, None] - Q + 1 + j[None, :] - kv_start.long()[:, None]).clamp(min=0)
    sees = torch.minimum(sees, kv_len.long()[:, None]).reshape(B * Q)                    # V_j per (b, j)
    seen = sees > 0
    table = block_table.repeat_interleave(Q, dim=0)
    table[:, 0] = torch.where(seen, table[:, 0], torch.zeros_like(table[:, 0]))         # page 0 when unseen
    o, lse = attend(q_abs.reshape(B * Q, 1, H, C), cache, table, sees.clamp(min=1).to(seq_lens.dtype), scale,
                    kv_lora_rank)
    o = torch.where(seen[:, None, None, None], o, torch.zeros_like(o))
    lse = torch.where(seen[:, None, None], lse.float(), torch.full_like(lse, float("-inf"), dtype=torch.float32))
    return o.view(B, Q, H, kv_lora_rank), lse.view(B, Q, H)


def _check_unless_capturing(q_abs, cache, block_table, kv_start, kv_len, seq_lens) -> None:
    if not (q_abs.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_windows(q_abs, cache, block_table, kv_start, kv_len, seq_lens)


def mla_decode_attn_cp(q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float, kv_lora_rank: int):
    """Fused replacement of references.mla_cp.mla_decode_attn_cp: (o_latent[B,Q,H,kv_lora] wd, lse[B,Q,H] fp32).
    The window checks (host reads) run unless a CUDA graph is being captured."""
    _check_unless_capturing(q_abs, cache, block_table, kv_start, kv_len, seq_lens)
    return compose(_fused_attend, q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank)


def attention_over_ranks(gather, q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale: float,
                         kv_lora_rank: int, attend=_fused_attend):
    """The whole attention of the sequences under decode context parallelism, on this rank of `gather`'s
    T: its window's partial (this rank's cache pages, block table and window, `compose` over `attend`),
    then `gather(t) -> [T, *t.shape]` of o and of lse in rank order, folded by the declared combine.
    Returns (o_latent[B,Q,H,kv_lora] wd, lse[B,Q,H] fp32), the same bits on every rank. The window
    checks run as in mla_decode_attn_cp."""
    _check_unless_capturing(q_abs, cache, block_table, kv_start, kv_len, seq_lens)
    o, lse = compose(attend, q_abs, cache, block_table, kv_start, kv_len, seq_lens, scale, kv_lora_rank)
    all_o, all_lse = gather(o), gather(lse)
    return combine_context([(all_o[r], all_lse[r]) for r in range(all_o.shape[0])])
