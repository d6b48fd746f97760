"""moe_experts_mxfp4 in two launches at B = 1: no route kernel, the combine in the down GEMM's last CTAs.

fused.moe_experts_mxfp4 runs four launches: route (the distinct experts and their (token, slot) lists),
gate_up, down, combine. At one token every slot is its own pair, so the route has nothing to group
(two slots naming one expert are computed twice, each with the same arithmetic as the shared pass:
the MMA's columns are independent). Here:

1. gate_up: grid (I / 16, P = B * k), one CTA per (16 intermediate rows, pair); the expert is
   ids[pair], read in the kernel (an id outside 0..E-1, -1 padding included, skips the CTA as the
   route does). The GEMV device code is fused.moe_experts_mxfp4_gemv's, with the pair's token in
   every MMA column, SiTU-and-mul and the a[pair, I] store as moe_experts_mxfp4's gate_up.
2. down + combine: grid (L / (16 x down_frag), P). Each CTA computes o[pair, its rows] as
   moe_experts_mxfp4's down does, makes it visible at GPU scope (fence.acq_rel.gpu, a barrier) and
   takes a ticket from its column tile's int32 counter (atomic add, acq_rel, gpu scope). The CTA that
   draws the tile's last ticket has seen every pair's rows: it runs the combine for those rows,
   y[b, l] = sum over the real slots j in order of weights[b, j] * o[b * k + j, l] in fp32 rounded
   to wd (moe_experts_mxfp4's combine, the same expression), and puts the counter back to 0 for the
   next launch and every CUDA-graph replay.

So y is the four launches' bits at B = 1. Above one token the route's sharing of weight reads between
the tokens of an expert is what makes the four launches fast; this form calls fused.moe_experts_mxfp4
there (and where k or E is 0).

The counters (one per column tile) are kept per (device, stream, tiles): launches on one stream run in
order; two streams never share them. A CUDA graph keeps the counters of its capture stream, so two
replays of graphs captured on one stream must not overlap.

The candidate: `--candidate fused.moe_experts_mxfp4_slots:moe_experts_mxfp4`; its variants are
moe_experts_mxfp4's (the GEMV tilings).
"""
import torch

from fused import moe_experts_mxfp4 as mx
from fused import runtime

DTYPES = mx.DTYPES
SLOTS_MAX = 1            # tokens up to which the two launches run
variants = mx.variants


def pair_gemv(cute, g, mainloop, nfrag: int, gW, mS, gX, row0, x_row, red):
    """Inside a kernel, at trace time: one pair's ExpertGemv sums, acc[(4, nfrag, nb)] with the token
    row `x_row` in every MMA column, and this lane's (warp, q, r). The stored sums are column 0's
    (c = 0, 2) in the last warp's lanes with q == 0."""
    from cutlass import Float32, Int32
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    acc = cute.make_rmem_tensor(cute.make_layout((4, nfrag, g.nb)), Float32)
    xrow = cute.make_rmem_tensor(cute.make_layout(g.nb), Int32)
    for j in range(g.nb):
        xrow[j] = x_row
    mainloop(gW, mS, gX, row0, xrow, acc, red)
    return acc, warp, lane % 4, lane // 4


