"""kda_in_proj: the merged KDA in-projection and the f_b gate projection in two launches (three at
batch sizes where skinny_gemm's dispatcher takes tensor cores for the q|k|v|z rows).

Launch 1: merged[B, N] = x[B, D] @ w_in[N, D].T, N = 4C + r + H (rows q | k | v | z | f_a | beta,
C = H * Dh), by the project's skinny GEMM (fused/skinny_gemm.py; its dispatcher picks the kernel by
M), fp32 accumulation rounded once to the working dtype wd into a scratch buffer, as
references.kda:kda_in_proj rounds it (f_a is rounded to wd there, before f_b). The merged row count is
no multiple of 64 at K3 (49376, 6284, 3206 at T = 1, 8, 16), which the wgmma GEMM needs, so where
skinny_gemm's dispatcher picks a wgmma variant for the 4C rows of q|k|v|z alone (from M = 3 at
T = 1 and 8: its WGMMA_DEFAULTS for 49152 and 6144 rows; past M ~ 16 the SIMT kernel is FMA-bound),
the GEMM is split: those rows by that variant into one scratch and the r + H rows of f_a|beta by
the SIMT kernel into another ("split" plan).
Last launch (this file's kernel): a grid of (C / 128 column blocks) x (B / rows row tiles), 128
threads. A CTA stages the wd f_a of its `rows` tokens in shared memory (fp32), then thread t owns
channel c = 128 * block + t: it copies q, k, v, z[row, c] from the scratch into the separate outputs
and computes g_raw[row, c] = wd(sum_j f_a[row, j] * w_fb[c, j]) over j = 0..r-1 in order, reading
w_fb's row c in 16-byte vectors once for all the CTA's rows. The CTAs of column block 0 also copy beta.
Every output element is one fixed-order fp32 sum of its own token's values (a GEMM's order depends on
(K, its variant) only), so the op is deterministic and batch invariant within a variant; the row tile
changes which CTA computes a row, never its bits. Scratch rows need not be 16-byte aligned (N = 6284
at T = 8), so the copies are element-wise, coalesced along c. One compile per (dtype, C, r, H, plan,
tail variant); the batch is dynamic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, const_expr  # noqa: E402

DTYPES = ("bfloat16", "float16")   # working dtypes of x and the weights (the harness draws only these)
_TORCH_DTYPES = (torch.bfloat16, torch.float16)
THREADS = 128                      # channels per CTA of the tail kernel
OUTPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")


@dataclass(frozen=True)
class TailConfig:
    """Token rows per CTA of the tail kernel (each w_fb vector serves that many rows)."""
    rows: int

    @property
    def name(self) -> str:
        return f"tail_r{self.rows}"

    @staticmethod
    def for_batch(B: int) -> "TailConfig":
        """One row per CTA for a single token (no idle rows), four otherwise (w_fb read B/4 times
        from L2, B/4 times the column blocks of CTAs to spread the f_b sums over)."""
        return TailConfig(1 if B <= 1 else 4)

    @staticmethod
    def all_configs() -> list["TailConfig"]:
        return [TailConfig(1), TailConfig(4)]


@dataclass(frozen=True)
class KdaInProjConfig:
    """A launch variant: the merged GEMM's skinny_gemm variant and the tail kernel's; with `fb_gemm`
    (the split plan) `gemm` runs on the q|k|v|z rows and `fb_gemm` on the f_a|beta rows."""
    gemm: sg.Config
    tail: TailConfig
    fb_gemm: sg.Config | None = None

    @property
    def split(self) -> bool:
        return self.fb_gemm is not None

    @property
    def name(self) -> str:
        fb = f"+{self.fb_gemm.name}" if self.split else ""
        return f"{self.gemm.name}{fb}+{self.tail.name}"


class KdaInProjTail:
    """Compile-time config: dtype, C = H * Dh channels, f_rank r (whole 16-byte vectors), H, the plan
    (split: q|k|v|z in one scratch [B, 4C], f_a|beta in another [B, r + H]; else both in the merged
    [B, 4C + r + H], handed in twice), rows."""

    def __init__(self, dtype, C: int, r: int, H: int, split: bool, config: TailConfig):
        self.dtype, self.C, self.r, self.H = dtype, C, r, H
        self.fa0 = 0 if split else 4 * C                   # f_a's first column in its scratch
        self.vec = 128 // dtype.width
        if r % self.vec or r == 0:
            raise ValueError(f"f_rank: {r} must be a positive multiple of {self.vec} (16-byte vectors)")
        self.rows = config.rows
        self.fa_iters = -(-self.rows * r // THREADS)       # f_a elements staged per thread
        self.beta_iters = -(-self.rows * H // THREADS)     # beta elements copied per thread (block 0)

    @cute.jit
    def __call__(self, mM: cute.Tensor, mF: cute.Tensor, mWfb: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor,
                 mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mZ: cute.Tensor, stream):
        row_tiles = (mM.shape[0] + self.rows - 1) // self.rows
        self.kernel(mM, mF, mWfb, mQ, mK, mV, mG, mBeta, mZ).launch(
            grid=[(self.C + THREADS - 1) // THREADS, row_tiles, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mM: cute.Tensor, mF: cute.Tensor, mWfb: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor,
               mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mZ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bc, bt, _ = cute.arch.block_idx()
        C, r, H, R, vec, dt, fa0 = self.C, self.r, self.H, self.rows, self.vec, self.dtype, self.fa0
        B = mM.shape[0]
        row0 = bt * R
        fa = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout((R, r), stride=(r, 1)), 16)
        for i in cutlass.range_constexpr(self.fa_iters):    # f_a of the tile's rows (clamped past B)
            idx = tidx + i * THREADS
            if idx < R * r:
                m = idx // r
                j = idx - m * r
                fa[m, j] = mF[cutlass.min(row0 + m, B - 1), fa0 + j].to(Float32)
        if bc == 0:
            for i in cutlass.range_constexpr(self.beta_iters):
                idx = tidx + i * THREADS
                m = idx // H
                if idx < R * H:
                    if row0 + m < B:
                        mBeta[row0 + m, idx - m * H] = mF[row0 + m, fa0 + r + idx - m * H]
        c = bc * THREADS + tidx
        if c < C:
            for m in cutlass.range_constexpr(R):
                row = row0 + m
                if row < B:
                    mQ[row, c] = mM[row, c]
                    mK[row, c] = mM[row, C + c]
                    mV[row, c] = mM[row, 2 * C + c]
                    mZ[row, c] = mM[row, 3 * C + c]
        cute.arch.sync_threads()
        if c < C:
            gW = cute.zipped_divide(mWfb, (1, vec))           # ((1, vec), (C, r / vec))
            acc = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            acc.fill(0.0)
            w = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
            for jv in cutlass.range_constexpr(r // vec):
                w.store(gW[None, (c, jv)].load().to(Float32))
                for m in cutlass.range_constexpr(R):
                    s = acc[m]
                    for e in cutlass.range_constexpr(vec):
                        s = s + fa[m, jv * vec + e] * w[e]
                    acc[m] = s
            for m in cutlass.range_constexpr(R):
                if const_expr(R == 1) or row0 + m < B:
                    mG[row0 + m, c] = acc[m].to(dt)


@runtime.compile_cache("kda_in_proj")
def _compile(dtype: str, C: int, r: int, H: int, split: bool, cfg: TailConfig):
    b = runtime.sym_int()
    op = KdaInProjTail(runtime.cutlass_dtype(dtype), C, r, H, split, cfg)
    out = lambda n: runtime.fake_tensor(dtype, (b, n), align=2)     # element-wise stores: any out= view
    src = (4 * C, r + H) if split else (4 * C + r + H,) * 2
    return runtime.compile_tvm_ffi(op, *(runtime.fake_tensor(dtype, (b, n)) for n in src),
                                   runtime.fake_tensor(dtype, (C, r)),
                                   out(C), out(C), out(C), out(C), out(H), out(C))


def _check(x, w_in, w_fb, n_heads, out):
    check_tensor("x", x, ndim=2, dtypes=_TORCH_DTYPES)
    B, D = x.shape
    check_tensor("w_fb", w_fb, ndim=2, dtypes=(x.dtype,))
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads <= 0:
        raise ValueError(f"n_heads: expected a positive int, got {n_heads!r}")
    C, r = w_fb.shape
    if C == 0 or C % n_heads:
        raise ValueError(f"w_fb: {C} rows (H*Dh) is not a positive multiple of n_heads={n_heads}")
    check_tensor("w_in", w_in, shape=(4 * C + r + n_heads, D), dtypes=(x.dtype,))
    vec = 16 // x.element_size()
    if r % vec or r == 0:
        raise ValueError(f"w_fb: f_rank {r} (its columns) must be a positive multiple of {vec} (16-byte vectors)")
    if D % vec or D == 0:
        raise ValueError(f"x: D={D} must be a positive multiple of {vec} (16-byte vectors)")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != len(OUTPUTS):
            raise ValueError(f"out: expected ({', '.join(OUTPUTS)}), got {type(out).__name__}")
        for name, t in zip(OUTPUTS, out):
            check_tensor(f"out {name}", t, shape=(B, n_heads if name == "beta_raw" else C), dtypes=(x.dtype,))
            if not t.is_contiguous():
                raise ValueError(f"out {name}: must be contiguous; got strides {t.stride()}")
    runtime.require_cuda("x", x)


def default_config(M: int, C: int, r: int, H: int, K: int) -> KdaInProjConfig:
    """The tail kernel's pick with skinny_gemm's pick for the merged rows, or, where that dispatcher
    takes a wgmma variant for the 4C rows of q|k|v|z at this M, the split plan: that variant for
    them and its pick for the r + H rows of f_a|beta."""
    tail = TailConfig.for_batch(M)
    qkvz = sg.default_config(M, 4 * C, K)
    if isinstance(qkvz, sg.SkinnyGemmWgmmaConfig):
        return KdaInProjConfig(qkvz, tail, sg.default_config(M, r + H, K))
    return KdaInProjConfig(sg.default_config(M, 4 * C + r + H, K), tail)


def all_configs(C: int, r: int, H: int, K: int) -> list[KdaInProjConfig]:
    """Every variant a launch at this shape may use, M = 1..64: each GEMM plan the dispatcher picks
    for some M, with each tail variant."""
    import dataclasses

    plans = dict.fromkeys(dataclasses.replace(default_config(M, C, r, H, K), tail=TailConfig(1))
                          for M in range(1, 65))
    return [dataclasses.replace(p, tail=t) for p in plans for t in TailConfig.all_configs()]


def launch(x, w_in, w_fb, q_raw, k_raw, v_raw, g_raw, beta_raw, z,
           variant: KdaInProjConfig | None = None) -> None:
    """Destination-passing launch on the current stream: the GEMM(s) into wd scratch, then the tail."""
    B, D = x.shape
    if B == 0:
        return
    (C, r), H = w_fb.shape, beta_raw.shape[1]
    cfg = variant or default_config(B, C, r, H, D)
    x, w_in = x.contiguous(), w_in.contiguous()
    if cfg.split:
        qkvz = torch.empty(B, 4 * C, dtype=x.dtype, device=x.device)
        fab = torch.empty(B, r + H, dtype=x.dtype, device=x.device)
        sg.launch(x, w_in[:4 * C], qkvz, cfg.gemm)
        sg.launch(x, w_in[4 * C:], fab, cfg.fb_gemm)
    else:
        qkvz = fab = torch.empty(B, 4 * C + r + H, dtype=x.dtype, device=x.device)
        sg.launch(x, w_in, qkvz, cfg.gemm)
    fn = _compile(runtime.dtype_name(x.dtype), C, r, H, cfg.split, cfg.tail)
    fn(qkvz, fab, runtime.aligned(w_fb.contiguous()), q_raw, k_raw, v_raw, g_raw, beta_raw, z)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("kda_in_proj", mutates_args=OUTPUTS)
        def kda_in_proj_out(x: torch.Tensor, w_in: torch.Tensor, w_fb: torch.Tensor, q_raw: torch.Tensor,
                            k_raw: torch.Tensor, v_raw: torch.Tensor, g_raw: torch.Tensor,
                            beta_raw: torch.Tensor, z: torch.Tensor) -> None:
            launch(x, w_in, w_fb, q_raw, k_raw, v_raw, g_raw, beta_raw, z)

        _op = kda_in_proj_out
    return _op


def kda_in_proj(x, w_in, w_fb, n_heads: int, *, out=None, variant=None):
    """Fused replacement of references.kda.kda_in_proj (same signature): returns (q_raw, k_raw, v_raw,
    g_raw, beta_raw, z), contiguous, written into `out` (those six, in that order) when given."""
    _check(x, w_in, w_fb, n_heads, out)
    if out is None:
        B, C = x.shape[0], w_fb.shape[0]
        out = tuple(torch.empty(B, n_heads if name == "beta_raw" else C, dtype=x.dtype, device=x.device)
                    for name in OUTPUTS)
    if variant is not None:
        launch(x, w_in, w_fb, *out, variant)
    else:
        _custom_op()(x, w_in, w_fb, *out)
    return tuple(out)


def variants(tensors: dict, params: dict) -> list[KdaInProjConfig]:
    """Every launch variant the harness must certify for these inputs: the GEMM plan the dispatcher
    picks at this M (the SIMT m-tiles share one summation order, so its pick stands for them) with
    each tail variant."""
    import dataclasses

    x, w_in, w_fb = tensors["x"], tensors["w_in"], tensors["w_fb"]
    (M, K), (C, r) = x.shape, w_fb.shape
    pick = default_config(M, C, r, w_in.shape[0] - 4 * C - r, K)
    return [dataclasses.replace(pick, tail=t) for t in TailConfig.all_configs()]
