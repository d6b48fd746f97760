"""Hand-offs between the CTAs of one launch, for the one-launch forms (a GEMV whose last CTAs finish the
op: fused.kda_in_proj_onelaunch, fused.mla_qkv_a_onelaunch, fused.router_topk_latent_down).

- `kept(device, key, make)`: workspaces and ticket counters kept per (device, stream, key). A kernel
  that leaves its counters at zero can be launched again on the same stream, whose launches run in
  order; two streams never share them; a CUDA graph keeps those of its capture stream, so two replays
  of graphs captured on one stream must not overlap.
- `one_row_gemv(M, N, K)`: skinny_gemm's pick where a one-launch form can run it: one token, the SIMT
  GEMV (its CTAs each own whole columns of the one row, 128 threads).
- `make_draw()`: the ticket. Every thread's global writes are made visible at GPU scope (fence.acq_rel.gpu,
  then a barrier), thread 0 adds 1 to the counter (atomic add, acq_rel, gpu scope) and puts the old
  value in shared memory, and a barrier hands it to every thread. The CTA that draws ticket n - 1 of n
  has seen every other CTA's writes once it fences again (fence.acq_rel.gpu) before reading them.
"""
from fused import runtime

_kept: dict = {}


def kept(device, key: tuple, make):
    """make()'s result for (device, the device's current stream, *key), made on first use and reused."""
    import torch

    k = (str(device), torch.cuda.current_stream(device).cuda_stream, *key)
    hit = _kept.get(k)
    if hit is None:
        hit = _kept[k] = make()
    return hit


def kept_under(tag: str) -> list:
    """Every kept value whose key starts with `tag` (tests read the counters back)."""
    return [v for k, v in _kept.items() if k[2] == tag]


def one_row_gemv(M: int, N: int, K: int):
    """skinny_gemm's pick for y[M, N] = x[M, K] @ w.T where it is the SIMT GEMV of one token, else None."""
    from fused import skinny_gemm as sg

    cfg = sg.default_config(M, N, K)
    return cfg if M == 1 and isinstance(cfg, sg.SkinnyGemmConfig) else None


def make_draw():
    """draw(mCnt, slot): this CTA's ticket from the int32 counter mCnt[0] into slot[0] (shared memory),
    read by every thread after the call."""
    _, cute = runtime.cutlass_modules()
    from cutlass import Int32

    @cute.jit
    def draw(mCnt: cute.Tensor, slot: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            slot[0] = cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.sync_threads()

    return draw
