"""kda_in_proj in one launch at B = 1: the merged GEMV, then the tail in the grid's last G CTAs.

fused.kda_in_proj runs two launches at one token: skinny_gemm's SIMT GEMV of the merged rows
(q | k | v | z | f_a | beta, N = 4C + r + H) into a wd scratch, then the tail kernel (G = C / 128
CTAs: q, k, v, z copied out, beta copied by the first, g_raw = wd(f_a @ w_fb.T), thread t of CTA w
owning channel 128 w + t). Every g_raw sum needs all r columns of f_a, which other CTAs of the GEMV
compute. Here both run in one grid of the GEMV's CTAs (128 threads, as the tail's):

- every CTA computes its columns of the merged row with the GEMV's device code (skinny_gemm.SkinnyGemm:
  the same chunks, FMA chains and reduction order, so the same bits);
- it then makes them visible at GPU scope (fence.acq_rel.gpu, a barrier) and takes a ticket from an
  int32 counter (atomic add, acq_rel, gpu scope);
- the CTAs that draw the last G tickets are the tail's G CTAs: tail CTA w = ticket - (n - G) waits
  until the counter reaches n (every CTA's columns visible; an atomic read, acquire, gpu scope, in a
  loop), then runs the tail kernel's work of its column block w: the same copies and the same fp32 sum
  over j = 0..r-1 in order per channel (the tail kernel's bits at one row);
- each tail CTA then takes a ticket from a second counter; the last one puts both back to 0, so the
  next launch and every CUDA-graph replay start from zero (the others have all seen n by then).

The waits cannot deadlock the grid: a tail CTA waits only after every CTA but at most G - 1 has taken
its ticket, so the CTAs it waits for are running or next to be scheduled, and G (12 at K3's T = 8, 6 at
T = 16) waiting CTAs leave the rest of the GPU's CTA slots to them.

So the six outputs are kda_in_proj's bits at B = 1 where its dispatcher picks the one SIMT GEMV of the
merged rows (every K3 per-rank shape at one token). Elsewhere (B > 1, a tensor-core or split plan)
this form calls fused.kda_in_proj (two or three launches).

The counters and the scratch row are kept per (device, stream, shape) (fused.grid_sync.kept).

The candidate: `--candidate fused.kda_in_proj_onelaunch:kda_in_proj`; its variants are kda_in_proj's
(at B = 1 the one-launch form stands for the SIMT plan with the one-row tail).
"""
import torch

from fused import grid_sync
from fused import kda_in_proj as kp
from fused import runtime
from fused import skinny_gemm as sg

DTYPES = kp.DTYPES
OUTPUTS = kp.OUTPUTS
THREADS = kp.THREADS


def one_launch_config(M: int, C: int, r: int, H: int, K: int) -> kp.KdaInProjConfig | None:
    """kda_in_proj's pick where this form runs it in one launch (the unsplit plan on the one-token GEMV
    of the merged rows, the one-row tail), else None."""
    cfg = kp.default_config(M, C, r, H, K)
    if cfg.split or cfg.gemm != grid_sync.one_row_gemv(M, 4 * C + r + H, K) or cfg.tail != kp.TailConfig(1):
        return None
    return cfg


