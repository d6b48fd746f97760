"""router_topk in ONE launch (experimental, `RouterTopkConfig(one_launch=True)`): the logits GEMM's
CTAs write their fp32 partials, arrive on a grid-wide counter, and the last few CTAs then run the
top-k of fused/router_topk.py on those partials. Not in `variants()` nor picked by the dispatch; it
exists to be measured against the two launches (11.7 us at B = 1 on the H200, target 6 us).

Same bits as the two-launch path, by construction:
- the logits: the very device code of the two-launch GEMM (`SkinnyGemm.device_body` at M <= SIMT_MAX,
  `SkinnyGemmMma.device_body` above), same config (`router_topk.logits_config`: same k-split S, same
  warps, same per-CTA summation order), writing the same fp32 partials ws[S, B, E];
- the fold and the selection: the very device code of the top-k kernel (`RouterTopk.device_select`),
  which folds the partials in order s = 0..S-1, takes sigmoid + bias, selects by k argmax rounds
  (lower id wins a tie) and renormalises. It runs with the GEMM CTA's warps as `warps_per_token`
  (8 for the split-K MMA at D = 7168, 4 for the SIMT GEMV): every top-k tiling computes the same
  sigmoids, the same winners and the same sum (the docstring of router_topk.py), so the bits do not
  depend on it.
Both GEMM flavours are fused: they share the arrive / wait / select tail, and B = 1 (SIMT) is where
the second launch costs most relative to the work.

The grid-wide wait. After its partial stores every thread fences (fence.acq_rel.gpu), the CTA
synchronises, and thread 0 takes a ticket (atom.add.acq_rel.gpu) on the int32 counter. The last
W = min(B, CTAs) CTAs of the grid are the waiters: thread 0 spins (ld.acquire.gpu, nanosleep back-off)
until the counter reaches the CTA count, the CTA synchronises and fences, and the CTA runs the top-k
of tokens w, w + W, ... (w: its rank among the waiters). No float atomics; the partials are plain
stores read after the acquire, so the result is deterministic.

Residency (why the waiters cannot deadlock): only the W waiters ever wait; every other CTA arrives and
exits. A CTA that is not yet resident needs a free slot, and slots are freed by non-waiters exiting,
so the grid completes whenever W < (slots of the device) -- and one CTA fits on every SM (the kernel
launched), so W < multi_processor_count suffices, whatever the registers allow. `fits` checks that at
launch against torch.cuda.get_device_properties(dev).multi_processor_count (like
skinny_gemm_wgmma.resident_or_vec) and the launcher falls back to the two launches otherwise (same
bits). The whole grid need not be resident: at B <= 32 the split-K grid is 56 x 7 = 392 CTAs.
A co-running kernel that holds SMs only delays the grid (as for the "spread" fold).

Counter reset (two-round ticket): each waiter, once it has seen the count reach CTAs, adds 1 again;
the one that draws CTAs + W - 1 (the last waiter) stores 0. The first waiter to see >= CTAs sees only
first-round tickets (a second-round add needs that sight first), so every CTA had arrived; the reset
comes after every waiter's sight. So back-to-back launches and CUDA-graph replays start from 0.

Buffers: the caller's logits workspace (router_topk.logits_workspace) and one counter per (device,
stream, E, D, top_k, GEMM config), zeroed on first use (`buffers`): warm a shape up before capturing
it in a CUDA graph; launches on two streams get two counters.
"""
from fused import runtime
from fused import router_topk as rt
from fused import skinny_gemm as sg
from fused import skinny_gemm_mma as mma
from fused.skinny_gemm_mma import SkinnyGemmMmaConfig


