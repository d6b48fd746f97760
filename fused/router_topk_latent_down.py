"""router_topk and the MoE's latent-down GEMV over the same h in one launch at B = 1.

After forking the shared experts, the layer's MoE reads its input h twice: router_topk (one launch at
one token, fused.router_topk_onelaunch) and skinny_gemm's latent-down GEMV z = h @ w_latent_down.T
(one launch). Both are skinny_gemm SIMT GEMVs of 128 threads over the same h and neither reads the
other's output. Here they share one grid [1, max(n_r, n_l), 2]:

- z = 0 is router_topk_onelaunch's grid: its CTAs are blocks y < n_r, each running the logits GEMV's
  device code and drawing a ticket from the router's counter; the last of the n_r runs the top-k and
  puts the counter back to 0 (that module's kernel, its arithmetic unchanged);
- z = 1 is the latent-down GEMV's grid: blocks y < n_l run skinny_gemm.SkinnyGemm's device code of
  (L, D) (it reads its column block from block y, as in its own launch);
- a CTA past its half's count returns at once.

So ids, weights and z are the bits of the two launches (router_topk_onelaunch's and skinny_gemm's SIMT
pick at one token). Elsewhere (B > 1, a latent-down pick that is not the one-row SIMT GEMV, h's width
not the weights') the call is the two ops' own launches.

The logits workspace and the ticket counter are router_topk_onelaunch's (per device, stream and E):
launches on one stream run in order and each leaves the counter at zero.
"""
import torch

from fused import grid_sync
from fused import router_topk_onelaunch as rto
from fused import runtime
from fused import skinny_gemm as sg
from fused.router_topk_select import make_select

DTYPES = rto.DTYPES
SELECTS = rto.SELECTS

latent_config = grid_sync.one_row_gemv     # the latent down's pick where it shares the router's launch, else None


class RouterTopkLatentDown:
    def __init__(self, dtype: str, E: int, L: int, D: int, top_k: int, select: str):
        self.router = rto.RouterTopkOneLaunch(dtype, E, D, top_k, select)
        self.latent = sg.SkinnyGemm(L, D, sg.simt_config(1, L, D))
        if self.latent.threads != self.router.gemm.threads:
            raise ValueError(f"the GEMVs run {self.router.gemm.threads} and {self.latent.threads} threads")
        self.n_r = E // self.router.gemm.nt
        self.n_l = L // self.latent.nt

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        r = self.router
        router_body, latent_body, draw = r.gemm.device_body(), self.latent.device_body(), grid_sync.make_draw()
        select = make_select(r.E, r.k, 1, 1, 4, r.select_kind)
        n_r, n_l, vec = self.n_r, self.n_l, r.gemm.vec

        @cute.kernel
        def kernel(gX: cute.Tensor, gWr: cute.Tensor, mLogitY: cute.Tensor, mLogit: cute.Tensor,
                   mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mCnt: cute.Tensor,
                   gWl: cute.Tensor, mZ: cute.Tensor, routed_scale: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            _, by, bz = cute.arch.block_idx()
            if bz == 0:
                if by < n_r:                           # router_topk_onelaunch's CTA `by`
                    router_body(gX, gWr, mLogitY)
                    ticket = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(1),
                                                                             byte_alignment=16)
                    draw(mCnt, ticket)
                    if ticket[0] == Int32(n_r - 1):    # every other router CTA's logits are visible
                        cute.arch.fence_acq_rel_gpu()
                        select(mLogit, mBias, mIds, mW, routed_scale, Int32(0))
                        if tidx == 0:
                            mCnt[0] = Int32(0)
            else:
                if by < n_l:                           # the latent-down GEMV's CTA `by`
                    latent_body(gX, gWl, mZ)

        @cute.jit
        def host(mX: cute.Tensor, mWr: cute.Tensor, mLogitY: cute.Tensor, mLogit: cute.Tensor,
                 mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mCnt: cute.Tensor, mWl: cute.Tensor,
                 mZ: cute.Tensor, routed_scale: Float32, stream):
            gX = cute.zipped_divide(mX, (1, vec))
            gWr = cute.zipped_divide(mWr, (1, vec))
            gWl = cute.zipped_divide(mWl, (1, vec))
            kernel(gX, gWr, mLogitY, mLogit, mBias, mIds, mW, mCnt, gWl, mZ, routed_scale).launch(
                grid=[1, max(n_r, n_l), 2], block=[r.gemm.threads, 1, 1], stream=stream)

        return host