class KdaInProjOneLaunch:
    """Compile-time config: dtype, C = H * Dh channels, f_rank r, H, the merged GEMV of K = D columns."""

    def __init__(self, dtype: str, C: int, r: int, H: int, D: int, gemm: sg.SkinnyGemmConfig):
        self.dtype = runtime.cutlass_dtype(dtype)
        self.C, self.r, self.H = C, r, H
        self.vec = 128 // self.dtype.width
        if r % self.vec or r == 0:
            raise ValueError(f"f_rank: {r} must be a positive multiple of {self.vec} (16-byte vectors)")
        self.N = 4 * C + r + H
        self.gemm = sg.SkinnyGemm(self.N, D, gemm)
        if self.gemm.threads != THREADS:
            raise ValueError(f"the GEMV runs {self.gemm.threads} threads; the tail needs {THREADS}")
        self.n_ctas = self.N // self.gemm.nt
        self.tail_ctas = -(-C // THREADS)
        if self.tail_ctas > self.n_ctas:
            raise ValueError(f"C={C}: {self.tail_ctas} tail CTAs, more than the GEMV's {self.n_ctas}")
        self.fa_iters = -(-r // THREADS)
        self.beta_iters = -(-H // THREADS)

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        g = self.gemm
        body, draw = g.device_body(), grid_sync.make_draw()
        C, r, H, vec, dt = self.C, self.r, self.H, self.vec, self.dtype
        n, G, fa0 = self.n_ctas, self.tail_ctas, 4 * self.C

        @cute.kernel
        def kernel(gX: cute.Tensor, gW: cute.Tensor, mM: cute.Tensor, mWfb: cute.Tensor, mQ: cute.Tensor,
                   mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mZ: cute.Tensor,
                   mCnt: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            body(gX, gW, mM)                          # this CTA's merged columns (row 0)
            smem = cutlass.memory.SmemAllocator()
            ticket = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
            fa = smem.allocate_tensor(Float32, cute.make_layout(r), byte_alignment=16)
            draw(mCnt, ticket)
            w = ticket[0] - Int32(n - G)
            if w >= Int32(0):                         # one of the tail's G CTAs: column block w
                if tidx == 0:
                    seen = ticket[0] + Int32(1)
                    while seen < Int32(n):
                        seen = cute.arch.atomic_add(mCnt.iterator, Int32(0), sem="acquire", scope="gpu")
                cute.arch.sync_threads()
                cute.arch.fence_acq_rel_gpu()
                for i in cutlass.range_constexpr(self.fa_iters):
                    j = tidx + i * THREADS
                    if j < r:
                        fa[j] = mM[0, fa0 + j].to(Float32)
                if w == Int32(0):
                    for i in cutlass.range_constexpr(self.beta_iters):
                        h = tidx + i * THREADS
                        if h < H:
                            mBeta[0, h] = mM[0, fa0 + r + h]
                c = w * THREADS + tidx
                if c < C:
                    mQ[0, c] = mM[0, c]
                    mK[0, c] = mM[0, C + c]
                    mV[0, c] = mM[0, 2 * C + c]
                    mZ[0, c] = mM[0, 3 * C + c]
                cute.arch.sync_threads()
                if c < C:
                    gWfb = cute.zipped_divide(mWfb, (1, vec))  # ((1, vec), (C, r / vec))
                    wv = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
                    acc = Float32(0.0)
                    for jv in cutlass.range_constexpr(r // vec):
                        wv.store(gWfb[None, (c, jv)].load().to(Float32))
                        for e in cutlass.range_constexpr(vec):
                            acc = acc + fa[jv * vec + e] * wv[e]
                    mG[0, c] = acc.to(dt)
                if tidx == 0:                         # the last tail CTA puts both counters back
                    done = cute.arch.atomic_add(mCnt.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
                    if done == Int32(G - 1):
                        mCnt[0] = Int32(0)
                        mCnt[1] = Int32(0)

        @cute.jit
        def host(mX: cute.Tensor, mWin: cute.Tensor, mM: cute.Tensor, mWfb: cute.Tensor, mQ: cute.Tensor,
                 mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mZ: cute.Tensor,
                 mCnt: cute.Tensor, stream):
            gX = cute.zipped_divide(mX, (1, g.vec))
            gW = cute.zipped_divide(mWin, (1, g.vec))
            kernel(gX, gW, mM, mWfb, mQ, mK, mV, mG, mBeta, mZ, mCnt).launch(
                grid=[1, n, 1], block=[THREADS, 1, 1], stream=stream)

        return host


@runtime.compile_cache("kda_in_proj_onelaunch")
def _compile(dtype: str, C: int, r: int, H: int, D: int, gemm: sg.SkinnyGemmConfig):
    op = KdaInProjOneLaunch(dtype, C, r, H, D, gemm)
    out = lambda cols: runtime.fake_tensor(dtype, (1, cols), align=2)   # element-wise stores: any out= view
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(dtype, (1, D)),
        runtime.fake_tensor(dtype, (op.N, D)),
        runtime.fake_tensor(dtype, (1, op.N), align=2),
        runtime.fake_tensor(dtype, (C, r)),
        out(C), out(C), out(C), out(C), out(H), out(C),
        runtime.fake_tensor("int32", (2,), align=4))


def buffers(device, dtype: torch.dtype, N: int):
    """(merged scratch [1, N] wd, counters [2] int32, zeroed once) kept for `device` and its current
    stream (grid_sync.kept): the kernel leaves the counters at zero."""
    return grid_sync.kept(device, ("kda_in_proj_onelaunch", dtype, N),
                          lambda: (torch.empty(1, N, dtype=dtype, device=device),
                                   torch.zeros(2, dtype=torch.int32, device=device)))


def launch(x, w_in, w_fb, q_raw, k_raw, v_raw, g_raw, beta_raw, z, cfg: kp.KdaInProjConfig) -> None:
    """The one launch for one token (cfg: one_launch_config's pick); writes the six outputs."""
    B, D = x.shape
    (C, r), H = w_fb.shape, beta_raw.shape[1]
    if B != 1:
        raise ValueError(f"x: {B} tokens; the one-launch in-projection takes 1")
    x, w_in = runtime.aligned(x.contiguous()), runtime.aligned(w_in.contiguous())
    merged, counters = buffers(x.device, x.dtype, 4 * C + r + H)
    fn = _compile(runtime.dtype_name(x.dtype), C, r, H, D, cfg.gemm)
    fn(x, w_in, merged, runtime.aligned(w_fb.contiguous()), q_raw, k_raw, v_raw, g_raw, beta_raw, z, counters)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("kda_in_proj_onelaunch", mutates_args=OUTPUTS)
        def kda_in_proj_onelaunch_out(x: torch.Tensor, w_in: torch.Tensor, w_fb: torch.Tensor,
                                      q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor,
                                      g_raw: torch.Tensor, beta_raw: torch.Tensor, z: torch.Tensor) -> None:
            (C, r), H = w_fb.shape, beta_raw.shape[1]
            launch(x, w_in, w_fb, q_raw, k_raw, v_raw, g_raw, beta_raw, z,
                   one_launch_config(1, C, r, H, x.shape[1]))

        _op = kda_in_proj_onelaunch_out
    return _op


def kda_in_proj(x, w_in, w_fb, n_heads: int, *, out=None, variant=None):
    """Fused replacement of references.kda.kda_in_proj (same signature): (q_raw, k_raw, v_raw, g_raw,
    beta_raw, z), in one launch at one token where one_launch_config allows, else fused.kda_in_proj's."""
    kp._check(x, w_in, w_fb, n_heads, out)
    (B, D), (C, r) = x.shape, w_fb.shape
    cfg = one_launch_config(B, C, r, n_heads, D)
    if cfg is None or (variant is not None and variant != cfg):
        return kp.kda_in_proj(x, w_in, w_fb, n_heads, out=out, variant=variant)
    if out is None:
        out = tuple(torch.empty(B, n_heads if name == "beta_raw" else C, dtype=x.dtype, device=x.device)
                    for name in OUTPUTS)
    if variant is not None:
        launch(x, w_in, w_fb, *out, cfg)
    else:
        _custom_op()(x, w_in, w_fb, *out)
    return tuple(out)


def variants(tensors: dict, params: dict) -> list[kp.KdaInProjConfig]:
    """kda_in_proj's variants; at one token the one-launch form is the SIMT plan with the one-row tail,
    and the four-row tail (a variant kda_in_proj certifies there) runs in its two launches."""
    return kp.variants(tensors, params)