class MoeExpertsSlots(mx.MoeExperts):
    """The gate_up and down GEMVs of moe_experts_mxfp4 (same ExpertGemv objects), indexed by pair."""

    def slot_gate_up_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        g = self.gate_up
        E, inter, k = self.E, self.I, self.k
        mainloop = g.mainloop()

        @cute.kernel
        def kernel(gZ: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mIds: cute.Tensor, mAct: cute.Tensor,
                   beta: Float32, lbeta: Float32):
            tile, a, _ = cute.arch.block_idx()
            red = cutlass.memory.SmemAllocator().allocate_tensor(
                Float32, cute.make_layout((g.nacc, 32), stride=(32, 1)), byte_alignment=16)
            e = Int32(mIds[a])
            if mx.valid_id(e, E):
                i0 = tile * 16
                acc, warp, q, r = pair_gemv(cute, g, mainloop, 2, gW, mS, gZ, e * (2 * inter) + i0, a // k, red)
                if warp == g.warps - 1:
                    if q == 0:                            # column 0 (c = 0, 2): the stored one
                        for h in cutlass.range_constexpr(2):
                            gate = acc[2 * h, 0, 0].to(mAct.element_type).to(Float32)
                            up = acc[2 * h, 1, 0].to(mAct.element_type).to(Float32)
                            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate))
                            act = beta * cute.math.tanh(gate / beta) * sig
                            up = lbeta * cute.math.tanh(up / lbeta)
                            mAct[a, i0 + h * 8 + r] = (act * up).to(mAct.element_type)

        return kernel

    def down_combine_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32
        g = self.down
        E, L, k, nf = self.E, self.L, self.k, self.cfg.down_frag
        threads = 32 * self.cfg.warps
        nvt = 16 * nf // 8                                # 8-wide vectors of y per column tile
        mainloop = g.mainloop()

        @cute.kernel
        def kernel(gAct: cute.Tensor, gW: cute.Tensor, mS: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                   mO: cute.Tensor, gO: cute.Tensor, gY: cute.Tensor, mCnt: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            tile, a, _ = cute.arch.block_idx()
            P = mO.shape[0]
            alloc = cutlass.memory.SmemAllocator()
            red = alloc.allocate_tensor(Float32, cute.make_layout((g.nacc, 32), stride=(32, 1)), byte_alignment=16)
            ticket = alloc.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
            l0 = tile * (16 * nf)
            e = Int32(mIds[a])
            if mx.valid_id(e, E):
                acc, warp, q, r = pair_gemv(cute, g, mainloop, nf, gW, mS, gAct, e * L + l0, a, red)
                if warp == g.warps - 1:
                    if q == 0:
                        for h in cutlass.range_constexpr(2):
                            for f in cutlass.range_constexpr(nf):
                                mO[a, l0 + f * 16 + h * 8 + r] = acc[2 * h, f, 0].to(mO.element_type)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                ticket[0] = cute.arch.atomic_add(mCnt.iterator + tile, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if ticket[0] == P - 1:                        # every pair's rows of this tile are visible
                cute.arch.fence_acq_rel_gpu()
                for t in cutlass.range(tidx, gY.shape[1][0] * nvt, threads, unroll=1):
                    b = t // nvt
                    v = l0 // 8 + t % nvt
                    sums = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                    ov = cute.make_rmem_tensor(cute.make_layout(8), gO.element_type)
                    sums.fill(0.0)
                    for j in cutlass.range_constexpr(k):
                        ej = Int32(mIds[b * k + j])
                        if mx.valid_id(ej, E):
                            w = mWts[b * k + j]
                            ov.store(gO[None, (b * k + j, v)].load())
                            sums.store(sums.load() + ov.load().to(Float32) * w)
                    ov.store(sums.load().to(gY.element_type))
                    gY[None, (b, v)].store(ov.load())
                if tidx == 0:
                    mCnt[tile] = Int32(0)

        return kernel

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32
        gate_up, down = self.slot_gate_up_kernel(), self.down_combine_kernel()
        L, inter, cfg = self.L, self.I, self.cfg
        threads = 32 * cfg.warps

        @cute.jit
        def host(mZ: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, mW13: cute.Tensor, mS13: cute.Tensor,
                 mW2: cute.Tensor, mS2: cute.Tensor, beta: Float32, lbeta: Float32, mAct: cute.Tensor,
                 mO: cute.Tensor, mY: cute.Tensor, mCnt: cute.Tensor, stream):
            P = mIds.shape[0]
            gW13 = cute.zipped_divide(mW13, (1, 4))
            gW2 = cute.zipped_divide(mW2, (1, 4))
            gZ = cute.zipped_divide(mZ, (1, 8))
            gAct = cute.zipped_divide(mAct, (1, 8))
            gO = cute.zipped_divide(mO, (1, 8))
            gY = cute.zipped_divide(mY, (1, 8))
            gate_up(gZ, gW13, mS13, mIds, mAct, beta, lbeta).launch(
                grid=[inter // 16, P, 1], block=[threads, 1, 1], stream=stream)
            down(gAct, gW2, mS2, mIds, mWts, mO, gO, gY, mCnt).launch(
                grid=[L // (16 * cfg.down_frag), P, 1], block=[threads, 1, 1], stream=stream)

        return host


def runs(B: int, k: int, E: int) -> bool:
    """Whether the two launches take B tokens of k slots over E experts (else the four launches)."""
    return 1 <= B <= SLOTS_MAX and k > 0 and E > 0


def tiles(L: int, cfg: mx.MoeExpertsConfig) -> int:
    """Column tiles of the down GEMM (one ticket counter each)."""
    return L // (16 * cfg.down_frag)


@runtime.compile_cache("moe_experts_mxfp4_slots")
def _compile(wd: str, ids_dtype: str, E: int, L: int, inter: int, k: int, cfg: mx.MoeExpertsConfig):
    """One function for the two launches; the batch is dynamic (the form runs it at B = 1)."""
    op = MoeExpertsSlots(wd, ids_dtype, E, L, inter, k, cfg)
    b, p, pa, po = (runtime.sym_int() for _ in range(4))
    from cutlass import Float32
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(wd, (b, L)),
        runtime.fake_tensor(ids_dtype, (p,), align=8 if ids_dtype == "int64" else 4),
        runtime.fake_tensor("float32", (p,), align=4),
        mx._rows64("int32", E * 2 * inter, L // 8, 4),
        mx._rows64("uint8", E * 2 * inter, L // 32, 1),
        mx._rows64("int32", E * L, inter // 8, 4),
        mx._rows64("uint8", E * L, inter // 32, 1),
        Float32(4.0), Float32(25.0),
        runtime.fake_tensor(wd, (pa, inter)),
        runtime.fake_tensor(wd, (po, L)),
        runtime.fake_tensor(wd, (b, L)),
        runtime.fake_tensor("int32", (tiles(L, cfg),), align=4))


_counters: dict = {}


def counters(device, n: int) -> torch.Tensor:
    """The n column tiles' ticket counters (int32, zeroed once) for `device` and the current stream, made
    on first use and reused: the kernel leaves them at zero."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream, n)
    hit = _counters.get(key)
    if hit is None:
        hit = _counters[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return hit


def launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta: float,
           situ_linear_beta: float, out, variant: mx.MoeExpertsConfig | None = None,
           scratch: dict | None = None) -> None:
    """y into `out` (B x L, wd) for B = z.shape[0] <= SLOTS_MAX tokens and k, E > 0, on the current
    stream. `scratch` (tests): a dict that receives a[pair, I] and o[pair, L] the launches wrote."""
    cfg = variant or mx.DEFAULT
    B, L = z.shape
    E, inter, k = w13_packed.shape[0], w2_packed.shape[2] * 2, ids.shape[1]
    if not runs(B, k, E):
        raise ValueError(f"z, ids: {B} tokens of {k} slots over {E} experts; the two-launch form takes "
                         f"1..{SLOTS_MAX} tokens and k, E > 0")
    P = B * k
    ids_flat = ids.contiguous().view(-1)
    fn = _compile(runtime.dtype_name(z.dtype), runtime.dtype_name(ids_flat.dtype), E, L, inter, k, cfg)
    act = torch.empty(P, inter, dtype=z.dtype, device=z.device)
    o = torch.empty(P, L, dtype=z.dtype, device=z.device)
    dst = runtime.aligned(out) if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    w13 = runtime.aligned(w13_packed.contiguous()).view(torch.int32).view(E * 2 * inter, L // 8)
    w2 = runtime.aligned(w2_packed.contiguous()).view(torch.int32).view(E * L, inter // 8)
    fn(runtime.aligned(z.contiguous()), ids_flat, weights.contiguous().view(-1).to(torch.float32),
       w13, w13_scale.contiguous().view(E * 2 * inter, L // 32),
       w2, w2_scale.contiguous().view(E * L, inter // 32),
       float(situ_beta), float(situ_linear_beta), act, o, dst, counters(z.device, tiles(L, cfg)))
    runtime.write_back(dst, out)
    if scratch is not None:
        scratch.update(act=act, o=o)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("moe_experts_mxfp4_slots", mutates_args=("out",))
        def moe_experts_mxfp4_slots_out(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                        w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                                        w2_scale: torch.Tensor, situ_beta: float, situ_linear_beta: float,
                                        out: torch.Tensor) -> None:
            launch(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta, out)

        _op = moe_experts_mxfp4_slots_out
    return _op


def moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
                      variant: mx.MoeExpertsConfig | None = None):
    """Fused replacement of references.moe.moe_experts_mxfp4 (same signature): two launches at
    B <= SLOTS_MAX, else fused.moe_experts_mxfp4's four."""
    args = (z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta)
    mx._check(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
    if not runs(z.shape[0], ids.shape[1], w13_packed.shape[0]):
        return mx.moe_experts_mxfp4(*args, out=out, variant=variant)
    if out is None:
        out = torch.empty_like(z, memory_format=torch.contiguous_format)
    if variant is not None:
        launch(*args, out, variant)
    else:
        _custom_op()(*args[:7], float(situ_beta), float(situ_linear_beta), out)
    return out
