"""Where a third-party Hopper kernel built for sm_90a can run: a one-line ImportError otherwise (the
candidate or peer cannot run here, which the harness and the bench report as a skip with its reason)."""
from __future__ import annotations

import torch


def require_sm90a(t: torch.Tensor, who: str) -> None:
    """`who` (e.g. "stock.flashmla: FlashMLA's dense decode") runs on t's device, CUDA sm_90."""
    if t.device.type != "cuda":
        raise ImportError(f"{who} runs on CUDA sm_90a only, not on {t.device.type}")
    capability = torch.cuda.get_device_capability(t.device)
    if capability != (9, 0):
        raise ImportError(f"{who} is built for sm_90a; this device is sm_{capability[0]}{capability[1]}")


def check_half(q_abs: torch.Tensor, cache: torch.Tensor, who: str) -> None:
    """q_abs and cache both bf16 or both fp16: the dtypes the Hopper MLA kernels are built for."""
    if q_abs.dtype not in (torch.bfloat16, torch.float16) or cache.dtype != q_abs.dtype:
        raise ValueError(f"{who}: q_abs and cache must both be bf16 or fp16, got {q_abs.dtype} and {cache.dtype}")


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """t itself when contiguous with a 16-byte aligned base (TMA and 16-byte vector loads need it), else a
    contiguous copy: a strided or offset view of the same values, as a serving engine's buffers never are."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def capturing() -> bool:
    """The current CUDA stream is being captured into a graph: no tensor value can be read on the host
    (False where torch has no CUDA, whose capture query raises). Value checks are then left to the
    eager calls, the capture's own warm-up among them."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_pages(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Every page a sequence's length needs is in its block-table row and in the cache (one host read):
    the Hopper kernels read page ids unchecked, where the reference raises."""
    page, n_pages = cache.shape[1], cache.shape[0]
    need = (seq_lens.long().clamp(min=0) + page - 1) // page
    if bool((need > block_table.shape[1]).any()):
        b = int(torch.argmax(need))
        raise ValueError(f"seq_lens: sequence {b} has length {int(seq_lens[b])}, which needs {int(need[b])} pages; "
                         f"its block_table row has {block_table.shape[1]}")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < need[:, None].to(block_table.device)
    bad = used & ((block_table < 0) | (block_table >= n_pages))
    if bool(bad.any()):
        b, k = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"block_table: page id {int(block_table[b, k])} at [{b}, {k}] is outside the cache of "
                         f"{n_pages} pages")
