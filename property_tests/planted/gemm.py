"""Planted bugs in skinny_gemm (references.gemm:skinny_gemm): x[M,K], w[N,K] -> y[M,N]."""
from __future__ import annotations

import torch

from property_tests.planted import FP16_SAFETY_CLAMP
from property_tests.planted._cache import TensorKeyed
from references.primitives import linear as _linear

BLOCK_N = 16


def linear(x, w):
    """The reference GEMM one token row at a time on contiguous operands: torch's CPU GEMM sums other
    batch sizes and strided views in other orders (at the off-tile knob's shapes a permuted batch gave
    other bits), so rows built on the whole-batch call were rejected by guard:batch_position whether
    or not their bug was there (skinny_gemm_control checks this helper certifies)."""
    w = w.contiguous()
    rows = [_linear(x[r:r + 1].contiguous(), w) for r in range(x.shape[0])]
    return torch.cat(rows) if rows else _linear(x, w)


def skinny_gemm_control(x, w):
    """No bug: the helper the skinny_gemm rows plant theirs in."""
    return linear(x, w)


def skinny_gemm_unwritten_tail(x, w):
    """Grid of (N - 1) // BLOCK_N column tiles (off by one): the last tile of y is never stored."""
    M, N = x.shape[0], w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    n_done = ((N - 1) // BLOCK_N) * BLOCK_N
    y[:, :n_done] = linear(x, w[:n_done])
    return y


def skinny_gemm_drops_k_tail(x, w):
    """A K loop over whole 64-wide tiles only: the K % 64 tail is never multiplied (right at every
    model dim the configs have, all multiples of 64; wrong off the tile)."""
    k = x.shape[1] // 64 * 64 or x.shape[1]
    return linear(x[:, :k].contiguous(), w[:, :k].contiguous())


def skinny_gemm_partial_column_block_zero(x, w):
    """Column blocks of 64 with the last partial block masked off entirely (a bound test against the
    block's start instead of each column): its columns come back zero."""
    N = w.shape[0]
    n_done = N // 64 * 64 or N
    y = linear(x, w)
    y[:, n_done:] = 0
    return y


def skinny_gemm_fp16_accum(x, w):
    """HMMA with an fp16 accumulator: every K-step of 8 products is added into a half-precision sum."""
    acc = torch.zeros((x.shape[0], w.shape[0]), dtype=torch.float16)
    for k0 in range(0, x.shape[1], 8):
        part = x[:, k0:k0 + 8].float() @ w[:, k0:k0 + 8].float().T
        acc = (acc.float() + part).half()
    return acc.to(x.dtype)


def skinny_gemm_pow2_batch_only(x, w):
    """Variant table tuned for M in {1, 2, 4, 8, 16, 32, 64}; other M run the largest power-of-two
    variant below M and its M-tile wraps: row r >= P reads x row r % P."""
    M = x.shape[0]
    P = 1 << (M.bit_length() - 1)
    rows = torch.arange(M) % P
    return linear(x[rows], w)


def skinny_gemm_nan_to_num(x, w):
    """An epilogue that "sanitises" its accumulator (NaN to 0, infinities to the largest finite value):
    a NaN or infinite activation no longer shows in y."""
    return torch.nan_to_num(linear(x, w), nan=0.0)


def skinny_gemm_fp16_safety_clamp(x, w):
    """An epilogue clamp kept from an fp16 build (T5's clamp_value, finfo(fp16).max - 1000) on every
    dtype: right wherever |y| < 64504, wrong on bf16 / fp32 outputs past it (the range_edges dist's
    huge rows; no other dist reaches such outputs)."""
    return linear(x, w).clamp(-FP16_SAFETY_CLAMP, FP16_SAFETY_CLAMP)


def skinny_gemm_m24_bucket_drops_k_chunk(x, w):
    """A 24-row M bucket (M = 18..24, between the 16- and 32-row tiles) whose K loop stops one 16-wide
    chunk early: every row wrong, but only at M = 18..24 (the batch sweep's M = 24; before it, only a
    draw that happened to land there)."""
    if 18 <= x.shape[0] <= 24 and x.shape[1] > 16:
        k = x.shape[1] - 16
        return linear(x[:, :k], w[:, :k])
    return linear(x, w)


def skinny_gemm_fp32_out(x, w):
    """Epilogue forgets the cast: returns the fp32 accumulator."""
    return x.float() @ w.float().T


class _KernelOutput(torch.Tensor):
    """A tensor subclass a wrapper might return (e.g. to carry launch metadata)."""


def skinny_gemm_subclass(x, w):
    """Returns the result wrapped in a torch.Tensor subclass."""
    return linear(x, w).as_subclass(_KernelOutput)


def skinny_gemm_assumes_contiguous(x, w):
    """Loads w through a raw pointer with row stride K (ignores w.stride()): wrong on padded rows."""
    N, K = w.shape
    w_flat = w.as_strided((N, K), (K, 1), w.storage_offset())
    return linear(x, w_flat)


def skinny_gemm_rounds_x_base_down(x, w):
    """Builds its x operand (a TMA descriptor, a 16-byte vector-load base) from x's address rounded
    down to 16 bytes: right wherever x starts aligned, every row shifted on a view such as x[1:]."""
    back = (x.data_ptr() % 16) // x.element_size()
    return linear(x.as_strided(x.shape, x.stride(), x.storage_offset() - back), w)


_PREPACKED = TensorKeyed()


def skinny_gemm_stale_weight_cache(x, w):
    """Prepacks each weight tensor once (a converted fp32 copy, keyed by the tensor object, as a
    module caching its parameters would) and reuses it on every later call: weights updated in place
    (a reload, an RL weight sync) are never seen."""
    packed = _PREPACKED.get(w)
    if packed is None:
        packed = w.float().clone()
        _PREPACKED.put(w, packed)
    return (x.float() @ packed.T).to(x.dtype)


_OUTPUT_BUFFERS: dict[tuple, torch.Tensor] = {}


def skinny_gemm_static_output(x, w):
    """Preallocates y once per (shape, dtype, device) (no allocation per call, capture-friendly) and
    returns that same tensor from every call: the caller's previous result changes under it."""
    key = (x.shape[0], w.shape[0], x.dtype, x.device)
    y = _OUTPUT_BUFFERS.get(key)
    if y is None:
        y = _OUTPUT_BUFFERS[key] = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    y.copy_(linear(x, w))
    return y


def skinny_gemm_leaves_tf32_on(x, w):
    """A wrapper that turns on TF32 matmuls for its own speed and never turns them off: its bf16
    result is right, but every later fp32 matmul in the process (the reference's own runs, whose error
    the tolerances are measured against) runs with 10-bit mantissas."""
    torch.backends.cuda.matmul.allow_tf32 = True
    return linear(x, w)


def skinny_gemm_m32_tile_row_offset(x, w):
    """A 32-row M tile for M in 17..32 whose last warp (tile rows 24..31) reads x 8 rows back: wrong
    only at M = 25..32 (caught by the batch sweep's M = 31 / 32; a random draw of a few M can miss it)."""
    M = x.shape[0]
    if 25 <= M <= 32:
        rows = torch.arange(M)
        rows[24:] -= 8
        return linear(x[rows], w)
    return linear(x, w)


def skinny_gemm_m64_drops_k_chunk(x, w):
    """A full-tile fast path for the largest decode batch (M = 64) that drops its last 32-wide K chunk."""
    if x.shape[0] == 64:
        K = x.shape[1]
        return linear(x[:, :K - 32].contiguous(), w[:, :K - 32].contiguous())
    return linear(x, w)


def skinny_gemm_negates_small_outputs(x, w):
    """Outputs below one unit roundoff of their row's largest come back with the wrong sign (an
    epilogue that keeps one exponent per row). The row rule (~2 ulps of the row maximum for every
    element) admitted it; the element rule does not."""
    y = linear(x, w).float()
    small = y.abs() < y.abs().amax(-1, keepdim=True) * torch.finfo(x.dtype).eps / 2     # the unit roundoff
    return torch.where(small, -y, y).to(x.dtype)


def skinny_gemm_leaves_mkldnn_bf16_on(x, w):
    """Turns oneDNN's fp32 matmuls to bf16 through the per-backend precision API and leaves it on (every
    later fp32 matmul on an AMX CPU runs in bf16; the legacy precision getter raises from then on)."""
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    return linear(x, w)


def skinny_gemm_calls_sys_exit(x, w):
    """Calls sys.exit(5) (a C extension's abort path turned into SystemExit)."""
    import sys
    sys.exit(5)


def skinny_gemm_reseeds_rng(x, w):
    """Calls torch.manual_seed(0) (a tiling heuristic seeded for reproducibility): the serving process's
    every later sample repeats; the output is correct."""
    torch.manual_seed(0)
    return linear(x, w)


def skinny_gemm_draws_python_random(x, w):
    """Picks a split-K factor with random.choice among equally correct ones: the output is the same,
    the process's python random stream has moved."""
    import random
    random.choice([1, 2, 4])
    return linear(x, w)


def skinny_gemm_leaves_anomaly_mode_on(x, w):
    """Turns autograd's anomaly detection on (a debugging leftover) and leaves it on."""
    torch.set_anomaly_enabled(True)
    return linear(x, w)


_LAGGING: list[torch.Tensor] = []


def skinny_gemm_lagging_input_write(x, w):
    """Scales x in place on a stream nobody waits for: the write lands after the call has returned (here
    during the next call, deterministically), in the caller's input, once the checks at return are done."""
    while _LAGGING:
        prev = _LAGGING.pop()
        if prev.data_ptr() != x.data_ptr():       # (a write into this call's own x would be overwritten)
            prev[..., 0] = 0
    _LAGGING.append(x)
    return linear(x, w)


def skinny_gemm_serving_path_drops_k_tail(x, w):
    """Dispatches on autograd: with grad enabled the plain GEMM, under no_grad / inference_mode (how a
    serving engine calls it) a "fused" path whose K loop drops the last 16 columns."""
    if torch.is_grad_enabled():
        return linear(x, w)
    k = max(x.shape[1] - 16, 0)
    return linear(x[:, :k].contiguous(), w[:, :k].contiguous())


def skinny_gemm_misaligned_output(x, w):
    """Right values in a workspace slice one element in: contiguous, but its base is 2 (or 4) bytes past
    a 16-byte boundary, where the next fused kernel's vector loads or TMA fault or refuse."""
    y = linear(x, w)
    buf = torch.empty(y.numel() + 1, dtype=y.dtype, device=y.device)
    return buf[1:].view(y.shape).copy_(y)


def skinny_gemm_zero_lead_is_zero_row(x, w):
    """A "sparse row" fast path that tests one element: a row whose first x is exactly 0 is output as 0."""
    y = linear(x, w)
    return torch.where((x[:, :1] == 0), torch.zeros_like(y), y)


_CALLS = [0]


def skinny_gemm_second_call_drops_k_tail(x, w):
    """A plan cached after the first call that drops the last 16-wide K chunk: every later call is wrong."""
    _CALLS[0] += 1
    if _CALLS[0] % 2 == 0:
        k = x.shape[1] - 16
        return linear(x[:, :k].contiguous(), w[:, :k].contiguous())
    return linear(x, w)
