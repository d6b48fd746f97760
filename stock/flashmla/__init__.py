"""mla_decode_attn through FlashMLA's Hopper kernel (deepseek-ai/FlashMLA, sm_90a dense paged decode):
the split scheduler, the split-KV attention and the LSE combine, FlashMLA's own three kernels, reached
through `shim.cu`'s C entry point and ctypes. No torch C++ ABI lies between the two, so the library
built on a CPU machine (`build.sh`) loads beside whatever torch the GPU machine has.

Two uses:
  - `flashmla_decode_attn`: a candidate of mla_decode_attn with the reference's signature
    (`--candidate stock.flashmla:flashmla_decode_attn`), judged by the harness like any third-party
    kernel. It validates what FlashMLA would otherwise assert by exiting the process (576-wide keys,
    512-wide values, pages of 64 slots, bf16 / fp16) and raises a one-line ValueError instead.
  - `flashmla_peer`: the bench peer protocol (prepare(tensors, params) -> launch;
    `--peer mla_decode_attn:flashmla=stock.flashmla:flashmla_peer`). Its buffers and the split schedule
    (FlashMLA's get_mla_metadata, which depends only on seq_lens) are made in prepare, as a serving
    engine computes the schedule once per step for every layer; the launch is the attention and the
    combine, two kernels, capturable in a CUDA graph.

The library is `$VERIFY_FLASHMLA_LIB`, else build/flashmla/libflashmla_sm90.so under the project root;
where it is missing, or not on CUDA, both raise ImportError naming what is missing.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from references.mla import _check_decode_inputs
from stock.sm90 import aligned16, capturing, check_half, check_pages, require_sm90a

HEAD_DIM_K, HEAD_DIM_V, PAGE = 576, 512, 64
MAX_SM_PARTS = 160                    # FlashMLA's combine kernel instantiates up to 160 splits per row block
DEFAULT_LIB = Path(__file__).resolve().parents[2] / "build" / "flashmla" / "libflashmla_sm90.so"


def library_path() -> Path:
    return Path(os.environ.get("VERIFY_FLASHMLA_LIB", DEFAULT_LIB))


def source_commit() -> str | None:
    """The FlashMLA commit the library was built from (build.sh writes it beside the library)."""
    marker = library_path().with_name(library_path().name + ".source")
    return marker.read_text().strip() if marker.is_file() else None


@cache
def _lib():
    path = library_path()
    if not path.is_file():
        raise ImportError(f"stock.flashmla: no FlashMLA library at {path} (build it with "
                          f"stock/flashmla/build.sh FLASHMLA_DIR {path}, or set VERIFY_FLASHMLA_LIB)")
    lib = ctypes.CDLL(str(path))
    p, i, ll, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    lib.fmla_dense_decode.argtypes = [i, i, i, i, i, i, i, i, ll, ll, f, i, p, p, p, p, p, ll, p, p, p, i, p, p, i, p]
    lib.fmla_dense_decode.restype = i
    lib.fmla_sched_meta_ints.restype = i
    return lib


def num_sm_parts(device: torch.device, n_q: int, n_heads: int) -> int:
    """FlashMLA's split count for one KV head: the SMs over the 64-row query tiles of a sequence."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(MAX_SM_PARTS, max(sms // -(-(n_q * n_heads) // 64), 1))


@dataclass
class Plan:
    """Every buffer one FlashMLA call writes, for one (B, n_q, H, dtype): out and lse are the results,
    the rest FlashMLA's schedule and split accumulators."""
    out: torch.Tensor            # [B, n_q, H, 512] wd
    lse: torch.Tensor            # [B, n_q, H] fp32
    sched: torch.Tensor          # [parts, meta ints] int32
    n_splits: torch.Tensor       # [B + 1] int32
    lse_accum: torch.Tensor      # [B + parts, n_q * H] fp32
    o_accum: torch.Tensor        # [B + parts, n_q * H, 512] fp32

    @classmethod
    def make(cls, B: int, n_q: int, H: int, dtype: torch.dtype, device: torch.device) -> "Plan":
        parts, rows = num_sm_parts(device, n_q, H), n_q * H
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        return cls(torch.empty(B, n_q, H, HEAD_DIM_V, dtype=dtype, device=device), torch.empty(B, n_q, H, **f32),
                   torch.empty(parts, _lib().fmla_sched_meta_ints(), **i32), torch.empty(B + 1, **i32),
                   torch.empty(B + parts, rows, **f32), torch.empty(B + parts, rows, HEAD_DIM_V, **f32))


