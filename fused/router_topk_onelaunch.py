"""router_topk in one launch at B = 1: the logits GEMV, then the top-k in the grid's last CTA.

fused.router_topk runs two launches: the logits GEMM, then a top-k kernel over the logits. At one
token the GEMM is skinny_gemm's SIMT GEMV (router_topk.SIMT_MAX) and the top-k is one CTA of 128
threads, the GEMV's own block size. Here both run in one grid:

- every CTA computes its columns of the fp32 logits with the GEMV's device code (skinny_gemm.SkinnyGemm:
  the same chunks, FMA chains and reduction order, so the same bits);
- each CTA then makes its logits visible at GPU scope (fence.acq_rel.gpu, a barrier) and takes a
  ticket from an int32 counter (atomic add, acq_rel, gpu scope);
- the CTA that draws the last ticket has seen every other CTA's release: it runs router_topk's
  top-k device code (fused/router_topk_select.py) for each token and puts the counter back to 0, so
  the next launch and every CUDA-graph replay start from zero.

So the ids and weights are router_topk's bits at B = 1 (its SIMT logits and the same select).
Above SIMT_MAX tokens, router_topk's logits come from a tensor-core GEMM whose CTAs differ from the
select's, and one CTA selecting every token serially would be slow: this form calls fused.router_topk
there (two launches).

The counter and the logits workspace are kept per (device, stream, E): launches on one stream run
in order; routers on two streams (the layer's side stream) never share a counter. A CUDA graph keeps
the buffers of its capture stream, so two replays of graphs captured on one stream must not overlap.

The candidate: `--candidate fused.router_topk_onelaunch:router_topk`; its variants are the top-k
kernels that run in 128 threads (the threshold select and the argmax rounds, 4 warps per token).
"""
import torch

from fused import router_topk as rt
from fused import runtime
from fused import skinny_gemm as sg
from fused.router_topk_select import make_select

DTYPES = rt.DTYPES
ONE_LAUNCH_MAX = rt.SIMT_MAX        # tokens up to which the one-launch kernel runs
SELECTS = ("threshold", "rounds")   # the top-k kernels of 128 threads (one token per CTA, 4 warps)


def variants(tensors: dict, params: dict) -> list:
    """The harness certifies both top-k kernels (at B <= ONE_LAUNCH_MAX inside the one launch;
    above, router_topk's two launches with that select)."""
    return [rt.RouterTopkConfig(1, None, 4, select=s) for s in SELECTS]


