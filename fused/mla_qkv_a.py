"""mla_qkv_a: the q_a / kv_a projection and the two latent RMSNorms in two launches.

Launch 1: qkv[B, N] = x[B, D] @ w_qkv_a[N, D].T, N = q_lora + kv_lora + rope, by the project's skinny
GEMM (fused/skinny_gemm.py; its dispatcher picks the kernel by M), fp32 accumulation rounded once to
the working dtype wd into a scratch buffer, as references.mla:mla_qkv_a rounds it.
Launch 2 (this file's kernel): one CTA per token row. Thread t owns the 16-byte vectors t, t + T, ...
of the row of N / vec vectors (q_lora, kv_lora and rope are whole vectors, so each vector lies in one
part). It loads them with their norm weights, stores the k_rot vectors back unchanged, and adds its
squares of the q part and of the kv part in fp32; a butterfly per warp and the warps' sums in warp
order give every thread the same two sums (a fixed order: deterministic, and a row depends on its
own values only, so batch invariant). Then KimiRMSNorm as references.primitives.rms_norm rounds it:
y = wd(x * rsqrt(sum / n + eps)), out = wd(y * w). One compile per (dtype, q_lora, kv_lora, rope,
norm variant); the batch is dynamic.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg
from references.primitives import check_tensor

cutlass, cute = runtime.cutlass_modules()           # pins sm_90a before the DSL latches an arch
from cutlass import Float32, const_expr  # noqa: E402

DTYPES = ("bfloat16", "float16")   # working dtypes of x and the weights (the harness draws only these)
_TORCH_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NormConfig:
    """Threads per CTA of the norm kernel (one CTA per row; the reduction order depends on it)."""
    num_threads: int

    @property
    def name(self) -> str:
        return f"norm_t{self.num_threads}"

    @staticmethod
    def for_shape(n_vec: int) -> "NormConfig":
        """One vector per thread up to 512 vectors (K3 bf16: 264 vectors, 288 threads): the whole row
        is in flight at once and the kernel is two reductions long."""
        return NormConfig(min(512, -(-n_vec // 32) * 32))

    @staticmethod
    def all_configs(n_vec: int) -> list["NormConfig"]:
        """The dispatcher's pick and a 128-thread CTA (several vectors per thread at K3)."""
        return sorted({NormConfig.for_shape(n_vec), NormConfig(128)}, key=lambda c: c.num_threads)


@dataclass(frozen=True)
class MlaQkvAConfig:
    """A launch variant: the GEMM's (a skinny_gemm variant) and the norm kernel's."""
    gemm: sg.Config
    norm: NormConfig

    @property
    def name(self) -> str:
        return f"{self.gemm.name}+{self.norm.name}"


