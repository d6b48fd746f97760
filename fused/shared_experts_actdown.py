"""shared_experts in two launches: the gate_up GEMM, then SiTU-and-mul inside the down GEMV's loads.

fused.shared_experts runs three launches: h = wd(x @ w_gate_up.T), a = wd(situ_and_mul(h)) into a
scratch, y = wd(a @ w_down.T). Where the down GEMM is skinny_gemm's SIMT GEMV (its dispatcher's pick
at B <= 8 for every K3 per-rank shape), the middle launch folds into the GEMV: the GEMV's thread that
loads a 16-byte chunk of a (8 of I) instead loads the matching chunks of h's gate and up halves and
computes those 8 activations there, with SituMul's arithmetic, rounded to wd as the scratch would
hold them. The GEMV's own device code (skinny_gemm.SkinnyGemm.device_body) runs unchanged on them,
so the result is the three launches' bits.

Every CTA of the GEMV computes the activations of every chunk it reads (the whole of a, for its
columns): I / 8 chunks of 8 per row, a few exp / tanh per element against the w_down bytes it streams.

The two launches run at one token only (TWO_LAUNCH_MAX_B). Above it every CTA's recomputation is B
times larger and dominates: on the H100 at K3 per-rank shapes, B = 8 took 70.8 us in two launches
against 20.7 in three at T = 8, and 1123 against 108 at T = 1; at B = 1 it was 13.8 against 12.5 at
T = 8 (a launch saved in the layer step, where the shared experts run on a side stream).
Elsewhere (B > TWO_LAUNCH_MAX_B, a tensor-core down pick, an intermediate that is not a multiple of 8)
the call is fused.shared_experts's three launches. The side stream and the join are fused.shared_experts's
(`start` forks, launches here, and returns its Pending).

The candidate: `--candidate fused.shared_experts_actdown:shared_experts`; its variants are
fused.shared_experts's (each pair of GEMM variants; a pair with a SIMT down runs in two launches).
"""
import torch

from fused import runtime
from fused import shared_experts as se
from fused import skinny_gemm as sg

DTYPES = se.DTYPES
VEC = se.VEC
variants = se.variants
TWO_LAUNCH_MAX_B = 1        # tokens up to which the activation folds into the down GEMV


class _ActChunk:
    """One 16-byte chunk of a = wd(situ_and_mul(h)) for the GEMV's `gX[None, (row, kv)].load()`."""

    def __init__(self, acts: "_Acts", row, kv):
        self.acts, self.row, self.kv = acts, row, kv

    def load(self):
        _, cute = runtime.cutlass_modules()
        from cutlass import Float32
        a = self.acts
        g = a.gH[None, (self.row, self.kv)].load().to(Float32)
        u = a.gH[None, (self.row, a.chunks + self.kv)].load().to(Float32)
        res = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
        for e in range(VEC):        # unrolled at trace time (plain Python here); SituMul's arithmetic, in its order
            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g[e]))
            act = a.beta * cute.math.tanh(g[e] / a.beta) * sig
            up = a.lbeta * cute.math.tanh(u[e] / a.lbeta)
            res[e] = act * up
        return res.load().to(a.gH.element_type)             # the scratch's rounding to wd


class _Acts:
    """Stands in for the GEMV's chunked x operand gX (x[m, 8 kv : 8 kv + 8] at gX[None, (m, kv)]):
    each chunk computed from h's gate and up halves when the GEMV loads it."""

    def __init__(self, gH, chunks: int, beta, lbeta):
        self.gH, self.chunks, self.beta, self.lbeta = gH, chunks, beta, lbeta

    def __getitem__(self, index):
        _, (row, kv) = index
        return _ActChunk(self, row, kv)


