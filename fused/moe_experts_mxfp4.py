"""moe_experts_mxfp4: routed experts with MXFP4 weights, y[b] = wd( sum_j weights[b,j] * E_ids[b,j](z[b]) ).

E_e(z) = w2_e( SiTU-and-mul( w13_e z ) ), as references.moe.moe_experts_mxfp4: every GEMV accumulates
in fp32 and is rounded once to wd (bf16/fp16), SiTU-and-mul in fp32 rounded to wd, the weighted
combine in fp32 over the slots in order, rounded once. The MXFP4 weights are dequantised in registers
inside the GEMMs (fused/moe_experts_mxfp4_gemv.py), never written out. Four launches on the caller's
stream, compiled into one function:

1. route (one CTA): the distinct experts of ids[B, k] (id -1 = padding, skipped; so is any id outside
   0..E-1, which the device does not report), each with the list of its (token, slot) pairs: a
   shared-memory histogram over the E experts, the first pair of each
   expert (atomic min) names it active. Active slots and list positions come from shared-memory
   atomics, so their order varies from run to run; nothing computed depends on it (each pair's
   arithmetic is the same wherever it sits), so results are deterministic.
2. gate_up: per active expert (grid y) and 16 intermediate rows (grid x), the gate and up rows of
   w13 against the expert's tokens (8 x nb per pass), SiTU-and-mul, a[pair, I] in wd. Tokens sharing
   an expert share the one weight read.
3. down: per active expert and 16 x nfrag latent rows, w2 against a of its pairs, o[pair, L] in wd.
4. combine: y[b, l] = sum over the real slots j in order of weights[b, j] * o[b*k + j, l] in fp32,
   rounded to wd; a token whose slots are all padding gets zeros.
Grids are sized for min(E, B*k) active experts; the CTAs past the route's count exit at once.
Scratch (route lists, a, o: B*k x (I + L) wd) is allocated per call by torch (the caching allocator;
a CUDA graph's pool when captured).
"""

from dataclasses import dataclass

import torch

from fused import runtime
from fused.moe_experts_mxfp4_gemv import ExpertGemv

DTYPES = ("bfloat16", "float16")   # working dtypes of z (the harness draws only these)
ROUTE_THREADS = 512
COMBINE_THREADS = 128


def valid_id(e, E: int):
    """Inside a kernel: 0 <= e < E, one unsigned compare (a Python `and` of two DSL predicates
    compiled to the first predicate alone)."""
    from cutlass import Uint32
    return Uint32(e) < Uint32(E)


@dataclass(frozen=True)
class MoeExpertsConfig:
    nb: int = 1                # n = 8 token atoms per pass (8 * nb tokens of one expert at once)
    warps: int = 4             # split-K warps per CTA (fixes the reduction order with K)
    down_frag: int = 2         # 16-row atoms of w2 per CTA
    unroll: int = 2            # k-steps loaded before their MMAs

    @property
    def name(self) -> str:
        return f"mma_n{8 * self.nb}_w{self.warps}_d{16 * self.down_frag}_u{self.unroll}"


DEFAULT = MoeExpertsConfig()


def all_configs() -> list[MoeExpertsConfig]:
    return [DEFAULT, MoeExpertsConfig(unroll=4), MoeExpertsConfig(nb=2),
            MoeExpertsConfig(warps=2, down_frag=4, unroll=4)]


def supports(cfg: MoeExpertsConfig, L: int, inter: int) -> bool:
    return L % (16 * cfg.down_frag) == 0 and inter % 16 == 0 and L % 32 == 0 and inter % 32 == 0


def variants(tensors: dict, params: dict) -> list[MoeExpertsConfig]:
    """Every launch variant the harness certifies for these shapes."""
    L = tensors["z"].shape[1]
    inter = tensors["w2_packed"].shape[2] * 2
    return [c for c in all_configs() if supports(c, L, inter)]