def num_ctas(B: int, E: int, gemm) -> int:
    """CTAs of the logits GEMM's grid for B tokens (the fused grid is the same)."""
    if isinstance(gemm, SkinnyGemmMmaConfig):
        return (E // gemm.rows) * gemm.ksplit
    return -(-B // gemm.m_tile) * (E // gemm.n_per_cta)


def waiters(B: int, E: int, gemm) -> int:
    return min(B, num_ctas(B, E, gemm))


def fits(device, B: int, E: int, gemm) -> bool:
    """Whether the one-launch grid is safe on `device`: its W waiting CTAs leave at least one SM's slot
    for the CTAs they wait for (module docstring, "Residency")."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return waiters(B, E, gemm) < sms


class RouterTopkOneLaunch:
    """Compile-time configuration: shape (E, D, top_k) and the logits GEMM config."""

    def __init__(self, E: int, D: int, top_k: int, gemm):
        if isinstance(gemm, SkinnyGemmMmaConfig):
            self.gemm_op, self.S = mma.SkinnyGemmMma(E, D, gemm), gemm.ksplit
        else:
            self.gemm_op, self.S = sg.SkinnyGemm(E, D, gemm), 1
        threads = self.gemm_op.threads
        if threads // 32 not in (1, 2, 4, 8) or threads % 32:
            raise ValueError(f"variant: the GEMM CTA's {threads} threads must be 1, 2, 4 or 8 warps ({gemm.name})")
        self.E, self.D, self.k, self.gemm, self.threads = E, D, top_k, gemm, threads
        self.topk = rt.RouterTopk(E, top_k, rt.RouterTopkConfig(1, None, threads // 32, select="rounds"), self.S)

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        E, gemm, threads, S = self.E, self.gemm, self.threads, self.S
        is_mma = isinstance(gemm, SkinnyGemmMmaConfig)

        @cute.jit
        def host(mX: cute.Tensor, mWg: cute.Tensor, mY: cute.Tensor, mLogit: cute.Tensor, mBias: cute.Tensor,
                 mIds: cute.Tensor, mW: cute.Tensor, mCnt: cute.Tensor, routed_scale: cutlass.Float32, stream):
            gX = cute.zipped_divide(mX, (1, mma.VEC))
            gW = cute.zipped_divide(mWg, (1, mma.VEC))
            if cutlass.const_expr(is_mma):
                grid = [E // gemm.rows, S, 1]
            else:
                grid = [(mX.shape[0] + gemm.m_tile - 1) // gemm.m_tile, E // gemm.n_per_cta, 1]
            kernel(gX, gW, mY, mLogit, mBias, mIds, mW, mCnt, routed_scale).launch(
                grid=grid, block=[threads, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        from fused.skinny_gemm_wgmma import spin_wait_op

        logits = self.gemm_op.device_body()
        select = self.topk.device_select()
        wait_at_least = spin_wait_op()

        @cute.kernel
        def kernel(gX: cute.Tensor, gW: cute.Tensor, mY: cute.Tensor, mLogit: cute.Tensor, mBias: cute.Tensor,
                   mIds: cute.Tensor, mW: cute.Tensor, mCnt: cute.Tensor, routed_scale: Float32):
            logits(gX, gW, mY)                           # this CTA's fp32 partials of ws[S, B, E]
            tidx, _, _ = cute.arch.thread_idx()
            bx, by, _ = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            ctas = gx * gy
            B = mLogit.shape[1]
            nwait = cutlass.min(B, ctas)
            w = bx + by * gx - (ctas - nwait)            # rank among the waiters (the last nwait CTAs)
            cute.arch.fence_acq_rel_gpu()                # every thread's partial stores before the ticket
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="acq_rel", scope="gpu")
            if w >= 0:
                if tidx == 0:
                    wait_at_least(mCnt.iterator, ctas)   # every CTA has written its partials
                cute.arch.sync_threads()
                cute.arch.fence_acq_rel_gpu()
                for b in cutlass.range(w, B, nwait, unroll=1):
                    select(mLogit, mBias, mIds, mW, routed_scale, b)
                    cute.arch.sync_threads()             # odd k: the next token's round 0 reuses round k-1's buffer
                if tidx == 0:                            # second round: the last waiter resets the counter
                    done = cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="relaxed", scope="gpu")
                    if done == ctas + nwait - 1:
                        mCnt[0] = Int32(0)

        return kernel


@runtime.compile_cache("router_topk_fused")
def _compile(dtype: str, E: int, D: int, top_k: int, gemm):
    """f(x[B,D], w[E,D], y (the GEMM's view of the workspace), ws[S,B,E], bias[E], ids[B,k], w[B,k],
    counter int32[1], routed_scale), B dynamic."""
    cutlass, _ = runtime.cutlass_modules()
    op = RouterTopkOneLaunch(E, D, top_k, gemm)
    b = runtime.sym_int()
    S = op.S
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor(dtype, (b, D)),
        runtime.fake_tensor(dtype, (E, D)),
        runtime.fake_tensor("float32", (S, b, E) if S > 1 else (b, E), align=4),
        runtime.fake_tensor("float32", (S, b, E), align=4),
        runtime.fake_tensor("float32", (E,), align=4),
        runtime.fake_tensor("int64", (b, top_k), align=8),
        runtime.fake_tensor("float32", (b, top_k), align=4),
        runtime.fake_tensor("int32", (1,), align=4),
        cutlass.Float32(1.0))


def compile_all_for(dtype: str, E: int, D: int, top_k: int) -> list:
    """Every one-launch kernel a launch at any B <= 64 can use (CPU compile checks): the SIMT bucket
    of B = 1 and the split-K MMA config of each token bucket."""
    cfgs = [rt.logits_config(M, E, D) for M in (1, 8, 16, 32, 64)]
    return [_compile(dtype, E, D, top_k, g) for g in dict.fromkeys(cfgs)]


_buffers: dict[tuple, object] = {}


def buffers(device, E: int, D: int, top_k: int, gemm):
    """The zeroed int32 counter of this (device, current stream, shape, GEMM config); the kernel
    leaves it at zero."""
    import torch

    key = (str(device), torch.cuda.current_stream(device).cuda_stream, E, D, top_k, gemm)
    hit = _buffers.get(key)
    if hit is None:
        hit = torch.zeros(1, dtype=torch.int32, device=device)
        _buffers[key] = hit
    return hit


def launch(x, w_gate, bias, top_k, routed_scale, ids, weights, logits, gemm) -> None:
    """One launch: logits GEMM (config `gemm`) + top-k; logits is the [S, B, E] workspace. The caller
    checks `fits` first (router_topk.launch falls back to two launches otherwise)."""
    B, D = x.shape
    E = w_gate.shape[0]
    x = x if x.data_ptr() % 16 == 0 else x.clone()          # 16-byte loads, as skinny_gemm.launch
    w_gate = w_gate if w_gate.data_ptr() % 16 == 0 else w_gate.clone()
    if isinstance(gemm, SkinnyGemmMmaConfig) and B > gemm.m_pad:
        raise ValueError(f"x: B={B} is over the logits config's m_pad={gemm.m_pad} ({gemm.name})")
    fn = _compile(runtime.dtype_name(x.dtype), E, D, top_k, gemm)
    S = logits.shape[0]
    fn(x, w_gate, logits if S > 1 else logits[0], logits, bias, ids, weights,
       buffers(x.device, E, D, top_k, gemm), float(routed_scale))
