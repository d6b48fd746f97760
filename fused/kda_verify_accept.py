"""The accept half of fused/kda_verify.py's rollback: `references.kda_spec.kda_accept` in one launch.

Commits each sequence's state after its accepted tokens, in place: where accepted[b] = a > 0,
state[b] and conv_state[b] become bitwise copies of state_ckpt[b, a-1] and conv_ckpt[b, a-1]; where
a = 0 they are not touched. A copy kernel rather than the reference's torch ops because those move
about 3.5x the bytes (a gather of one slot per sequence whatever a is, a select against the committed
state, the copy back: 7 state-sized passes against 2) and this copy is the whole cost of the accept.

Layout: accepted [B] int32 or int64 (n_tokens only for the host check); conv_state [B, 3, C, W-1] wd,
state [B, H, Dh, Dh] fp32, conv_ckpt [B, n_q, 3, C, W-1], state_ckpt [B, n_q, H, Dh, Dh], all
contiguous. One compile per (dtype, Dh, W, count dtype); batch, heads and n_q dynamic.
Launch: one CTA of 128 threads per (head, sequence), grid (H, B); a = clamp(accepted[b], 0, n_q) read
on the device; the head's state copied in 16-byte vectors, its 3 x Dh conv windows element-wise.
"""
from __future__ import annotations

import torch

from fused import runtime
from references.kda_spec import COUNT_DTYPES, check_accept_counts
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Int32, const_expr  # noqa: E402

THREADS = 128