class MoeExperts:
    def __init__(self, wd: str, ids_dtype: str, E: int, L: int, inter: int, k: int, cfg: MoeExpertsConfig):
        if not supports(cfg, L, inter):
            raise ValueError(f"variant: {cfg.name} needs L % {16 * cfg.down_frag} == 0 and I % 32 == 0, "
                             f"got L={L}, I={inter}")
        self.wd, self.ids_dtype, self.E, self.L, self.I, self.k, self.cfg = wd, ids_dtype, E, L, inter, k, cfg
        self.gate_up = ExpertGemv(L, 2, inter, cfg.nb, cfg.warps, cfg.unroll)
        self.down = ExpertGemv(inter, cfg.down_frag, 16, cfg.nb, cfg.warps, cfg.unroll)

    # ------------------------------------------------------------------------------------ kernels
    def route_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32
        E, NT = self.E, ROUTE_THREADS

        @cute.kernel
        def kernel(mIds: cute.Tensor, mRoute: cute.Tensor):
            """mRoute = [n_active | expert[P] | start[P] | count[P] | members[P]]."""
            tidx, _, _ = cute.arch.thread_idx()
            P = mIds.shape[0]
            alloc = cutlass.memory.SmemAllocator()
            first = alloc.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
            cnt = alloc.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
            cur = alloc.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
            tot = alloc.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)
            for e in cutlass.range(tidx, E, NT):
                first[e] = P
                cnt[e] = 0
            if tidx == 0:
                tot[0] = 0
                tot[1] = 0
            cute.arch.sync_threads()
            for p in cutlass.range(tidx, P, NT):
                e = Int32(mIds[p])
                if valid_id(e, E):
                    cute.arch.atomic_min(first.iterator + e, Int32(p), scope="cta")
                    cute.arch.atomic_add(cnt.iterator + e, Int32(1), scope="cta")
            cute.arch.sync_threads()
            for p in cutlass.range(tidx, P, NT):
                e = Int32(mIds[p])
                if valid_id(e, E):
                    if first[e] == p:
                        n = cnt[e]
                        a = cute.arch.atomic_add(tot.iterator, Int32(1), scope="cta")
                        s = cute.arch.atomic_add(tot.iterator + 1, n, scope="cta")
                        mRoute[1 + a] = e
                        mRoute[1 + P + a] = s
                        mRoute[1 + 2 * P + a] = n
                        cur[e] = s
            cute.arch.sync_threads()
            for p in cutlass.range(tidx, P, NT):
                e = Int32(mIds[p])
                if valid_id(e, E):
                    pos = cute.arch.atomic_add(cur.iterator + e, Int32(1), scope="cta")
                    mRoute[1 + 3 * P + pos] = p
            if tidx == 0:
                mRoute[0] = tot[0]

        return kernel

    def gate_up_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        g = self.gate_up
        inter, k, nb = self.I, self.k, self.cfg.nb
        mainloop = g.mainloop()

        @cute.kernel
        def kernel(gZ: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mRoute: cute.Tensor, mAct: cute.Tensor,
                   beta: Float32, lbeta: Float32):
            tile, a, _ = cute.arch.block_idx()
            P = mAct.shape[0]
            red = cutlass.memory.SmemAllocator().allocate_tensor(
                Float32, cute.make_layout((g.nacc, 32), stride=(32, 1)), byte_alignment=16)
            if a < mRoute[0]:
                lane = cute.arch.lane_idx()
                warp = cute.arch.warp_idx()
                q = lane % 4
                r = lane // 4
                e = mRoute[1 + a]
                start = mRoute[1 + P + a]
                count = mRoute[1 + 2 * P + a]
                i0 = tile * 16
                acc = cute.make_rmem_tensor(cute.make_layout((4, 2, nb)), Float32)
                xrow = cute.make_rmem_tensor(cute.make_layout(nb), Int32)
                for m0 in cutlass.range(0, count, 8 * nb):
                    for j in cutlass.range_constexpr(nb):
                        m = cutlass.min(m0 + j * 8 + r, count - 1)     # padded columns: computed, not stored
                        xrow[j] = mRoute[1 + 3 * P + start + m] // k
                    mainloop(gW, mS, gZ, e * (2 * inter) + i0, xrow, acc, red)
                    if warp == g.warps - 1:
                        for j in cutlass.range_constexpr(nb):
                            for c in cutlass.range_constexpr(4):
                                m = m0 + j * 8 + 2 * q + (c % 2)
                                if m < count:
                                    pair = mRoute[1 + 3 * P + start + m]
                                    gate = acc[c, 0, j].to(mAct.element_type).to(Float32)
                                    up = acc[c, 1, j].to(mAct.element_type).to(Float32)
                                    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate))
                                    act = beta * cute.math.tanh(gate / beta) * sig
                                    up = lbeta * cute.math.tanh(up / lbeta)
                                    mAct[pair, i0 + (c // 2) * 8 + r] = (act * up).to(mAct.element_type)

        return kernel

    def down_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        g = self.down
        L, nb, nf = self.L, self.cfg.nb, self.cfg.down_frag
        mainloop = g.mainloop()

        @cute.kernel
        def kernel(gAct: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mRoute: cute.Tensor, mO: cute.Tensor):
            tile, a, _ = cute.arch.block_idx()
            P = mO.shape[0]
            red = cutlass.memory.SmemAllocator().allocate_tensor(
                Float32, cute.make_layout((g.nacc, 32), stride=(32, 1)), byte_alignment=16)
            if a < mRoute[0]:
                lane = cute.arch.lane_idx()
                warp = cute.arch.warp_idx()
                q = lane % 4
                r = lane // 4
                e = mRoute[1 + a]
                start = mRoute[1 + P + a]
                count = mRoute[1 + 2 * P + a]
                l0 = tile * (16 * nf)
                acc = cute.make_rmem_tensor(cute.make_layout((4, nf, nb)), Float32)
                xrow = cute.make_rmem_tensor(cute.make_layout(nb), Int32)
                for m0 in cutlass.range(0, count, 8 * nb):
                    for j in cutlass.range_constexpr(nb):
                        m = cutlass.min(m0 + j * 8 + r, count - 1)
                        xrow[j] = mRoute[1 + 3 * P + start + m]
                    mainloop(gW, mS, gAct, e * L + l0, xrow, acc, red)
                    if warp == g.warps - 1:
                        for j in cutlass.range_constexpr(nb):
                            for c in cutlass.range_constexpr(4):
                                m = m0 + j * 8 + 2 * q + (c % 2)
                                if m < count:
                                    pair = mRoute[1 + 3 * P + start + m]
                                    for f in cutlass.range_constexpr(nf):
                                        mO[pair, l0 + f * 16 + (c // 2) * 8 + r] = acc[c, f, j].to(mO.element_type)

        return kernel

    def combine_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        k, nv, E = self.k, self.L // 8, self.E

        @cute.kernel
        def kernel(mIds: cute.Tensor, mWts: cute.Tensor, gO: cute.Tensor, gY: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, b, _ = cute.arch.block_idx()
            v = bx * COMBINE_THREADS + tidx
            if v < nv:
                acc = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                ov = cute.make_rmem_tensor(cute.make_layout(8), gO.element_type)
                acc.fill(0.0)
                for j in cutlass.range_constexpr(k):
                    e = Int32(mIds[b * k + j])
                    if valid_id(e, E):
                        w = mWts[b * k + j]
                        ov.store(gO[None, (b * k + j, v)].load())
                        acc.store(acc.load() + ov.load().to(Float32) * w)
                ov.store(acc.load().to(gY.element_type))
                gY[None, (b, v)].store(ov.load())

        return kernel

    # ------------------------------------------------------------------------------------ host
    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32
        route, gate_up, down, combine = (self.route_kernel(), self.gate_up_kernel(), self.down_kernel(),
                                         self.combine_kernel())
        E, L, inter, k, cfg = self.E, self.L, self.I, self.k, self.cfg
        threads = 32 * cfg.warps
        nvec = L // 8

        @cute.jit
        def host(mZ: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW13: cute.Tensor, mS13: cute.Tensor,
                 mW2: cute.Tensor, mS2: cute.Tensor, beta: Float32, lbeta: Float32, mRoute: cute.Tensor,
                 mAct: cute.Tensor, mO: cute.Tensor, mY: cute.Tensor, stream):
            P = mIds.shape[0]
            slots = cutlass.min(P, E)
            gW13 = cute.zipped_divide(mW13, (1, 4))
            gW2 = cute.zipped_divide(mW2, (1, 4))
            gZ = cute.zipped_divide(mZ, (1, 8))
            gAct = cute.zipped_divide(mAct, (1, 8))
            gO = cute.zipped_divide(mO, (1, 8))
            gY = cute.zipped_divide(mY, (1, 8))
            route(mIds, mRoute).launch(grid=[1, 1, 1], block=[ROUTE_THREADS, 1, 1], stream=stream)
            gate_up(gZ, gW13, mS13, mRoute, mAct, beta, lbeta).launch(
                grid=[inter // 16, slots, 1], block=[threads, 1, 1], stream=stream)
            down(gAct, gW2, mS2, mRoute, mO).launch(
                grid=[L // (16 * cfg.down_frag), slots, 1], block=[threads, 1, 1], stream=stream)
            combine(mIds, mWts, gO, gY).launch(
                grid=[(nvec + COMBINE_THREADS - 1) // COMBINE_THREADS, mZ.shape[0], 1],
                block=[COMBINE_THREADS, 1, 1], stream=stream)

        return host


def _rows64(dtype: str, rows: int, cols: int, words: int):
    """A weight operand [rows, cols] whose row stride is a 64-bit dynamic value (`words` elements divide
    it: 16-byte rows for the packed weights): element offsets are computed in 64 bits, so the unsplit
    K3 experts (w13: 2.47e9 words) index past 2^31."""
    _, cute = runtime.cutlass_modules()
    return cute.runtime.make_fake_tensor(runtime.cutlass_dtype(dtype), (rows, cols),
                                         stride=(cute.sym_int64(divisibility=words), 1),
                                         assumed_align=4 * words if dtype == "int32" else 1)


@runtime.compile_cache("moe_experts_mxfp4")
def _compile(wd: str, ids_dtype: str, E: int, L: int, inter: int, k: int, cfg: MoeExpertsConfig):
    """One function for the four launches; B is dynamic (a new batch size reuses it)."""
    op = MoeExperts(wd, ids_dtype, E, L, inter, k, cfg)
    b, p, rw, pa, po = (runtime.sym_int() for _ in range(5))
    from cutlass import Float32
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(wd, (b, L)),
        runtime.fake_tensor(ids_dtype, (p,), align=8 if ids_dtype == "int64" else 4),
        runtime.fake_tensor("float32", (p,), align=4),
        _rows64("int32", E * 2 * inter, L // 8, 4),
        _rows64("uint8", E * 2 * inter, L // 32, 1),
        _rows64("int32", E * L, inter // 8, 4),
        _rows64("uint8", E * L, inter // 32, 1),
        Float32(4.0), Float32(25.0),
        runtime.fake_tensor("int32", (rw,), align=4),
        runtime.fake_tensor(wd, (pa, inter)),
        runtime.fake_tensor(wd, (po, L)),
        runtime.fake_tensor(wd, (b, L)))


INDEX_LIMIT = 2**31        # weight rows (expert x row) an operand may hold: row ids are 32-bit, offsets 64-bit


def _check(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale):
    """Shapes and dtypes as the reference checks them; not the id values (a host check of device ids
    would synchronise, and fail inside CUDA graph capture): ids outside 0..E-1 are skipped like -1."""
    from references.primitives import check_tensor
    check_tensor("z", z, ndim=2, dtypes=tuple(getattr(torch, d) for d in DTYPES))
    B, L = z.shape
    check_tensor("ids", ids, shape=(B, None), dtypes=(torch.int64, torch.int32))
    check_tensor("weights", weights, shape=tuple(ids.shape), dtypes=(torch.float32,))
    check_tensor("w13_packed", w13_packed, ndim=3, dtypes=(torch.uint8,))
    E, two_i = w13_packed.shape[:2]
    if two_i % 2 or w13_packed.shape[2] * 2 != L:
        raise ValueError(f"w13_packed: expected [E, 2I, {L // 2}] (L={L} packed two per byte), got {tuple(w13_packed.shape)}")
    inter = two_i // 2
    if L % 32 or inter % 32:
        raise ValueError(f"z, w13_packed: L={L} and I={inter} must be multiples of 32 (the MXFP4 group)")
    check_tensor("w13_scale", w13_scale, shape=(E, two_i, L // 32), dtypes=(torch.uint8,))
    check_tensor("w2_packed", w2_packed, shape=(E, L, inter // 2), dtypes=(torch.uint8,))
    check_tensor("w2_scale", w2_scale, shape=(E, L, inter // 32), dtypes=(torch.uint8,))
    for name, rows in (("w13_packed", E * two_i), ("w2_packed", E * L)):
        if rows >= INDEX_LIMIT:
            raise ValueError(f"{name}: {rows} weight rows (experts x rows); the kernel's row ids are 32-bit "
                             "(< 2^31 rows): split the experts over ranks (EP) or the intermediate dimension")
    runtime.require_cuda("z", z)


def launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta: float,
           situ_linear_beta: float, out, variant: MoeExpertsConfig | None = None,
           scratch: dict | None = None) -> None:
    """y into `out` (B x L, wd), on the current stream. `scratch` (tests): a dict that receives the
    route lists, a[pair, I] and o[pair, L] the launches wrote."""
    cfg = variant or DEFAULT
    B, L = z.shape
    E, inter, k = w13_packed.shape[0], w2_packed.shape[2] * 2, ids.shape[1]
    if B == 0:
        return
    if k == 0 or E == 0:                # no slots, or an expert-parallel rank that holds no experts
        out.zero_()
        return
    P = B * k
    ids_flat = ids.contiguous().view(-1)
    ids_flat = ids_flat if ids_flat.dtype in (torch.int64, torch.int32) else ids_flat.long()
    fn = _compile(runtime.dtype_name(z.dtype), runtime.dtype_name(ids_flat.dtype), E, L, inter, k, cfg)
    dev = z.device
    route = torch.empty(1 + 4 * P, dtype=torch.int32, device=dev)
    act = torch.empty(P, inter, dtype=z.dtype, device=dev)
    o = torch.empty(P, L, dtype=z.dtype, device=dev)
    dst = runtime.aligned(out) if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    w13 = runtime.aligned(w13_packed.contiguous()).view(torch.int32).view(E * 2 * inter, L // 8)
    w2 = runtime.aligned(w2_packed.contiguous()).view(torch.int32).view(E * L, inter // 8)
    fn(runtime.aligned(z.contiguous()), ids_flat, weights.contiguous().view(-1).to(torch.float32),
       w13, w13_scale.contiguous().view(E * 2 * inter, L // 32),
       w2, w2_scale.contiguous().view(E * L, inter // 32),
       float(situ_beta), float(situ_linear_beta), route, act, o, dst)
    runtime.write_back(dst, out)
    if scratch is not None:
        scratch.update(route=route, act=act, o=o)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("moe_experts_mxfp4", mutates_args=("out",))
        def moe_experts_mxfp4_out(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                  w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                                  w2_scale: torch.Tensor, situ_beta: float, situ_linear_beta: float,
                                  out: torch.Tensor) -> None:
            launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta, out)

        _op = moe_experts_mxfp4_out
    return _op


def moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
                      variant: MoeExpertsConfig | None = None):
    """Fused replacement of references.moe.moe_experts_mxfp4 (same signature)."""
    _check(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
    if out is None:
        out = torch.empty_like(z, memory_format=torch.contiguous_format)
    if variant is not None:
        launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta,
               out, variant)
    else:
        _custom_op()(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, float(situ_beta),
                     float(situ_linear_beta), out)
    return out
