"""mla_q_absorb: q = wd(q_c @ w_q_b.T) viewed [B, H, Dh + rope]; ql[b, h] = wd(q[b, h, :Dh] @ w_uk[h]);
q_abs[B, H, kv_lora + rope] = [ql, q[..., Dh:]]. bf16/fp16 in and out, fp32 accumulation, the reference's
two roundings (references/mla.py mla_q_absorb).

Two launches on the caller's stream:
1. the q_b GEMM by fused/skinny_gemm.py (`launch`, its dispatcher picks the kernel by B) into a wd
   scratch [B, H * (Dh + rope)]: the one rounding of q;
2. the absorption kernel here. A CTA owns one head h, `n_vec` 16-byte column vectors (8 columns each)
   of kv_lora and `m_tile` tokens. Its threads are `groups` x `n_vec`: thread (g, v) reads rows
   d in [g * Dh / groups, (g + 1) * Dh / groups) of w_uk[h] at column vector v (16-byte loads, a warp
   reads whole row segments) and applies each weight vector to all m_tile tokens, whose q_nope rows
   sit in shared memory as fp32. Each thread sums its rows in increasing d, the groups' partials are
   added in group order through shared memory, rounded once to wd and stored as 16-byte vectors.
   The order depends on (Dh, groups) only, never on B, m_tile or a token's position: deterministic and
   batch invariant. The CTAs of column block 0 also copy q_rot (bitwise) into q_abs[..., kv_lora:].
   Grid (token tiles, H, kv_lora / (8 n_vec)), token tiles fastest so the tiles sharing one weight
   slice run together and read it through L2.

B is dynamic: one compile per (dtype, H, Dh, rope, kv_lora, absorb config); `variants()` lists every
absorb config with the GEMM the dispatcher picks at that B.
"""

import math
from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg

DTYPES = ("bfloat16", "float16")   # working dtypes (the harness draws only these)
VEC = 8                            # elements per 16-byte vector of a 2-byte dtype
THREADS = 128                      # groups x n_vec of every shipped config


@dataclass(frozen=True)
class AbsorbConfig:
    """Absorption launch: tokens per CTA, 16-byte column vectors per CTA, Dh groups (sum order)."""
    m_tile: int
    n_vec: int
    groups: int

    @property
    def name(self) -> str:
        return f"absorb_m{self.m_tile}_c{VEC * self.n_vec}_g{self.groups}"


@dataclass(frozen=True)
class MlaQAbsorbConfig:
    """A launch variant: the absorption config and the GEMM variant (None: skinny_gemm's dispatcher)."""
    absorb: AbsorbConfig
    gemm: sg.Config | None = None

    @property
    def name(self) -> str:
        return self.absorb.name + ("" if self.gemm is None else f"+{getattr(self.gemm, 'name', self.gemm)}")


M_TILES = (1, 2, 4, 8)
# 128 columns x 8 groups (16 rows each), or 64 columns x 16 groups (8 rows each: twice the CTAs for
# the few heads of a T = 8 or 16 rank)
SHAPES = ((16, 8), (8, 16))


def all_configs() -> list[AbsorbConfig]:
    return [AbsorbConfig(m, nv, g) for m in M_TILES for nv, g in SHAPES]


