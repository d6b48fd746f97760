"""mla_decode_attn through FlashInfer's Hopper MLA path: the fa3 backend of BatchMLAPagedAttentionWrapper
(batch_mla_sm90 plan + run, one attention kernel with its split merge), the module FlashInfer's JIT
builds, loaded through tvm_ffi without the flashinfer package (`build.py` builds it on a CPU machine;
the package's Python side is 15 MB compressed, beyond what a device call can carry beside the CuTe DSL).

FlashInfer's Python wrapper refuses some causal shapes before it plans (`_validate_fa_causal_tile_bound`
in flashinfer/mla/_batch_mla/_backends/_fa_common.py, 0.7.4): where a 64- or 128-row query tile ends
inside a token's heads and that token's last visible key starts a 64-key tile, the native kernel omits
that key. `tile_bound_problem` states the same rule here. Three uses:
  - `flashinfer_mla_decode_attn`: a candidate of mla_decode_attn (`--candidate
    stock.flashinfer_mla:flashinfer_mla_decode_attn`) that refuses those shapes as FlashInfer does;
  - `flashinfer_mla_native`: the same without the refusal, the kernel as it runs natively: the harness
    should reject it on a case that reaches the boundary;
  - `flashinfer_mla_peer`: the bench peer (`--peer mla_decode_attn:flashinfer=stock.flashinfer_mla:
    flashinfer_mla_peer`): the plan (host work and one copy of its metadata) in prepare, as an engine
    plans once per step for every layer; the launch is the run, capturable in a CUDA graph.

The libraries are `$VERIFY_FLASHINFER_MLA_DIR/batch_mla_sm90_{bfloat16,float16}.so`, else under
build/flashinfer_mla in the project root; where one is missing, or not on CUDA sm_90, ImportError.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from references.mla import _check_decode_inputs
from stock.sm90 import aligned16, capturing, check_half, check_pages, require_sm90a

HEAD_DIM_CKV, HEAD_DIM_KPE = 512, 64
TILE_KV = 64                                  # the Hopper kernel's key tile
FLOAT_WORKSPACE = 128 << 20                   # FlashInfer's documented workspace size
INT_WORKSPACE = 8 << 20                       # the wrapper's default int workspace
MASK_CAUSAL = 1                               # flashinfer MaskMode.CAUSAL
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "build" / "flashinfer_mla"


def library_dir() -> Path:
    return Path(os.environ.get("VERIFY_FLASHINFER_MLA_DIR", DEFAULT_DIR))


def version() -> str | None:
    """'<flashinfer version> <commit>' of the built modules (build.py writes it beside them)."""
    marker = library_dir() / "VERSION"
    return marker.read_text().strip() if marker.is_file() else None


@cache
def _module(dtype_name: str):
    path = library_dir() / f"batch_mla_sm90_{dtype_name}.so"
    if not path.is_file():
        raise ImportError(f"stock.flashinfer_mla: no FlashInfer MLA module at {path} (build it with "
                          f"stock/flashinfer_mla/build.py {library_dir()}, or set VERIFY_FLASHINFER_MLA_DIR)")
    try:
        import tvm_ffi
    except ImportError as e:
        raise ImportError(f"stock.flashinfer_mla: needs apache-tvm-ffi to load FlashInfer's module ({e})") from None
    if torch.cuda.is_available():
        torch.cuda.init()                      # the module's libcudart is torch's, loaded first
    return tvm_ffi.load_module(str(path))


def tile_bound_problem(q_lens: list[int], kv_lens: list[int], n_heads: int) -> str | None:
    """FlashInfer's causal tile-bound refusal for its Hopper backend, or None where it plans: a query
    tile of 64 rows (128 when a request averages more than 64 rows of tokens x heads) ending inside a
    token's heads, where that token's last visible key starts a 64-key tile."""
    tile_q = 64 * (2 if sum(q_lens) * n_heads // len(q_lens) > 64 else 1)
    if tile_q % n_heads == 0:
        return None
    for request, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for end in range(tile_q, q_len * n_heads, tile_q):
            query, remainder = divmod(end, n_heads)
            key = kv_len - q_len + query
            if remainder and query < q_len and 0 <= key < kv_len and key % TILE_KV == 0:
                return (f"stock.flashinfer_mla: FlashInfer refuses this causal shape (sequence {request}: {n_heads} "
                        f"heads, query {query} of {q_len}, last visible key {key} starts a {TILE_KV}-key tile, "
                        f"which its Hopper kernel would omit)")
    return None


def _check(q_abs, cache_, kv_lora_rank: int):
    """What the built modules take, then where they run."""
    check_half(q_abs, cache_, "stock.flashinfer_mla")
    if q_abs.shape[-1] != HEAD_DIM_CKV + HEAD_DIM_KPE or kv_lora_rank != HEAD_DIM_CKV:
        raise ValueError(f"stock.flashinfer_mla: the built module takes {HEAD_DIM_CKV} latent + {HEAD_DIM_KPE} rope "
                         f"columns, got q_abs width {q_abs.shape[-1]} and kv_lora_rank {kv_lora_rank}")
    require_sm90a(q_abs, "stock.flashinfer_mla: FlashInfer's fa3 MLA module")


@dataclass
class Planned:
    """One plan: FlashInfer's workspaces and plan info, the CSR page list, the operand views, the output."""
    module: object
    float_ws: torch.Tensor
    int_ws: torch.Tensor
    pinned_ws: torch.Tensor
    plan_info: object
    kv_indices: torch.Tensor
    q_nope: torch.Tensor          # [B*Q, H, 512] view of q_abs
    q_pe: torch.Tensor            # [B*Q, H, 64] view of q_abs
    ckv: torch.Tensor             # [P, page, 512] view of the cache
    kpe: torch.Tensor             # [P, page, 64] view of the cache
    out: torch.Tensor             # [B*Q, H, 512]
    lse: torch.Tensor             # [B*Q, H] fp32
    n_heads: int
    page: int
    scale: float

    def run(self) -> torch.Tensor:
        import tvm_ffi

        stream = torch.cuda.current_stream(self.out.device)
        with tvm_ffi.use_raw_stream(tvm_ffi.device(str(self.out.device)), stream.cuda_stream):
            self.module.run(self.float_ws, self.int_ws, self.plan_info, self.q_nope, self.q_pe, self.ckv, self.kpe,
                            self.kv_indices, self.out, self.lse, MASK_CAUSAL, self.n_heads, self.page, self.scale,
                            True, 1.0, 1.0, None)
        return self.out