class RouterTopkOneLaunch:
    def __init__(self, dtype: str, E: int, D: int, top_k: int, select: str):
        if select not in SELECTS:
            raise ValueError(f"variant: select {select!r} is not one of {SELECTS}")
        self.gemm = sg.SkinnyGemm(E, D, sg.simt_config(1, E, D))
        if self.gemm.threads != 32 * 4:
            raise ValueError(f"the GEMV runs {self.gemm.threads} threads; the top-k of 4 warps needs 128")
        self.dtype, self.E, self.D, self.k, self.select_kind = dtype, E, D, top_k, select

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        g = self.gemm
        body = g.device_body()
        select = make_select(self.E, self.k, 1, 1, 4, self.select_kind)
        n_ctas = self.E // g.nt                       # one m-tile (M = 1), E / n_per_cta column blocks

        @cute.kernel
        def kernel(gX: cute.Tensor, gW: cute.Tensor, mY: cute.Tensor, mLogit: cute.Tensor, mBias: cute.Tensor,
                   mIds: cute.Tensor, mW: cute.Tensor, mCnt: cute.Tensor, routed_scale: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            body(gX, gW, mY)                          # this CTA's logits (threads < n_per_cta write them)
            ticket = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                ticket[0] = cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if ticket[0] == Int32(n_ctas - 1):        # every other CTA's logits are visible
                cute.arch.fence_acq_rel_gpu()
                for b in cutlass.range(0, mLogit.shape[1], 1, unroll=1):
                    select(mLogit, mBias, mIds, mW, routed_scale, b)
                    cute.arch.sync_threads()
                if tidx == 0:
                    mCnt[0] = Int32(0)

        @cute.jit
        def host(mX: cute.Tensor, mWg: cute.Tensor, mY: cute.Tensor, mLogit: cute.Tensor, mBias: cute.Tensor,
                 mIds: cute.Tensor, mW: cute.Tensor, mCnt: cute.Tensor, routed_scale: Float32, stream):
            gX = cute.zipped_divide(mX, (1, g.vec))
            gW = cute.zipped_divide(mWg, (1, g.vec))
            kernel(gX, gW, mY, mLogit, mBias, mIds, mW, mCnt, routed_scale).launch(
                grid=[1, n_ctas, 1], block=[g.threads, 1, 1], stream=stream)

        return host


@runtime.compile_cache("router_topk_onelaunch")
def _compile(dtype: str, E: int, D: int, top_k: int, select: str):
    cutlass, _ = runtime.cutlass_modules()
    b = runtime.sym_int()
    return runtime.compile_tvm_ffi(
        RouterTopkOneLaunch(dtype, E, D, top_k, select).jit_host(),
        runtime.fake_tensor(dtype, (b, D)),
        runtime.fake_tensor(dtype, (E, D)),
        runtime.fake_tensor("float32", (b, E), align=4),
        runtime.fake_tensor("float32", (1, b, E), align=4),
        runtime.fake_tensor("float32", (E,), align=4),
        runtime.fake_tensor("int64", (b, top_k), align=8),
        runtime.fake_tensor("float32", (b, top_k), align=4),
        runtime.fake_tensor("int32", (1,), align=4),
        cutlass.Float32(1.0))


_buffers: dict = {}


def buffers(device, E: int):
    """(logits [1, ONE_LAUNCH_MAX, E] fp32, counter [1] int32, zeroed once) for `device` and the current
    stream, made on first use and reused: the kernel leaves the counter at zero."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream, E)
    hit = _buffers.get(key)
    if hit is None:
        hit = (torch.empty(1, ONE_LAUNCH_MAX, E, dtype=torch.float32, device=device),
               torch.zeros(1, dtype=torch.int32, device=device))
        _buffers[key] = hit
    return hit


def launch(x, w_gate, bias, top_k: int, routed_scale: float, ids, weights, select: str = "threshold") -> None:
    """The one launch for B = x.shape[0] <= ONE_LAUNCH_MAX tokens; writes ids and weights."""
    B, D = x.shape
    E = w_gate.shape[0]
    if not 1 <= B <= ONE_LAUNCH_MAX:
        raise ValueError(f"x: {B} tokens; the one-launch router takes 1..{ONE_LAUNCH_MAX}")
    x, w_gate = runtime.aligned(x), runtime.aligned(w_gate)
    logits, counter = buffers(x.device, E)
    fn = _compile(runtime.dtype_name(x.dtype), E, D, top_k, select)
    fn(x, w_gate, logits[0, :B], logits[:, :B], bias, ids, weights, counter, float(routed_scale))


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("router_topk_onelaunch", mutates_args=("ids", "weights"))
        def router_topk_onelaunch_out(x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                                      routed_scale: float, ids: torch.Tensor, weights: torch.Tensor) -> None:
            launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale, ids, weights)

        _op = router_topk_onelaunch_out
    return _op


def _check(x, w_gate, bias, top_k) -> None:
    """fused.router_topk's argument checks (the same errors; the device last)."""
    E = w_gate.shape[0]
    if bias.dtype != torch.float32 or tuple(bias.shape) != (E,):
        raise TypeError(f"bias: expected float32 [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= min(32, E):
        raise ValueError(f"top_k: {top_k!r} must be an int in 1..{min(32, E)} for the fused kernel")
    sg._check(x, w_gate)


def router_topk(x, w_gate, bias, top_k: int, routed_scale: float, *, variant=None):
    """Fused replacement of references.moe.router_topk (same signature): (ids int64, weights fp32), in
    one launch at B <= ONE_LAUNCH_MAX, else fused.router_topk's two."""
    B = x.shape[0] if x.dim() == 2 else 0
    if not 1 <= B <= ONE_LAUNCH_MAX:
        return rt.router_topk(x, w_gate, bias, top_k, routed_scale, variant=variant)
    _check(x, w_gate, bias, top_k)
    if variant is not None and (variant.tokens_per_cta, variant.warps_per_token, variant.gemm) != (1, 4, None):
        raise ValueError(f"variant: {variant.name} is not a one-launch form (one token per CTA, 4 warps, "
                         "the SIMT logits)")
    ids = torch.empty(B, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(B, top_k, dtype=torch.float32, device=x.device)
    if variant is not None:
        launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale, ids, weights,
               variant.select)
    else:
        _custom_op()(x, w_gate, bias, top_k, float(routed_scale), ids, weights)
    return ids, weights