def fit(cfg: AbsorbConfig, Dh: int, kv_lora: int) -> AbsorbConfig:
    """The config clipped to a small shape: at most kv_lora / 8 column vectors and Dh groups."""
    nv = min(cfg.n_vec, kv_lora // VEC)
    while (kv_lora // VEC) % nv:
        nv -= 1
    g = min(cfg.groups, Dh)
    while Dh % g:
        g -= 1
    return AbsorbConfig(cfg.m_tile, nv, g)


def default_absorb(B: int, H: int) -> AbsorbConfig:
    """m_tile: B's power of two up to 8 (one weight read per 8 tokens); 64-column CTAs when the 128-column
    grid would not fill the 132 SMs (H <= 32: T >= 3)."""
    m = 1 << max(0, math.ceil(math.log2(max(B, 1)))) if B <= 8 else 8
    nv, g = SHAPES[0] if H * 4 >= 132 else SHAPES[1]
    return AbsorbConfig(m, nv, g)


class MlaAbsorb:
    def __init__(self, H: int, Dh: int, rope: int, kv_lora: int, cfg: AbsorbConfig):
        self.H, self.Dh, self.rope, self.kv = H, Dh, rope, kv_lora
        self.mt, self.nv, self.g = cfg.m_tile, cfg.n_vec, cfg.groups
        self.threads = self.nv * self.g
        self.rows = Dh // self.g                       # w_uk rows per thread
        self.col_blocks = kv_lora // (VEC * self.nv)
        self.qw, self.ow = (Dh + rope) // VEC, (kv_lora + rope) // VEC   # vectors per head of q, q_abs

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()

        @cute.jit
        def host(mQ: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, stream):
            gQ = cute.zipped_divide(mQ, (1, VEC))
            gW = cute.zipped_divide(mW, (1, VEC))
            gO = cute.zipped_divide(mO, (1, VEC))
            m_tiles = (mQ.shape[0] + self.mt - 1) // self.mt
            kernel(gQ, gW, gO, mQ.shape[0]).launch(grid=[m_tiles, self.H, self.col_blocks],
                                                   block=[self.threads, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32, const_expr

        mt, nv, G, R, T, Dh = self.mt, self.nv, self.g, self.rows, self.threads, self.Dh
        qw, ow, dv, rv, kvv = self.qw, self.ow, self.Dh // VEC, self.rope // VEC, self.kv // VEC

        @cute.kernel
        def kernel(gQ: cute.Tensor, gW: cute.Tensor, gO: cute.Tensor, B: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bm, h, bn = cute.arch.block_idx()
            g = tidx // nv
            v = tidx - g * nv
            b0 = bm * mt
            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(Float32, cute.make_layout((mt, Dh), stride=(Dh, 1)), 16)
            # red[g, m, e * nv + v]: group g's partial of token m, column 8 v + e (a warp's stores and
            # loads hit consecutive words)
            red = smem.allocate_tensor(Float32, cute.make_layout((G, mt, nv * VEC),
                                                                 stride=(mt * nv * VEC, nv * VEC, 1)), 16)
            xr = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            # the tile's q_nope rows as fp32 (rows past B clamped to B - 1: computed, never stored)
            for i in cutlass.range_constexpr(-(-(mt * dv) // T)):
                idx = tidx + i * T
                if const_expr((mt * dv) % T == 0) or idx < mt * dv:
                    m = idx // dv
                    c = idx - m * dv
                    row = cutlass.min(b0 + m, B - 1)
                    xr.store(gQ[None, (row, h * qw + c)].load().to(Float32))
                    for e in cutlass.range_constexpr(VEC):
                        sQ[m, c * VEC + e] = xr[e]
            # issue the thread's weight loads before the barrier: they do not depend on q
            wr = cute.make_rmem_tensor(cute.make_layout((VEC, R)), gW.element_type)
            for r in cutlass.range_constexpr(R):
                wr[None, r].store(gW[None, (h * Dh + g * R + r, bn * nv + v)].load())
            cute.arch.sync_threads()
            acc = cute.make_rmem_tensor(cute.make_layout((VEC, mt)), Float32)
            acc.fill(0.0)
            wf = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for r in cutlass.range_constexpr(R):
                wf.store(wr[None, r].load().to(Float32))
                for m in cutlass.range_constexpr(mt):
                    q = sQ[m, g * R + r]
                    for e in cutlass.range_constexpr(VEC):
                        acc[e, m] = acc[e, m] + q * wf[e]
            for m in cutlass.range_constexpr(mt):
                for e in cutlass.range_constexpr(VEC):
                    red[g, m, e * nv + v] = acc[e, m]
            cute.arch.sync_threads()
            out = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for i in cutlass.range_constexpr(-(-(mt * nv) // T)):
                idx = tidx + i * T
                if const_expr((mt * nv) % T == 0) or idx < mt * nv:
                    m = idx // nv
                    c = idx - m * nv
                    for e in cutlass.range_constexpr(VEC):
                        s = red[0, m, e * nv + c]
                        for j in cutlass.range_constexpr(1, G):
                            s = s + red[j, m, e * nv + c]
                        out[e] = s
                    if b0 + m < B:
                        gO[None, (b0 + m, h * ow + bn * nv + c)].store(out.load().to(gO.element_type))
            if const_expr(rv > 0):
                if bn == 0:
                    for i in cutlass.range_constexpr(-(-(mt * rv) // T)):
                        idx = tidx + i * T
                        if const_expr((mt * rv) % T == 0) or idx < mt * rv:
                            m = idx // rv
                            c = idx - m * rv
                            if b0 + m < B:
                                gO[None, (b0 + m, h * ow + kvv + c)].store(gQ[None, (b0 + m, h * qw + dv + c)].load())

        return kernel


@runtime.compile_cache("mla_q_absorb")
def _compile(dtype: str, H: int, Dh: int, rope: int, kv_lora: int, cfg: AbsorbConfig):
    b = runtime.sym_int()
    op = MlaAbsorb(H, Dh, rope, kv_lora, fit(cfg, Dh, kv_lora))
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(dtype, (b, H * (Dh + rope))),
        runtime.fake_tensor(dtype, (H * Dh, kv_lora)),
        runtime.fake_tensor(dtype, (b, H * (kv_lora + rope))))


def _check(q_c, w_q_b, w_uk, out):
    if q_c.dim() != 2 or w_q_b.dim() != 2 or w_uk.dim() != 3:
        raise ValueError(f"q_c, w_q_b, w_uk: expected 2-D, 2-D, 3-D tensors, got q_c{tuple(q_c.shape)} "
                         f"w_q_b{tuple(w_q_b.shape)} w_uk{tuple(w_uk.shape)}")
    if q_c.dtype not in (torch.bfloat16, torch.float16) or w_q_b.dtype != q_c.dtype or w_uk.dtype != q_c.dtype:
        raise TypeError(f"q_c: dtype {q_c.dtype} / w_q_b: {w_q_b.dtype} / w_uk: {w_uk.dtype}; the kernel takes "
                        "bf16 or fp16, all alike (use the reference for fp32)")
    H, Dh, kv_lora = w_uk.shape
    if w_q_b.shape[1] != q_c.shape[1]:
        raise ValueError(f"w_q_b: q_lora={w_q_b.shape[1]} does not match q_c's {q_c.shape[1]}")
    if w_q_b.shape[0] % H or w_q_b.shape[0] // H < Dh:
        raise ValueError(f"w_q_b: {w_q_b.shape[0]} rows is not n_heads {H} x (head_dim {Dh} + rope)")
    rope = w_q_b.shape[0] // H - Dh
    for name, n in (("q_lora", q_c.shape[1]), ("head_dim", Dh), ("rope", rope), ("kv_lora", kv_lora)):
        if n % VEC:
            raise ValueError(f"{name}={n} must be a multiple of {VEC} (16-byte vectors)")
    if out is not None and (tuple(out.shape) != (q_c.shape[0], H, kv_lora + rope) or out.dtype != q_c.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {q_c.dtype} [{q_c.shape[0]}, {H}, {kv_lora + rope}], "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    runtime.require_cuda("q_c", q_c)


def launch(q_c, w_q_b, w_uk, out, variant: MlaQAbsorbConfig | None = None) -> None:
    """q_abs into `out` [B, H, kv_lora + rope] on the current stream: the q_b GEMM into a wd scratch,
    then the absorption kernel."""
    B = q_c.shape[0]
    if B == 0:
        return
    H, Dh, kv_lora = w_uk.shape
    rope = w_q_b.shape[0] // H - Dh
    cfg = variant or MlaQAbsorbConfig(default_absorb(B, H))
    q = torch.empty(B, w_q_b.shape[0], dtype=q_c.dtype, device=q_c.device)
    sg.launch(q_c, w_q_b, q, cfg.gemm)
    fn = _compile(runtime.dtype_name(q_c.dtype), H, Dh, rope, kv_lora, cfg.absorb)
    w, dst = runtime.aligned(w_uk.reshape(H * Dh, kv_lora)), runtime.aligned(out)
    fn(q, w, dst.view(B, -1))
    runtime.write_back(dst, out)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mla_q_absorb", mutates_args=("out",))
        def mla_q_absorb_out(q_c: torch.Tensor, w_q_b: torch.Tensor, w_uk: torch.Tensor, out: torch.Tensor) -> None:
            launch(q_c.contiguous(), w_q_b.contiguous(), w_uk.contiguous(), out)

        _op = mla_q_absorb_out
    return _op


def mla_q_absorb(q_c, w_q_b, w_uk, *, out=None, variant: MlaQAbsorbConfig | None = None):
    """Fused replacement of references.mla.mla_q_absorb (same signature; `out=` a destination)."""
    _check(q_c, w_q_b, w_uk, out)
    if out is None:
        H, Dh, kv_lora = w_uk.shape
        out = torch.empty(q_c.shape[0], H, kv_lora + w_q_b.shape[0] // H - Dh, dtype=q_c.dtype, device=q_c.device)
    if variant is not None:
        launch(q_c.contiguous(), w_q_b.contiguous(), w_uk.contiguous(), out, variant)
    else:
        _custom_op()(q_c, w_q_b, w_uk, out)
    return out


def variants(tensors: dict, params: dict) -> list[MlaQAbsorbConfig]:
    """Every absorption config, each with the GEMM variant skinny_gemm's dispatcher picks at this B
    (the only one a launch at this B runs)."""
    B, q_lora = tensors["q_c"].shape
    N = tensors["w_q_b"].shape[0]
    gemm = sg.default_config(B, N, q_lora)
    return [MlaQAbsorbConfig(a, gemm) for a in all_configs()]