class ActDown:
    """y[B, D] = a @ w_down.T with a = wd(situ_and_mul(h)) computed in the loads: h [B, 2I], w_down
    [D, I], the SIMT GEMV `cfg` of (N = D, K = I)."""

    def __init__(self, D: int, inter: int, cfg: sg.SkinnyGemmConfig):
        if inter % VEC:
            raise ValueError(f"w_down: intermediate {inter} must be a multiple of {VEC} (16-byte loads)")
        self.gemm = sg.SkinnyGemm(D, inter, cfg)
        self.chunks = inter // VEC

    def jit_host(self):
        _, cute = runtime.cutlass_modules()
        from cutlass import Float32
        g = self.gemm
        body = g.device_body()
        chunks = self.chunks

        @cute.kernel
        def kernel(gH: cute.Tensor, gW: cute.Tensor, mY: cute.Tensor, beta: Float32, lbeta: Float32):
            body(_Acts(gH, chunks, beta, lbeta), gW, mY)

        @cute.jit
        def host(mH: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, beta: Float32, lbeta: Float32, stream):
            gH = cute.zipped_divide(mH, (1, VEC))
            gW = cute.zipped_divide(mW, (1, VEC))
            m_tiles = (mH.shape[0] + g.mt - 1) // g.mt
            kernel(gH, gW, mY, beta, lbeta).launch(grid=[m_tiles, g.N // g.nt, 1], block=[g.threads, 1, 1],
                                                   stream=stream)

        return host


@runtime.compile_cache("shared_experts_actdown")
def _compile(dtype: str, D: int, inter: int, cfg: sg.SkinnyGemmConfig):
    from cutlass import Float32
    b = runtime.sym_int()
    return runtime.compile_tvm_ffi(ActDown(D, inter, cfg).jit_host(), runtime.fake_tensor(dtype, (b, 2 * inter)),
                                   runtime.fake_tensor(dtype, (D, inter)), runtime.fake_tensor(dtype, (b, D)),
                                   Float32(4.0), Float32(25.0))


def two_launch_pick(B: int, D: int, inter: int, variant: se.SharedExpertsConfig | None = None):
    """(gate_up, down) configs where the call runs in two launches (B <= TWO_LAUNCH_MAX_B, a SIMT down
    GEMV, I a multiple of 8), else None."""
    if B > TWO_LAUNCH_MAX_B:
        return None
    pick_gu, pick_d = se.picks(B, D, inter)
    if variant is not None:
        pick_gu, pick_d = variant.gate_up or pick_gu, variant.down or pick_d
    if inter % VEC or not isinstance(pick_d, sg.SkinnyGemmConfig):
        return None
    return pick_gu, pick_d


def launch(x, w_gate_up, w_down, situ_beta: float, situ_linear_beta: float, out,
           variant: se.SharedExpertsConfig | None = None) -> None:
    """The launches on the current stream: two where two_launch_pick says so, else shared_experts's three."""
    B, D = x.shape
    inter = w_down.shape[1]
    pair = two_launch_pick(B, D, inter, variant) if B else None
    if pair is None:
        se.launch(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out, variant)
        return
    h = torch.empty(B, 2 * inter, dtype=x.dtype, device=x.device)
    sg.launch(x, w_gate_up, h, pair[0])
    dst = runtime.aligned(out)
    _compile(runtime.dtype_name(x.dtype), D, inter, pair[1])(h, runtime.aligned(w_down), dst, float(situ_beta),
                                                             float(situ_linear_beta))
    runtime.write_back(dst, out)


def start(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
          variant: se.SharedExpertsConfig | None = None, stream: torch.cuda.Stream | None = None) -> se.Pending:
    """fused.shared_experts.start with these launches: on a side stream (`stream`, else shared_experts's)
    after the caller's queued work; the Pending's wait() joins them back before out is used."""
    se._check(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    side = stream if stream is not None else se.side_stream(x.device)
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    se._fork(side)
    if not torch.cuda.is_current_stream_capturing():
        for t in (x, w_gate_up, w_down, out):       # the allocator keeps them until the side work is done
            t.record_stream(side)
    with torch.cuda.stream(side):
        launch(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out, variant)
        done = torch.cuda.Event()
        done.record(side)
    return se.Pending(out, done)


def shared_experts(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
                   variant: se.SharedExpertsConfig | None = None, stream: torch.cuda.Stream | None = None):
    """Fused replacement of references.moe.shared_experts (same signature) -> y [B, D], joined to the
    caller's stream."""
    return start(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out=out, variant=variant,
                 stream=stream).wait()
