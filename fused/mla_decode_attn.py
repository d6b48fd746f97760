"""mla_decode_attn: paged latent MQA decode (FlashMLA form), split-KV with an LSE combine.

o_latent[b, j, h] = softmax_t(scale * q_abs[b, j, h] . cache[t]) @ cache[t, :kv_lora] over the slots
t < L_b - n_q + j + 1 of sequence b (slot t at page block_table[b, t // page], row t % page), as
references.mla.mla_decode_attn; with return_lse also lse[b, j, h] (fp32, natural log).

Launches (fused/mla_decode_attn_split.py): one partial kernel on a grid (S, row tiles, B) in which
every CTA brings each KV tile of its split into shared memory once and uses it for all its
16 * m_atoms query rows (rows = query tokens x heads of one sequence, mma.sync), then, when S > 1, the
combine kernel over the fp32 workspace [B, S, R, kv_lora] + [B, S, R]. S = 1 writes o directly.
The variant (m_atoms, S) is picked per shape from (B, rows, block-table width): S fills the SMs
when B x row tiles does not; a new batch size, head count, draft length, context length or split
count does not recompile (the compile key is dtype, C, kv_lora, page, m_atoms, tile, direct, PATH).

Lengths are read on the host (one sync, skipped while a CUDA graph is being captured): a length
shorter than the draft (n_q), longer than the block table row, or a needed page id outside the
cache is a ValueError before launch. The kernel also clamps lengths to the table and page ids to
the cache, so no captured replay reads outside them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fused import runtime
from references.primitives import check_tensor

DTYPES = ("bfloat16", "float16")     # working dtypes (P V runs on bf16/fp16 tensor cores)
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_SPLIT_PAGES = 4                  # a split holds at least this many pages (the dispatcher's S)
# The path of every dispatched and certified launch (the others are trial_configs(), GPU-tested only):
# "whole": every warp of a row atom computes the atom's whole S, V fragments by 2-byte shared loads;
# "split": the C = 576 contraction split over the atom's kv_lora / 128 warps, partial scores summed
# through shared memory in warp order (72 MMAs per warp and tile at K3 instead of 176);
# "split_ldsm": split, with V fragments by ldmatrix.trans (16 instead of 128 loads per warp and tile).
PATH = "split_ldsm"


@dataclass(frozen=True)
class MlaDecodeConfig:
    """Launch variant: m16 row atoms per CTA (0: from the shape), KV slots per tile, splits S
    (0: from the shape; 1: no workspace, o written by the partial kernel), kernel path (PATH)."""
    m_atoms: int = 0
    n_tile: int = 32
    splits: int = 0
    path: str = PATH

    @property
    def name(self) -> str:
        return f"m{self.m_atoms or 'A'}n{self.n_tile}s{self.splits or 'A'}" + ("" if self.path == PATH else self.path)


def all_configs(path: str = PATH) -> list[MlaDecodeConfig]:
    """Launches the harness certifies beside the dispatcher's pick: every row-atom count, the
    direct write (S = 1) and combines over 2, 3 and 5 splits (more splits than pages gives empty ones)."""
    return [MlaDecodeConfig(1, 32, 1, path), MlaDecodeConfig(2, 32, 3, path), MlaDecodeConfig(3, 32, 2, path),
            MlaDecodeConfig(4, 32, 5, path), MlaDecodeConfig(4, 32, 1, path)]


def trial_configs() -> list[MlaDecodeConfig]:
    """The other paths' launches: checked and timed by the GPU tests, neither dispatched nor certified."""
    from fused.mla_decode_attn_split import PATHS
    return [c for p in PATHS if p != PATH for c in all_configs(p)]


def variants(tensors: dict, params: dict) -> list[MlaDecodeConfig]:
    """Every launch variant the harness must certify for these inputs."""
    return all_configs()