class KdaAccept:
    """Compile-time config: working dtype, Dh, W, count dtype."""

    def __init__(self, dtype, Dh: int, W: int, count_dtype):
        self.dtype, self.Dh, self.W, self.count_dtype = dtype, Dh, W, count_dtype

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mConvS: cute.Tensor, mState: cute.Tensor, mConvCk: cute.Tensor,
                 mStateCk: cute.Tensor, stream):
        self.kernel(mAcc, mConvS, mState, mConvCk, mStateCk).launch(
            grid=[mState.shape[1], mState.shape[0], 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mConvS: cute.Tensor, mState: cute.Tensor, mConvCk: cute.Tensor,
               mStateCk: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        Dh, W = self.Dh, self.W
        a = mAcc[b]
        a = Int32(cutlass.min(cutlass.max(a, self.count_dtype(0)), self.count_dtype(mStateCk.shape[1])))
        if a > 0:
            src = cute.zipped_divide(mStateCk[b, a - 1, h, None, None], (1, 4))   # ((1, 4), (Dh, Dh/4))
            dst = cute.zipped_divide(mState[b, h, None, None], (1, 4))
            n_vec = Dh * Dh // 4
            for k in cutlass.range_constexpr(0, n_vec, THREADS):
                idx = k + tidx
                if const_expr(n_vec % THREADS == 0) or idx < n_vec:
                    row, col = idx // (Dh // 4), idx % (Dh // 4)
                    dst[None, (row, col)].store(src[None, (row, col)].load())
            n_conv = 3 * Dh * (W - 1)
            for k in cutlass.range_constexpr(0, n_conv, THREADS):
                idx = k + tidx
                if idx < n_conv:
                    i, rem = idx // (Dh * (W - 1)), idx % (Dh * (W - 1))
                    ch = h * Dh + rem // (W - 1)
                    mConvS[b, i, ch, rem % (W - 1)] = mConvCk[b, a - 1, i, ch, rem % (W - 1)]


@runtime.compile_cache("kda_verify_accept")
def _compile(dtype: str, Dh: int, W: int, count_dtype: str):
    """Compile against fake tensors: batch, heads and draft slots dynamic."""
    op = KdaAccept(runtime.cutlass_dtype(dtype), Dh, W, runtime.cutlass_dtype(count_dtype))
    b, h, q, c = runtime.sym_int(), runtime.sym_int(), runtime.sym_int(), runtime.sym_int(Dh)
    return runtime.compile_tvm_ffi(
        op, runtime.fake_tensor(count_dtype, (b,), align=4), runtime.fake_tensor(dtype, (b, 3, c, W - 1), align=2),
        runtime.fake_tensor("float32", (b, h, Dh, Dh), align=16),
        runtime.fake_tensor(dtype, (b, q, 3, c, W - 1), align=2),
        runtime.fake_tensor("float32", (b, q, h, Dh, Dh), align=16))


def _check(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt) -> None:
    check_tensor("accepted", accepted, ndim=1, dtypes=COUNT_DTYPES)
    B = accepted.shape[0]
    check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("state", state, ndim=4, dtypes=(torch.float32,))
    _, H, Dh, _ = state.shape
    check_tensor("state", state, shape=(B, H, Dh, Dh))
    check_tensor("conv_state", conv_state, ndim=4, dtypes=(torch.bfloat16, torch.float16))
    W = conv_state.shape[-1] + 1
    check_tensor("conv_state", conv_state, shape=(B, 3, H * Dh, W - 1))
    check_tensor("state_ckpt", state_ckpt, shape=(B, None, H, Dh, Dh), dtypes=(state.dtype,))
    n_q = state_ckpt.shape[1]
    check_tensor("conv_ckpt", conv_ckpt, shape=(B, n_q) + tuple(conv_state.shape[1:]), dtypes=(conv_state.dtype,))
    if Dh not in (16, 32, 64, 128) or W < 2:
        raise ValueError(f"state: head_dim {Dh} / conv_state: width {W}; the kernel takes Dh in 16, 32, 64, 128, W >= 2")
    for name, t in (("conv_state", conv_state), ("state", state), ("conv_ckpt", conv_ckpt), ("state_ckpt", state_ckpt)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: the accept copies whole rows, so it must be contiguous; got strides {t.stride()}")


def launch(accepted, conv_state, state, conv_ckpt, state_ckpt) -> None:
    """Destination-passing launch on the current stream: updates conv_state and state in place."""
    if state.shape[0] == 0 or state.shape[1] == 0:
        return
    Dh, W = state.shape[-1], conv_state.shape[-1] + 1
    fn = _compile(runtime.dtype_name(conv_state.dtype), Dh, W, runtime.dtype_name(accepted.dtype))
    st = runtime.aligned(state)
    fn(accepted, conv_state, st, conv_ckpt, runtime.aligned(state_ckpt))
    runtime.write_back(st, state)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("kda_accept", mutates_args=("conv_state", "state"))
        def kda_accept_out(accepted: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                           conv_ckpt: torch.Tensor, state_ckpt: torch.Tensor) -> None:
            launch(accepted, conv_state, state, conv_ckpt, state_ckpt)

        _op = kda_accept_out
    return _op


def capturing() -> bool:
    """The current CUDA stream is being captured into a graph: no tensor value can be read on the host
    (False where torch has no CUDA, whose capture query raises)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def kda_accept(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt, validate: bool = True) -> None:
    """Fused replacement of references.kda_spec.kda_accept (same signature; conv_state, state in place).
    validate=True checks 0 <= accepted <= n_tokens on the host as the reference does (one sync),
    except under CUDA graph capture; validate=False reads nothing on the host. The kernel clamps each
    count to 0..n_q."""
    _check(accepted, n_tokens, conv_state, state, conv_ckpt, state_ckpt)
    if validate and not capturing():
        check_accept_counts(accepted, n_tokens)
    runtime.require_cuda("state", state)
    for name, t in (("accepted", accepted), ("conv_state", conv_state), ("conv_ckpt", conv_ckpt),
                    ("state_ckpt", state_ckpt)):
        if t.device != state.device:
            raise ValueError(f"{name}: on {t.device}, state on {state.device}; every tensor on one device")
    _custom_op()(accepted, conv_state, state, conv_ckpt, state_ckpt)