@runtime.compile_cache("router_topk_latent_down")
def _compile(dtype: str, E: int, L: int, D: int, top_k: int, select: str):
    cutlass, _ = runtime.cutlass_modules()
    return runtime.compile_tvm_ffi(
        RouterTopkLatentDown(dtype, E, L, D, top_k, select).jit_host(),
        runtime.fake_tensor(dtype, (1, D)),
        runtime.fake_tensor(dtype, (E, D)),
        runtime.fake_tensor("float32", (1, E), align=4),
        runtime.fake_tensor("float32", (1, 1, E), align=4),
        runtime.fake_tensor("float32", (E,), align=4),
        runtime.fake_tensor("int64", (1, top_k), align=8),
        runtime.fake_tensor("float32", (1, top_k), align=4),
        runtime.fake_tensor("int32", (1,), align=4),
        runtime.fake_tensor(dtype, (L, D)),
        runtime.fake_tensor(dtype, (1, L), align=2),
        cutlass.Float32(1.0))


def launch(h, w_router, bias, top_k: int, routed_scale: float, w_latent_down, ids, weights, z,
           select: str = "threshold") -> None:
    """The one launch for one token: writes ids, weights and z."""
    B, D = h.shape
    E, L = w_router.shape[0], w_latent_down.shape[0]
    if B != 1:
        raise ValueError(f"h: {B} tokens; the shared router and latent-down launch takes 1")
    h, w_router, w_latent_down = (runtime.aligned(t.contiguous()) for t in (h, w_router, w_latent_down))
    logits, counter = rto.buffers(h.device, E)
    fn = _compile(runtime.dtype_name(h.dtype), E, L, D, top_k, select)
    fn(h, w_router, logits[0, :1], logits[:, :1], bias.contiguous(), ids, weights, counter, w_latent_down, z,
       float(routed_scale))


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("router_topk_latent_down", mutates_args=("ids", "weights", "z"))
        def router_topk_latent_down_out(h: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, top_k: int,
                                   routed_scale: float, w_latent_down: torch.Tensor, ids: torch.Tensor,
                                   weights: torch.Tensor, z: torch.Tensor) -> None:
            launch(h, w_router, bias, top_k, routed_scale, w_latent_down, ids, weights, z)

        _op = router_topk_latent_down_out
    return _op


def router_topk_latent_down(h, w_router, bias, top_k: int, routed_scale: float, w_latent_down, *, z_out=None,
                       select: str | None = None):
    """(ids int64 [B, k], weights fp32 [B, k], z [B, L] wd): references.moe.router_topk(h, w_router, bias,
    top_k, routed_scale) and references.gemm.skinny_gemm(h, w_latent_down), in one launch at one token
    where latent_config allows, else router_topk_onelaunch's and skinny_gemm's launches. z_out: z's
    tensor; select: the top-k kernel (router_topk_onelaunch's variants; None: its default)."""
    if w_latent_down.dim() != 2 or h.dim() != 2 or w_latent_down.shape[1] != h.shape[1]:
        raise ValueError(f"w_latent_down: {tuple(w_latent_down.shape)} does not take h {tuple(h.shape)} "
                         "(expected [L, K] with h's K)")
    if w_latent_down.dtype != h.dtype:
        raise TypeError(f"w_latent_down: dtype {w_latent_down.dtype}, h's is {h.dtype}")
    (B, D), L = h.shape, w_latent_down.shape[0]
    if select is not None and select not in SELECTS:
        raise ValueError(f"select: {select!r} is not one of {SELECTS}")
    if z_out is not None and (tuple(z_out.shape) != (B, L) or z_out.dtype != h.dtype or not z_out.is_contiguous()):
        raise ValueError(f"z_out: expected a contiguous {h.dtype} [{B}, {L}], got {z_out.dtype} "
                         f"{tuple(z_out.shape)} strides {z_out.stride()}")
    rto._check(h, w_router, bias, top_k)            # the device last
    z = z_out if z_out is not None else torch.empty(B, L, dtype=h.dtype, device=h.device)
    if latent_config(B, L, D) is None:
        variant = None if select is None else rto.variants({}, {})[SELECTS.index(select)]
        ids, weights = rto.router_topk(h, w_router, bias, top_k, routed_scale, variant=variant)
        return ids, weights, sg.skinny_gemm(h, w_latent_down, out=z)
    ids = torch.empty(B, top_k, dtype=torch.int64, device=h.device)
    weights = torch.empty(B, top_k, dtype=torch.float32, device=h.device)
    if select is not None:
        launch(h, w_router, bias, top_k, routed_scale, w_latent_down, ids, weights, z, select)
    else:
        _custom_op()(h, w_router, bias, top_k, float(routed_scale), w_latent_down, ids, weights, z)
    return ids, weights, z
