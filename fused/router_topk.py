"""router_topk: fp32 router logits, sigmoid, + bias, exact top-k, renormalised weights.

Two launches on the caller's stream: (1) the skinny_gemm GEMV kernel writes fp32 logits[B, E]
(bf16 products are exact in fp32; fp32 accumulation); (2) one warp per token selects the top k
of choice = sigmoid(logit) + bias by k rounds of warp argmax. Lane l holds experts l, l+32, ...
in registers; a round takes each lane's best (strict >, so the lower id wins a tie inside a lane),
then a butterfly argmax that prefers the larger choice and, on equal choice, the lower id; the
owner drops the winner. Rounds run in descending order, so ids come out sorted as the reference's
stable descending sort gives them. Lane r keeps round r's id and s; weights are
s / (sum + 1e-20) * routed_scale.
"""
import operator
from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg

RENORM_EPS = 1e-20


@dataclass(frozen=True)
class RouterTopkConfig:
    tokens_per_cta: int = 4          # one warp per token

    @property
    def name(self) -> str:
        return f"warp_argmax_t{self.tokens_per_cta}"


def all_configs() -> list[RouterTopkConfig]:
    return [RouterTopkConfig(4), RouterTopkConfig(1)]


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs."""
    return all_configs()


class RouterTopk:
    def __init__(self, E: int, top_k: int, cfg: RouterTopkConfig):
        if not 1 <= top_k <= min(32, E):
            raise ValueError(f"top_k: {top_k} must be in 1..{min(32, E)} for the warp kernel")
        self.E, self.k, self.cfg = E, top_k, cfg
        self.per_lane = -(-E // 32)

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        tpc = self.cfg.tokens_per_cta

        @cute.jit
        def host(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                 routed_scale: cutlass.Float32, stream):
            B = mLogit.shape[0]
            kernel(mLogit, mBias, mIds, mW, routed_scale).launch(
                grid=[(B + tpc - 1) // tpc, 1, 1], block=[32 * tpc, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32, Int64

        E, k, pl, tpc = self.E, self.k, self.per_lane, self.cfg.tokens_per_cta

        @cute.kernel
        def kernel(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                   routed_scale: Float32):
            bidx, _, _ = cute.arch.block_idx()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            b = bidx * tpc + warp
            if b < mLogit.shape[0]:
                choice = cute.make_rmem_tensor(cute.make_layout(pl), Float32)
                for j in cutlass.range_constexpr(pl):
                    choice[j] = Float32(-float("inf"))
                    e = j * 32 + lane
                    if e < E:
                        s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-mLogit[b, e]))
                        choice[j] = s + mBias[e]
                my_id = Int32(0)
                my_s = Float32(0.0)
                for r in cutlass.range_constexpr(k):
                    best = choice[0]
                    bid = lane
                    for j in cutlass.range_constexpr(1, pl):
                        if choice[j] > best:
                            best = choice[j]
                            bid = j * 32 + lane
                    for sh in cutlass.range_constexpr(5):
                        ov = cute.arch.shuffle_sync_bfly(best, offset=1 << sh)
                        oi = cute.arch.shuffle_sync_bfly(bid, offset=1 << sh)
                        if ov > best or (ov == best and oi < bid):
                            best = ov
                            bid = oi
                    for j in cutlass.range_constexpr(pl):
                        if bid == j * 32 + lane:
                            choice[j] = Float32(-float("inf"))
                    if lane == r:
                        my_id = bid
                        my_s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-mLogit[b, bid]))
                total = cute.arch.warp_reduction(my_s if lane < k else Float32(0.0), operator.add)
                if lane < k:
                    mIds[b, lane] = Int64(my_id)
                    mW[b, lane] = my_s / (total + Float32(RENORM_EPS)) * routed_scale

        return kernel


@runtime.compile_cache("router_topk")
def _compile(E: int, top_k: int, cfg: RouterTopkConfig):
    cutlass, _ = runtime.cutlass_modules()
    b = runtime.sym_int()
    op = RouterTopk(E, top_k, cfg)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor("float32", (b, E), align=4),
        runtime.fake_tensor("float32", (E,), align=4),
        runtime.fake_tensor("int64", (b, top_k), align=8),
        runtime.fake_tensor("float32", (b, top_k), align=4),
        cutlass.Float32(1.0))


def compile_all_for(dtype: str, E: int, D: int, top_k: int, cfg: RouterTopkConfig):
    """Both launches' compiled functions (for CPU compile checks)."""
    sg_cfg = sg.default_config(1, E, D)
    return (sg._compile(dtype, "float32", E, D, sg_cfg), _compile(E, top_k, cfg))


def launch(x, w_gate, bias, top_k, routed_scale, ids, weights, logits, variant=None) -> None:
    if x.shape[0] == 0:
        return
    sg.launch(x, w_gate, logits)
    fn = _compile(w_gate.shape[0], top_k, variant or RouterTopkConfig())
    fn(logits, bias, ids, weights, float(routed_scale))


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("router_topk", mutates_args=("ids", "weights", "logits"))
        def router_topk_out(x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                            routed_scale: float, ids: torch.Tensor, weights: torch.Tensor,
                            logits: torch.Tensor) -> None:
            launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale,
                   ids, weights, logits)

        _op = router_topk_out
    return _op


def router_topk(x, w_gate, bias, top_k: int, routed_scale: float, *, variant=None):
    """Fused replacement of references.moe.router_topk (same signature): (ids int64, weights fp32)."""
    sg._check(x, w_gate)
    E = w_gate.shape[0]
    if bias.dtype != torch.float32 or tuple(bias.shape) != (E,):
        raise TypeError(f"bias: expected float32 [{E}], got {bias.dtype} {tuple(bias.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= min(32, E):
        raise ValueError(f"top_k: {top_k!r} must be an int in 1..{min(32, E)} for the fused kernel")
    B = x.shape[0]
    ids = torch.empty(B, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(B, top_k, dtype=torch.float32, device=x.device)
    logits = torch.empty(B, E, dtype=torch.float32, device=x.device)
    if variant is not None:
        launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale,
               ids, weights, logits, variant)
    else:
        _custom_op()(x, w_gate, bias, top_k, float(routed_scale), ids, weights, logits)
    return ids, weights
