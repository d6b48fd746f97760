"""A wide LSE combine for fused/mla_decode_attn.py's split-KV partials: the same bits as
fused/mla_decode_attn_split.py's `Combine`, with the splits' loads in flight together.

`Combine` gives each (sequence, row) one warp that walks the 512 columns 32 at a time and, for each
32, all S splits in order: 16 x S dependent L2 round trips per warp, and at B = 1 only R warps (12 at
T = 8) on the whole GPU. At S = 132 (128k slots, one CTA per SM) that is most of the op's time.

`CombineWide` gives each (sequence, row) a CTA of 32 * WARPS threads. Every warp computes the row's
lse with Combine's own code (a lane-strided max and sum over the splits, then the warp reductions),
so every warp holds Combine's lse bits. Thread t then owns columns t, t + T, .. (T = the CTA's
threads) and walks the splits in order once, for each split loading its weight's lse and its COLS
columns: the loads of one split are independent, and the split loop is unrolled, so several splits'
loads are in flight while each column's sum keeps Combine's order (o = o + exp(lse_s - lse) * o_s,
s = 0 .. S-1, in fp32) and is rounded once. An all -inf row gives NaN and lse = -inf, as Combine.

Not yet the op's combine: it becomes that once the GPU test (property_tests/
test_fused_mla_decode_attn_combine.py) has shown it bitwise equal to Combine and faster, since switching
fused/mla_decode_attn.py re-certifies mla_decode_attn.
"""
import math
import operator

from fused import runtime

cutlass, cute = runtime.cutlass_modules()
from cutlass import Float32  # noqa: E402

UNROLL = 4          # splits whose loads are issued before their sums


class CombineWide:
    """o[b, row] = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s; one CTA per (b, row)."""

    def __init__(self, D: int, warps: int = 4):
        self.D, self.WARPS = D, warps
        self.T = 32 * warps
        self.COLS = -(-D // self.T)           # columns per thread

    @cute.jit
    def __call__(self, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, stream):
        n = mPO.shape[0] * mPO.shape[2]
        self.kernel(mPO, mPL, mO, mLse).launch(grid=[n, 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPO: cute.Tensor, mPL: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        i, _, _ = cute.arch.block_idx()
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        S, R = mPO.shape[1], mPO.shape[2]
        b, row = i // R, i % R
        # the row's lse, in every warp, exactly as Combine computes it
        m = Float32(-math.inf)
        for s in cutlass.range(lane, S, 32):
            m = cute.arch.fmax(m, mPL[b, s, row])
        m = cute.arch.warp_reduction(m, cute.arch.fmax)
        m_use = m
        if m == -math.inf:
            m_use = Float32(0.0)
        tot = Float32(0.0)
        for s in cutlass.range(lane, S, 32):
            tot = tot + cute.math.exp(mPL[b, s, row] - m_use)
        tot = cute.arch.warp_reduction(tot, operator.add)
        lse = Float32(-math.inf)
        if tot > 0.0:
            lse = m_use + cute.math.log(tot)
        # columns tid, tid + T, ..: each column's sum over the splits in order
        acc = cute.make_rmem_tensor(self.COLS, Float32)
        for k in cutlass.range_constexpr(self.COLS):
            acc[k] = Float32(0.0)
        for s in cutlass.range(S, unroll=UNROLL):
            w = cute.math.exp(mPL[b, s, row] - lse)
            for k in cutlass.range_constexpr(self.COLS):
                d = tid + k * self.T
                if d < self.D:
                    # every split -inf: exp(-inf + inf) = NaN, softmax's answer for a row with no mass
                    acc[k] = acc[k] + w * mPO[b, s, row, d]
        for k in cutlass.range_constexpr(self.COLS):
            d = tid + k * self.T
            if d < self.D:
                mO[b, row, d] = acc[k].to(mO.element_type)
        if tid == 0:
            mLse[b, row] = lse


@runtime.compile_cache("mla_decode_attn_combine")
def _compile(dtype: str, D: int, warps: int = 4):
    """The wide combine for partials [b, s, R, D] fp32 and lse [b, s, R] -> o [b, R, D] wd, lse [b, R]."""
    b, s, R = runtime.sym_int(), runtime.sym_int(), runtime.sym_int()
    return runtime.compile_tvm_ffi(
        CombineWide(D, warps), runtime.fake_tensor("float32", (b, s, R, D), align=4),
        runtime.fake_tensor("float32", (b, s, R), align=4), runtime.fake_tensor(dtype, (b, R, D), align=2),
        runtime.fake_tensor("float32", (b, R), align=4))


def combine(po, pl, o, lse, warps: int = 4) -> None:
    """Destination-passing launch on the current stream: po [B, S, R, D] fp32, pl [B, S, R] fp32 ->
    o [B, R, D] (wd) and lse [B, R] fp32."""
    if po.shape[0] * po.shape[2] == 0:
        return
    _compile(runtime.dtype_name(o.dtype), po.shape[3], warps)(po, pl, o, lse)