def plan(q_abs, cache_, block_table, seq_lens, scale: float, kv_lora_rank: int, *, refuse_tile_bound: bool = True):
    """FlashInfer's plan for these inputs (host reads of seq_lens and the block table; the plan's metadata,
    staged in pinned memory, copied to the device on the current stream). The plan is host work on the
    lengths, which CUDA-graph capture forbids: an engine plans before it replays (flashinfer_mla_peer)."""
    if capturing():
        raise RuntimeError("stock.flashinfer_mla: FlashInfer's MLA plans on the host from seq_lens, which a CUDA "
                           "graph capture cannot read; plan before capture and capture the run (flashinfer_mla_peer)")
    _check_decode_inputs(q_abs, cache_, block_table, seq_lens)
    _check(q_abs, cache_, kv_lora_rank)
    check_pages(cache_, block_table, seq_lens)
    B, n_q, H, C = q_abs.shape
    page = cache_.shape[1]
    lens = seq_lens.to("cpu", torch.int64).tolist()
    if refuse_tile_bound:
        problem = tile_bound_problem([n_q] * B, lens, H)
        if problem:
            raise ValueError(problem)
    module = _module(str(q_abs.dtype).removeprefix("torch."))
    dev, i32 = q_abs.device, dict(dtype=torch.int32)
    pages = [-(-n // page) for n in lens]
    table = block_table.to("cpu", torch.int32)
    kv_indices = torch.cat([table[b, :pages[b]] for b in range(B)]).to(dev)
    qo_indptr = torch.arange(0, (B + 1) * n_q, n_q, **i32)
    kv_indptr = torch.tensor([0] + pages, **i32).cumsum(0, dtype=torch.int32)
    float_ws = torch.empty(FLOAT_WORKSPACE, dtype=torch.uint8, device=dev)
    int_ws = torch.empty(INT_WORKSPACE, dtype=torch.uint8, device=dev)
    pinned_ws = torch.empty(INT_WORKSPACE, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    import tvm_ffi

    with tvm_ffi.use_raw_stream(tvm_ffi.device(str(dev)), torch.cuda.current_stream(dev).cuda_stream):
        planned = module.plan(float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, torch.tensor(lens, **i32), H,
                              HEAD_DIM_CKV, True)
    plan_info, staged = planned[0], int(planned[1])
    # the plan fills the pinned buffer only; FlashInfer's Python side copies those bytes to the device
    int_ws[:staged].copy_(pinned_ws[:staged], non_blocking=True)
    q = aligned16(q_abs).view(B * n_q, H, C)
    kv = aligned16(cache_)
    return Planned(module, float_ws, int_ws, pinned_ws, plan_info, kv_indices, q[..., :HEAD_DIM_CKV],
                   q[..., HEAD_DIM_CKV:], kv[..., :HEAD_DIM_CKV], kv[..., HEAD_DIM_CKV:],
                   torch.empty(B * n_q, H, HEAD_DIM_CKV, dtype=q_abs.dtype, device=dev),
                   torch.empty(B * n_q, H, dtype=torch.float32, device=dev), H, page, float(scale))


def flashinfer_mla_decode_attn(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """references.mla.mla_decode_attn through FlashInfer's fa3 MLA -> o_latent[B,Q,H,512] wd; the shapes
    FlashInfer's wrapper refuses raise ValueError."""
    B, n_q, H, _ = q_abs.shape
    if B == 0:
        return torch.empty(0, n_q, H, kv_lora_rank, dtype=q_abs.dtype, device=q_abs.device)
    return plan(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank).run().view(B, n_q, H, HEAD_DIM_CKV)


def flashinfer_mla_native(q_abs, cache, block_table, seq_lens, scale: float, kv_lora_rank: int):
    """The same kernel without the wrapper's tile-bound refusal: what it computes on every shape."""
    B, n_q, H, _ = q_abs.shape
    if B == 0:
        return torch.empty(0, n_q, H, kv_lora_rank, dtype=q_abs.dtype, device=q_abs.device)
    return plan(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank,
                refuse_tile_bound=False).run().view(B, n_q, H, HEAD_DIM_CKV)


def flashinfer_mla_peer(tensors: dict, params: dict):
    """Bench peer of mla_decode_attn: FlashInfer's planned run per launch."""
    q_abs = tensors["q_abs"]
    planned = plan(q_abs, tensors["cache"], tensors["block_table"], tensors["seq_lens"], float(params["scale"]),
                   int(params["kv_lora_rank"]))
    B, n_q, H, _ = q_abs.shape
    return lambda: planned.run().view(B, n_q, H, HEAD_DIM_CKV)
