"""skinny_gemm with the weights as wgmma's B operand (bench-only trial, never run on a GPU yet).

fused/skinny_gemm_wgmma.py gives each CTA a multiple of 64 weight rows (wgmma's M), so 7168->3584
runs 56 column blocks x split-K 2 = 112 CTAs and 1536->7168 runs 112 CTAs: 20 of the H200's 132 SMs
stay idle (results/gpu/targets.md, "Next"). Here the tokens are wgmma's A operand (M = 64, rows >= the
real token count lie outside x and are zero filled by the TMA, never stored) and a CTA owns `n_rows`
weight rows as the B operand (N: a multiple of 8 up to 256), so 112 rows x split 4 and 112 rows x
split 2 give 128 CTAs each (56 rows would too, but that layout aborts in the DSL, see SHAPES). Same pipeline as the shipped kernel: one producer warp issues the TMA loads of a 64 x 64
token tile and an n_rows x 64 weight tile per stage, one consumer warpgroup runs 4 wgmma per stage.
Split-K (ksplit 2) folds like the shipped "last" fold: fragment-major fp32 partials in a workspace,
a ticket per column block, the last CTA adds them in ks order and resets the counter.

    python3 bench/gemm_bop.py --out $OUT              # on the H200: check + time vs default and cuBLAS
    python3 bench/gemm_bop.py --compile-only          # CPU: every variant compiles for sm_90a

If it wins, it belongs in fused/skinny_gemm_wgmma.py as a layout option (then certified).
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fused import runtime  # noqa: E402
from fused.skinny_gemm_wgmma import BK, CONSUMER_THREADS, THREADS, stage_bytes, stages_for  # noqa: E402


@dataclass(frozen=True)
class BopConfig:
    n_rows: int          # weight rows per CTA (wgmma N): a multiple of 8, <= 256
    ksplit: int          # CTAs along K per column block
    stages: int = 0      # 0: as many as fit one CTA per SM

    @property
    def name(self) -> str:
        return f"bop_n{self.n_rows}_s{self.ksplit}_st{self.depth}"

    @property
    def depth(self) -> int:
        return self.stages or stages_for(self.n_rows, 64, 1)     # a stage: n_rows weight + 64 token rows


class SkinnyGemmBop:
    def __init__(self, N: int, K: int, cfg: BopConfig):
        if N % cfg.n_rows or cfg.n_rows % 8 or not 8 <= cfg.n_rows <= 256 or K % BK:
            raise ValueError(f"{cfg.name}: N={N} K={K} not supported")
        self.N, self.K, self.cfg = N, K, cfg
        self.kt, self.blocks = K // BK, N // cfg.n_rows
        self.frag = 64 * cfg.n_rows // CONSUMER_THREADS
        self.ws_numel = max(1, self.blocks * cfg.ksplit * self.frag * CONSUMER_THREADS)   # split-K partials
        self.storage = None

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        import cutlass.utils.hopper_helpers as sm90
        from cutlass.tensor_utils import LayoutEnum

        me, c = self, self.cfg
        kernel = self.device_kernel()

        @cute.jit
        def host(mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor,
                 stream):
            dt = mW.element_type
            kmajor = cute.nvgpu.OperandMajorMode.K
            tiled_mma = sm90.make_trivial_tiled_mma(dt, dt, kmajor, kmajor, cutlass.Float32, (1, 1, 1),
                                                    tiler_mn=(64, c.n_rows))
            tile = (64, c.n_rows, BK)
            x_sl = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dt, c.depth)
            w_sl = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dt, c.depth)
            g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            tma_x, tX = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mX, cute.slice_(x_sl, (None, None, 0)), (64, BK))
            tma_w, tW = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mW, cute.slice_(w_sl, (None, None, 0)),
                                                               (c.n_rows, BK))

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, 2 * c.depth]
                ticket: cute.struct.MemRange[cutlass.Int32, 4]
                sX: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(x_sl)], 1024]
                sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(w_sl)], 1024]

            me.storage = Storage
            kernel(tma_x, tX, tma_w, tW, mY, mWs, mCnt, tiled_mma, x_sl, w_sl).launch(
                grid=[me.blocks, c.ksplit, 1], block=[THREADS, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        import cutlass.pipeline as pipeline
        from cutlass import Float32, Int32

        me = self
        n_rows, S, kt, frag, stages = self.cfg.n_rows, self.cfg.ksplit, self.kt, self.frag, self.cfg.depth
        warpgroup = cute.nvgpu.warpgroup
        tx_bytes = stage_bytes(n_rows, 64)                 # OOB token rows count too

        @cute.jit
        def epilogue(acc, tCc, mY, mWs, mCnt, ticket, bn, ks, tidx, M):
            n0 = bn * n_rows
            if cutlass.const_expr(S > 1):
                base = (bn * S + ks) * (frag * CONSUMER_THREADS) + tidx    # fragment-major, thread-minor
                for i in cutlass.range_constexpr(frag):
                    mWs[base + i * CONSUMER_THREADS] = acc[i]
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
                if tidx == 0:
                    ticket[0] = cute.arch.atomic_add(mCnt.iterator + bn, Int32(1), sem="acq_rel", scope="gpu")
                cute.arch.barrier(barrier_id=1, number_of_threads=CONSUMER_THREADS)
            if cutlass.const_expr(S == 1):
                for i in cutlass.range_constexpr(frag):
                    t, r = tCc[i]
                    if t < M:
                        mY[t, n0 + r] = acc[i].to(mY.element_type)
            else:
                if ticket[0] == S - 1:                                   # last CTA of this block
                    cute.arch.fence_acq_rel_gpu()
                    first = bn * S * (frag * CONSUMER_THREADS) + tidx
                    for i in cutlass.range_constexpr(frag):
                        acc[i] = cute.arch.load(mWs.iterator + (first + i * CONSUMER_THREADS), Float32, cop="cg")
                    for s in cutlass.range(1, S, unroll=1):              # ks order
                        part = first + s * (frag * CONSUMER_THREADS)
                        for i in cutlass.range_constexpr(frag):
                            acc[i] = acc[i] + cute.arch.load(mWs.iterator + (part + i * CONSUMER_THREADS),
                                                             Float32, cop="cg")
                    for i in cutlass.range_constexpr(frag):
                        t, r = tCc[i]
                        if t < M:
                            mY[t, n0 + r] = acc[i].to(mY.element_type)
                    if tidx == 0:
                        mCnt[bn] = Int32(0)

        @cute.kernel
        def kernel(tma_x: cute.CopyAtom, tX: cute.Tensor, tma_w: cute.CopyAtom, tW: cute.Tensor,
                   mY: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor, tiled_mma: cute.TiledMma,
                   x_sl: cute.ComposedLayout, w_sl: cute.ComposedLayout):
            tidx, _, _ = cute.arch.thread_idx()
            bn, ks, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            M = mY.shape[0]
            if warp == 4:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            storage = cutlass.memory.SmemAllocator().allocate(me.storage)
            sX = storage.sX.get_tensor(x_sl.outer, swizzle=x_sl.inner)
            sW = storage.sW.get_tensor(w_sl.outer, swizzle=w_sl.inner)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            kt0 = (ks * kt) // S
            nk = ((ks + 1) * kt) // S - kt0
            if warp == 4:                                          # producer warp: TMA loads
                gX = cute.local_tile(tX, (64, BK), (0, None))
                gW = cute.local_tile(tW, (n_rows, BK), (bn, None))
                tXs, tXg = cute.nvgpu.cpasync.tma_partition(
                    tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
                tWs, tWg = cute.nvgpu.cpasync.tma_partition(
                    tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for i in cutlass.range(nk, unroll=1):
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod)
                    cute.copy(tma_w, tWg[(None, kt0 + i)], tWs[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_x, tXg[(None, kt0 + i)], tXs[(None, prod.index)], tma_bar_ptr=bar)
                    pipe.producer_commit(prod)
                    prod.advance()
            else:                                                  # consumer warpgroup: wgmma
                thr = tiled_mma.get_slice(tidx)
                tCrX = tiled_mma.make_fragment_A(thr.partition_A(sX))
                tCrW = tiled_mma.make_fragment_B(thr.partition_B(sW))
                tCc = thr.partition_C(cute.make_identity_tensor((64, n_rows)))
                acc = cute.make_rmem_tensor(tCc.shape, Float32)
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
                for i in cutlass.range(nk, unroll=1):
                    pipe.consumer_wait(read)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(BK // 16):
                        cute.gemm(tiled_mma, acc, tCrX[(None, None, kb, read.index)],
                                  tCrW[(None, None, kb, read.index)], acc)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)                        # stage i-1's wgmma has finished
                    if i > 0:
                        pipe.consumer_release(done)
                        done.advance()
                    read.advance()
                warpgroup.wait_group(0)
                epilogue(acc, tCc, mY, mWs, mCnt, storage.ticket.get_tensor(cute.make_layout(4)),
                         bn, ks, tidx, M)

        return kernel


@runtime.compile_cache("skinny_gemm_bop@bench")
def _compile(dtype: str, N: int, K: int, cfg: BopConfig):
    _, cute = runtime.cutlass_modules()
    op = SkinnyGemmBop(N, K, cfg)
    m = runtime.sym_int()
    dt = runtime.cutlass_dtype(dtype)
    x = cute.runtime.make_fake_compact_tensor(dt, (m, K), stride_order=(1, 0), assumed_align=16)
    w = cute.runtime.make_fake_compact_tensor(dt, (N, K), stride_order=(1, 0), assumed_align=16)
    y = cute.runtime.make_fake_compact_tensor(dt, (m, N), stride_order=(1, 0), assumed_align=16)
    ws = runtime.fake_tensor("float32", (op.ws_numel,))
    cnt = runtime.fake_tensor("int32", (op.blocks,))
    return runtime.compile_tvm_ffi(op.jit_host(), x, w, y, ws, cnt)


_scratch: dict = {}


def gemm(x, w, cfg: BopConfig, y=None):
    import torch
    M, K = x.shape
    N = w.shape[0]
    key = (x.device, N, K, cfg)
    if key not in _scratch:
        op = SkinnyGemmBop(N, K, cfg)
        _scratch[key] = (torch.empty(op.ws_numel, device=x.device),
                         torch.zeros(op.blocks, dtype=torch.int32, device=x.device))
    ws, cnt = _scratch[key]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if y is None else y
    _compile(runtime.dtype_name(x.dtype), N, K, cfg)(x, w, y, ws, cnt)
    return y


# 128 CTAs each where the rows allow (n_rows = 56 aborts inside the DSL's layout slice, CuTe DSL 4.8.1:
# 112 x split 4 / 112 x split 2 take its place); the 64-row layouts (112 / 96 CTAs) for comparison
SHAPES = {(7168, 3584): [BopConfig(112, 4), BopConfig(224, 8), BopConfig(64, 2)],
          (1536, 7168): [BopConfig(112, 2), BopConfig(224, 4), BopConfig(64, 1)],
          (7168, 6144): [BopConfig(48, 1), BopConfig(96, 2), BopConfig(64, 1)]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--ms", default="1,8,16,32,64")
    args = ap.parse_args()
    if args.compile_only:
        for (K, N), cfgs in SHAPES.items():
            for cfg in cfgs:
                _compile("bfloat16", N, K, cfg)
                print(f"compiled {K}->{N} {cfg.name}")
        return
    import torch
    import torch.nn.functional as F

    from bench.bench_gemm_wgmma import row_ok
    from bench.timing import graph_time_us
    from fused import skinny_gemm as sg
    os.makedirs(args.out, exist_ok=True)
    lines, results = [], []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    for (K, N), cfgs in SHAPES.items():
        n_w = max(2, (256 << 20) // (N * K * 2))          # weights rotated through >= 256 MB: from HBM
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(n_w)]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = x.double() @ ws[0].double().T
            base = F.linear(x, ws[0])
            row = {"K": K, "N": N, "M": M}
            fns = {"cublas": lambda w: F.linear(x, w), "default": lambda w: sg.skinny_gemm(x, w)}
            for cfg in cfgs:
                out = gemm(x, ws[0], cfg, torch.full((M, N), float("nan"), device="cuda").bfloat16())
                ok = row_ok(out, ref, base) and torch.equal(out, gemm(x, ws[0], cfg))   # poisoned, repeatable
                # batch invariant: a token's row does not depend on the others (the tokens are wgmma's
                # M, always padded to 64, so the summation order is the same at every M)
                ok = ok and all(torch.equal(out[t], gemm(x[t:t + 1].contiguous(), ws[0], cfg)[0])
                                for t in {0, M // 2, M - 1})
                row[f"{cfg.name}_ok"] = ok
                if ok:
                    fns[cfg.name] = (lambda c: lambda w: gemm(x, w, c))(cfg)
            for name, f in fns.items():
                t = graph_time_us([(lambda w_: lambda: f(w_))(w) for w in ws])
                row[name] = t
            results.append(row)
            say(f"{K}->{N} M={M}: " + " | ".join(
                f"{k} {v:.2f} us ({N * K * 2 / v / 1e6 / 4.24:.1f} %)" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items() if k not in ("K", "N", "M")))
    with open(os.path.join(args.out, "gemm_bop.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    with open(os.path.join(args.out, "gemm_bop.log"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