def for_shape(batch: int, rows: int, max_pages: int, sms: int = 132,
              variant: MlaDecodeConfig | None = None) -> tuple[int, int, int, str]:
    """(m_atoms, n_tile, S, path) for B sequences of `rows` query rows and block tables `max_pages` wide:
    rows split into the fewest tiles of <= 64, atoms balanced over them; S = 1 when B x tiles fills
    the SMs, else enough splits to, each at least MIN_SPLIT_PAGES pages."""
    v = variant or MlaDecodeConfig()
    tiles = -(-rows // 64)
    m_atoms = v.m_atoms or -(-(-(-rows // tiles)) // 16)
    ctas = batch * -(-rows // (16 * m_atoms))
    splits = v.splits or max(1, min(max_pages // MIN_SPLIT_PAGES, sms // max(ctas, 1)))
    return m_atoms, v.n_tile, splits, v.path


@runtime.compile_cache("mla_decode_attn")
def _compile(kind: str, dtype: str, D: int, C: int = 0, page: int = 0, m_atoms: int = 1, n_tile: int = 32,
             direct: bool = True, path: str = "whole"):
    """kind "partial": the split kernel (direct: o in wd, else fp32 partials); "combine": the LSE combine.
    Batch, query rows (n_q x H), heads, splits, cache pages and block-table width are all dynamic."""
    from fused.mla_decode_attn_split import Combine, SplitPartial

    cutlass, cute = runtime.cutlass_modules()
    b, s, R = runtime.sym_int(), runtime.sym_int(), runtime.sym_int()
    if kind == "combine":
        return runtime.compile_tvm_ffi(
            Combine(D), runtime.fake_tensor("float32", (b, s, R, D), align=4),
            runtime.fake_tensor("float32", (b, s, R), align=4), runtime.fake_tensor(dtype, (b, R, D), align=2),
            runtime.fake_tensor("float32", (b, R), align=4))
    op = SplitPartial(runtime.cutlass_dtype(dtype), C, D, page, m_atoms, n_tile, direct, path)
    cache = cute.runtime.make_fake_tensor(runtime.cutlass_dtype(dtype), (runtime.sym_int(), page, C),
                                          stride=(cute.sym_int64(divisibility=8), C, 1), assumed_align=16)
    return runtime.compile_tvm_ffi(
        op, runtime.fake_tensor(dtype, (b, R, C)), cache,
        runtime.fake_tensor("int32", (b, runtime.sym_int()), align=4), runtime.fake_tensor("int32", (b,), align=4),
        runtime.fake_tensor(dtype if direct else "float32", (b, s, R, D), align=2 if direct else 4),
        runtime.fake_tensor("float32", (b, s, R), align=4), cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1))


def plan(n_seq: int, n_q: int, H: int, C: int, D: int, page: int, max_pages: int, dtype: str, sms: int,
         variant: MlaDecodeConfig | None = None) -> tuple[tuple, int, tuple | None]:
    """(partial kernel's compile key, splits S, combine kernel's compile key or None when S = 1)."""
    m_atoms, n_tile, S, path = for_shape(n_seq, n_q * H, max_pages, sms, variant)
    if D <= 128 and path == "split":         # one warp per row atom: nothing to split
        path = "whole"
    part = ("partial", dtype, D, C, page, m_atoms, n_tile, S == 1, path)
    return part, S, (None if S == 1 else ("combine", dtype, D))


def _check(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank):
    check_tensor("q_abs", q_abs, ndim=4, dtypes=tuple(_TORCH.values()))
    n_seq, n_q, n_heads, width = q_abs.shape
    check_tensor("cache", cache, shape=(None, None, width), dtypes=(q_abs.dtype,))
    check_tensor("block_table", block_table, shape=(n_seq, None), dtypes=(torch.int32, torch.int64))
    check_tensor("seq_lens", seq_lens, shape=(n_seq,), dtypes=(torch.int32, torch.int64))
    if not 1 <= n_q <= 8:
        raise ValueError(f"q_abs: {n_q} query tokens per sequence; decode supports 1..8 (dim 1)")
    if width % 8 or kv_lora_rank % 16 or not 16 <= kv_lora_rank <= width:
        raise ValueError(f"q_abs: width {width} must be a multiple of 8 and kv_lora_rank {kv_lora_rank} a "
                         f"multiple of 16 within it for the fused kernel")
    if not math.isfinite(scale):
        raise ValueError(f"scale: must be finite, got {scale!r}")
    for name, t in (("q_abs", q_abs), ("cache", cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        runtime.require_cuda(name, t)
    if n_seq and not torch.cuda.is_current_stream_capturing():
        _check_lengths(n_q, cache, block_table, seq_lens)


def _check_lengths(n_q, cache, block_table, seq_lens):
    """One host sync: every length covers the draft and fits its block-table row, every page it
    needs is in the cache."""
    n_pages, page = cache.shape[0], cache.shape[1]
    lens = seq_lens.long()
    need = (lens.clamp(min=0) + page - 1) // page
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < need[:, None]
    bad = used & ((block_table < 0) | (block_table >= n_pages))
    flags = torch.stack([(lens < n_q).any(), (need > block_table.shape[1]).any(), bad.any()]).tolist()
    if flags[0]:
        i = int(torch.argmin(lens))
        raise ValueError(f"seq_lens: sequence {i} has length {int(lens[i])}, shorter than its {n_q} query tokens "
                         f"(the draft); every length must count the draft tokens")
    if flags[1]:
        i = int(torch.argmax(need))
        raise ValueError(f"seq_lens: sequence {i} has length {int(lens[i])}, which needs {int(need[i])} pages; "
                         f"its block_table row has {block_table.shape[1]}")
    if flags[2]:
        i, k = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"block_table: page id {int(block_table[i, k])} at [{i}, {k}] is outside the cache of "
                         f"{n_pages} pages")


def launch(q_abs, cache, block_table, seq_lens, o_latent, lse, scale: float, kv_lora_rank: int,
           variant: MlaDecodeConfig | None = None) -> None:
    """Destination-passing launch on the current stream: writes o_latent[B, n_q, H, D] and lse[B, n_q, H]."""
    n_seq, n_q, H, C = q_abs.shape
    if n_seq == 0:
        return
    D, R = kv_lora_rank, n_q * H
    part, S, comb = plan(n_seq, n_q, H, C, D, cache.shape[1], block_table.shape[1], runtime.dtype_name(q_abs.dtype),
                         runtime.sm_count(q_abs.device), variant)
    q = runtime.aligned(q_abs.reshape(n_seq, R, C).contiguous())
    kv = cache if cache.stride()[1:] == (C, 1) and cache.stride(0) % 8 == 0 else cache.contiguous()
    kv = runtime.aligned(kv)
    bt = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    scale_log2 = float(scale) * math.log2(math.e)
    if comb is None:
        _compile(*part)(q, kv, bt, lens, o_latent.view(n_seq, 1, R, D), lse.view(n_seq, 1, R), H, scale_log2, 1)
        return
    po = torch.empty(n_seq, S, R, D, dtype=torch.float32, device=q_abs.device)
    pl = torch.empty(n_seq, S, R, dtype=torch.float32, device=q_abs.device)
    _compile(*part)(q, kv, bt, lens, po, pl, H, scale_log2, S)
    _compile(*comb)(po, pl, o_latent.view(n_seq, R, D), lse.view(n_seq, R))


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_decode_attn", mutates_args=("o_latent", "lse"))
        def mla_decode_attn_out(q_abs: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                                seq_lens: torch.Tensor, o_latent: torch.Tensor, lse: torch.Tensor,
                                scale: float, kv_lora_rank: int) -> None:
            launch(q_abs, cache, block_table, seq_lens, o_latent, lse, scale, kv_lora_rank)

        _op = mla_decode_attn_out
    return _op


def mla_decode_attn(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int, *,
                    return_lse: bool = False, variant: MlaDecodeConfig | None = None):
    """Fused replacement of references.mla.mla_decode_attn (same signature and results)."""
    _check(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank)
    n_seq, n_q, H, _ = q_abs.shape
    o = torch.empty(n_seq, n_q, H, kv_lora_rank, dtype=q_abs.dtype, device=q_abs.device)
    lse = torch.empty(n_seq, n_q, H, dtype=torch.float32, device=q_abs.device)
    args = (q_abs, cache, block_table, seq_lens, o, lse, float(scale), int(kv_lora_rank))
    if variant is not None:
        launch(*args, variant=variant)
    else:
        _custom_op()(*args)
    return (o, lse) if return_lse else o