def _check(q_abs, cache_, kv_lora_rank: int):
    """What FlashMLA's dense decode takes (its own checks exit the process), then where it runs."""
    check_half(q_abs, cache_, "stock.flashmla")
    if q_abs.shape[-1] != HEAD_DIM_K or kv_lora_rank != HEAD_DIM_V or cache_.shape[1] != PAGE:
        raise ValueError(f"stock.flashmla: FlashMLA takes {HEAD_DIM_K}-wide keys, {HEAD_DIM_V}-wide values and pages "
                         f"of {PAGE} slots, got q_abs width {q_abs.shape[-1]}, kv_lora_rank {kv_lora_rank}, "
                         f"page {cache_.shape[1]}")
    require_sm90a(q_abs, "stock.flashmla: FlashMLA's dense decode")


def launch(plan: Plan, q_abs, cache_, block_table, seq_lens, scale: float, schedule: bool) -> None:
    """FlashMLA on the current stream, writing plan.out and plan.lse: q_abs [B, n_q, H, 576] contiguous,
    block_table and seq_lens int32 contiguous on the device; with `schedule`, its split scheduler first (it
    reads seq_lens on the device, so the launch stays sync-free and capturable)."""
    B, n_q, H, _ = q_abs.shape
    rc = _lib().fmla_dense_decode(
        int(q_abs.dtype == torch.float16), B, n_q, H, HEAD_DIM_K, HEAD_DIM_V, PAGE, cache_.shape[0],
        cache_.stride(0), cache_.stride(1), float(scale), 1, q_abs.data_ptr(), cache_.data_ptr(),
        plan.out.data_ptr(), plan.lse.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        seq_lens.data_ptr(), plan.sched.data_ptr(), plan.n_splits.data_ptr(), plan.sched.shape[0],
        plan.lse_accum.data_ptr(), plan.o_accum.data_ptr(), int(schedule),
        torch.cuda.current_stream(q_abs.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"stock.flashmla: FlashMLA's launch failed ({'shape limits' if rc < 0 else f'CUDA error {rc}'})")


def operands(q_abs, cache_, block_table, seq_lens):
    """FlashMLA's operand forms: q and the cache contiguous from 16-byte aligned bases (its TMA loads), the
    block table and lengths int32 and contiguous (each the tensor itself when it already is)."""
    return (aligned16(q_abs), aligned16(cache_), block_table.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous())


def _check_call(q_abs, cache_, block_table, seq_lens, kv_lora_rank: int) -> None:
    """FlashMLA's limits and, unless a CUDA graph is being captured, the reference's argument checks and
    the page ids (host reads, which capture forbids; FlashMLA's scheduler reads the lengths on the device)."""
    if not capturing():
        _check_decode_inputs(q_abs, cache_, block_table, seq_lens)
        check_pages(cache_, block_table, seq_lens)
    _check(q_abs, cache_, kv_lora_rank)


def _prepared(q_abs, cache_, block_table, seq_lens, kv_lora_rank: int):
    """(plan, q, cache, block table, lengths) for one FlashMLA call on the op's inputs, after _check_call."""
    _check_call(q_abs, cache_, block_table, seq_lens, kv_lora_rank)
    B, n_q, H, _ = q_abs.shape
    return (Plan.make(B, n_q, H, q_abs.dtype, q_abs.device), *operands(q_abs, cache_, block_table, seq_lens))


def flashmla_decode_attn(q_abs: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, kv_lora_rank: int, *, return_lse: bool = False):
    """references.mla.mla_decode_attn through FlashMLA -> o_latent[B,Q,H,512] wd (with return_lse also
    lse[B,Q,H] fp32 as FlashMLA gives it). Causal among the Q query tokens as the reference: token j of a
    length-L sequence sees slots < L - Q + j + 1."""
    B, n_q, H, _ = q_abs.shape
    if B == 0:
        _check_call(q_abs, cache, block_table, seq_lens, kv_lora_rank)
        empty = torch.empty(0, n_q, H, HEAD_DIM_V, dtype=q_abs.dtype, device=q_abs.device)
        return (empty, torch.empty(0, n_q, H, device=q_abs.device)) if return_lse else empty
    plan, q, kv, table, lens = _prepared(q_abs, cache, block_table, seq_lens, kv_lora_rank)
    launch(plan, q, kv, table, lens, scale, schedule=True)
    return (plan.out, plan.lse) if return_lse else plan.out


def flashmla_peer(tensors: dict, params: dict):
    """Bench peer of mla_decode_attn: FlashMLA's attention + combine per launch, its schedule made here."""
    plan, q, kv, table, lens = _prepared(tensors["q_abs"], tensors["cache"], tensors["block_table"],
                                         tensors["seq_lens"], int(params["kv_lora_rank"]))
    scale = float(params["scale"])
    launch(plan, q, kv, table, lens, scale, schedule=True)

    def run():
        launch(plan, q, kv, table, lens, scale, schedule=False)
        return plan.out
    return run