class MlaLatentNorms:
    """Compile-time config: dtype, q_lora, kv_lora, rope (all whole 16-byte vectors), threads."""

    def __init__(self, dtype, q_lora: int, kv_lora: int, rope: int, config: NormConfig):
        self.dtype, self.q_lora, self.kv_lora = dtype, q_lora, kv_lora
        self.vec = 128 // dtype.width
        for name, n in (("q_lora", q_lora), ("kv_lora", kv_lora), ("rope", rope)):
            if n % self.vec or n == 0:
                raise ValueError(f"{name}: {n} must be a positive multiple of {self.vec} (16-byte vectors)")
        self.nq, self.nkv, self.nr = q_lora // self.vec, kv_lora // self.vec, rope // self.vec
        self.n_vec = self.nq + self.nkv + self.nr
        self.num_threads = config.num_threads
        self.num_warps = config.num_threads // 32
        self.vpt = -(-self.n_vec // self.num_threads)     # vectors per thread
        self.even = self.n_vec % self.num_threads == 0

    @cute.jit
    def __call__(self, mQKV: cute.Tensor, mWq: cute.Tensor, mWkv: cute.Tensor, mQ: cute.Tensor,
                 mKV: cute.Tensor, mRot: cute.Tensor, eps: Float32, stream):
        self.kernel(mQKV, mWq, mWkv, mQ, mKV, mRot, eps).launch(
            grid=[mQKV.shape[0], 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQKV: cute.Tensor, mWq: cute.Tensor, mWkv: cute.Tensor, mQ: cute.Tensor,
               mKV: cute.Tensor, mRot: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        vec, V, T, dt = self.vec, self.vpt, self.num_threads, self.dtype
        nq, nqkv = self.nq, self.nq + self.nkv
        rows = lambda t: cute.zipped_divide(t, (vec,))  # ((vec), n_vec)
        gX, gQ, gKV = rows(mQKV[row, None]), rows(mQ[row, None]), rows(mKV[row, None])
        gWq, gWkv = rows(mWq), rows(mWkv)
        red = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout((2, self.num_warps), stride=(self.num_warps, 1)), 16)

        x = cute.make_rmem_tensor((vec, V), dt)
        w = cute.make_rmem_tensor((vec, V), dt)
        x.fill(0.0)
        w.fill(0.0)
        for i in cutlass.range_constexpr(V):            # every load issued before the first use
            c = tidx + i * T
            if const_expr(self.even) or c < self.n_vec:
                x[None, i].store(gX[None, c].load())
                if c < nq:
                    w[None, i].store(gWq[None, c].load())
                elif c < nqkv:
                    w[None, i].store(gWkv[None, c - nq].load())
        # part[0] = this thread's sum of squares over q, part[1] over kv; the rope vectors go out raw
        part = cute.make_rmem_tensor(2, Float32)
        part.fill(0.0)
        for i in cutlass.range_constexpr(V):
            c = tidx + i * T
            v = x[None, i].load().to(Float32)
            s = (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if c < nq:
                part[0] += s
            elif c < nqkv:
                part[1] += s
            elif const_expr(self.even) or c < self.n_vec:
                rows(mRot[row, None])[None, c - nqkv].store(x[None, i].load())
        for k in cutlass.range_constexpr(2):
            t = cute.arch.warp_reduction(part[k], operator.add)
            if lane == 0:
                red[k, warp] = t
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr(2):
            t = red[k, 0]
            for j in cutlass.range_constexpr(1, self.num_warps):
                t = t + red[k, j]
            part[k] = t
        rstd_q = cute.math.rsqrt(part[0] / self.q_lora + eps)
        rstd_kv = cute.math.rsqrt(part[1] / self.kv_lora + eps)
        for i in cutlass.range_constexpr(V):
            c = tidx + i * T
            xv = x[None, i].load().to(Float32)
            if c < nq:
                y = (xv * rstd_q).to(dt).to(Float32)
                gQ[None, c].store((y * w[None, i].load().to(Float32)).to(dt))
            elif c < nqkv:
                y = (xv * rstd_kv).to(dt).to(Float32)
                gKV[None, c - nq].store((y * w[None, i].load().to(Float32)).to(dt))


@runtime.compile_cache("mla_qkv_a")
def _compile(dtype: str, q_lora: int, kv_lora: int, rope: int, cfg: NormConfig):
    b = runtime.sym_int()
    op = MlaLatentNorms(runtime.cutlass_dtype(dtype), q_lora, kv_lora, rope, cfg)
    t = lambda *shape: runtime.fake_tensor(dtype, shape)
    return runtime.compile_tvm_ffi(op, t(b, q_lora + kv_lora + rope), t(q_lora), t(kv_lora), t(b, q_lora),
                                   t(b, kv_lora), t(b, rope), Float32(1e-6))


def _check(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, out):
    check_tensor("x", x, ndim=2, dtypes=_TORCH_DTYPES)
    B, D = x.shape
    check_tensor("w_qkv_a", w_qkv_a, shape=(None, D), dtypes=(x.dtype,))
    check_tensor("q_a_norm_w", q_a_norm_w, ndim=1, dtypes=(x.dtype,))
    check_tensor("kv_a_norm_w", kv_a_norm_w, ndim=1, dtypes=(x.dtype,))
    q_lora, kv_lora = q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
    rope = w_qkv_a.shape[0] - q_lora - kv_lora
    if rope < 0:
        raise ValueError(f"w_qkv_a: {w_qkv_a.shape[0]} rows < q_lora {q_lora} + kv_lora {kv_lora}")
    vec = 16 // x.element_size()
    for name, n in (("q_a_norm_w", q_lora), ("kv_a_norm_w", kv_lora), ("w_qkv_a", rope), ("x", D)):
        if n % vec or n == 0:
            what = "rope rows (w_qkv_a rows - q_lora - kv_lora)" if name == "w_qkv_a" else "length"
            raise ValueError(f"{name}: {what} {n} must be a positive multiple of {vec} (16-byte vectors)")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps!r}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError(f"out: expected (q_c, kv_c, k_rot), got {type(out).__name__}")
        for name, t, n in zip(("q_c", "kv_c", "k_rot"), out, (q_lora, kv_lora, rope)):
            check_tensor(f"out {name}", t, shape=(B, n), dtypes=(x.dtype,))
            if not t.is_contiguous():
                raise ValueError(f"out {name}: must be contiguous; got strides {t.stride()}")
    runtime.require_cuda("x", x)


def default_config(M: int, N: int, K: int, n_vec: int) -> MlaQkvAConfig:
    """skinny_gemm's pick for this M and shape, and the norm kernel's pick."""
    return MlaQkvAConfig(sg.default_config(M, N, K), NormConfig.for_shape(n_vec))


def all_configs(N: int, K: int, n_vec: int) -> list[MlaQkvAConfig]:
    """Every variant a launch at this shape may use, M = 1..64: each GEMM the skinny_gemm dispatcher
    picks for some M, with each norm variant."""
    gemms = dict.fromkeys(sg.default_config(M, N, K) for M in range(1, 65))
    return [MlaQkvAConfig(g, n) for g in gemms for n in NormConfig.all_configs(n_vec)]


def launch(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, q_c, kv_c, k_rot, eps: float,
           variant: MlaQkvAConfig | None = None) -> None:
    """Destination-passing launch on the current stream: the GEMM into a wd scratch qkv, then the norms."""
    B, D = x.shape
    if B == 0:
        return
    N, q_lora, kv_lora = w_qkv_a.shape[0], q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
    vec = 16 // x.element_size()
    cfg = variant or default_config(B, N, D, N // vec)
    qkv = torch.empty(B, N, dtype=x.dtype, device=x.device)
    sg.launch(x.contiguous(), w_qkv_a.contiguous(), qkv, cfg.gemm)
    fn = _compile(runtime.dtype_name(x.dtype), q_lora, kv_lora, N - q_lora - kv_lora, cfg.norm)
    # 16-byte vectors: a misaligned weight or out= view goes through an aligned copy
    dst = [runtime.aligned(t) for t in (q_c, kv_c, k_rot)]
    fn(qkv, runtime.aligned(q_a_norm_w.contiguous()), runtime.aligned(kv_a_norm_w.contiguous()), *dst, eps)
    for copy, caller in zip(dst, (q_c, kv_c, k_rot)):
        runtime.write_back(copy, caller)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_qkv_a", mutates_args=("q_c", "kv_c", "k_rot"))
        def mla_qkv_a_out(x: torch.Tensor, w_qkv_a: torch.Tensor, q_a_norm_w: torch.Tensor,
                          kv_a_norm_w: torch.Tensor, q_c: torch.Tensor, kv_c: torch.Tensor,
                          k_rot: torch.Tensor, eps: float) -> None:
            launch(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, q_c, kv_c, k_rot, eps)

        _op = mla_qkv_a_out
    return _op


def mla_qkv_a(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps: float, *, out=None, variant=None):
    """Fused replacement of references.mla.mla_qkv_a (same signature): returns (q_c, kv_c, k_rot),
    written into `out` = (q_c, kv_c, k_rot) when given."""
    _check(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, eps, out)
    if out is None:
        B, q_lora, kv_lora = x.shape[0], q_a_norm_w.shape[0], kv_a_norm_w.shape[0]
        out = tuple(torch.empty(B, n, dtype=x.dtype, device=x.device)
                    for n in (q_lora, kv_lora, w_qkv_a.shape[0] - q_lora - kv_lora))
    q_c, kv_c, k_rot = out
    if variant is not None:
        launch(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, q_c, kv_c, k_rot, float(eps), variant)
    else:
        _custom_op()(x, w_qkv_a, q_a_norm_w, kv_a_norm_w, q_c, kv_c, k_rot, float(eps))
    return q_c, kv_c, k_rot


def variants(tensors: dict, params: dict) -> list[MlaQkvAConfig]:
    """Every launch variant the harness must certify for these inputs: the GEMM the skinny_gemm
    dispatcher picks at this M (the SIMT m-tiles share one summation order, so its pick stands for
    them) with each norm-kernel variant."""
    x, w = tensors["x"], tensors["w_qkv_a"]
    (M, K), N = x.shape, w.shape[0]
    n_vec = N // (16 // x.element_size())
    return [MlaQkvAConfig(sg.default_config(M, N, K), n) for n in NormConfig.all_configs(n_vec)]
