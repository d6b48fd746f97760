"""router_topk: fp32 router logits, sigmoid, + bias, exact top-k, renormalised weights.

Two launches on the caller's stream: (1) a skinny_gemm kernel writes fp32 logits, or fp32 logit
partials ws[S, B, E] (bf16 products are exact in fp32; fp32 accumulation); (2) the top-k kernel folds
the S partials in order s = 0..S-1 (IEEE fp32 adds), then selects the top k of
choice = sigmoid(logit) + bias (by rank above a bound; by k rounds of argmax in the other variants).

Layout: x [B, D] and w_gate [E, D] in the working dtype (bf16 or fp16), bias [E] fp32; returns ids
[B, k] int64 in descending choice (ties to the lower id) and weights [B, k] fp32, renormalised and
times routed_scale. The batch is a dynamic dim; k <= 32.

The logits GEMM (`logits_config`), by token count M:
- M <= SIMT_MAX: the SIMT GEMV (S = 1, IEEE FMA chains).
- above: the wgmma kernel (`wgmma_logits_config`: 64 weight rows per CTA, 14 x 8 CTAs at E = 896,
  each column block's 8 split-K CTAs one cluster folding their partials by skinny_gemm's "cpush",
  so the top-k kernel reads fp32 logits; the form with 14 x 9 CTAs each writing its split-K partial
  for the top-k kernel to fold stays a certified variant) with `fresh_acc`: each k-tile's 4 wgmma
  chain from zero, added to the fp32 accumulator with IEEE adds. Where it does not apply (E not a
  multiple of 64): the mma.sync kernel with split-K over S CTAs (`split_for`, so 56 x S CTAs fill
  the 132 SMs at E = 896) and `fresh_acc` (each mma.sync sums its 16 products into zeroed fragments
  that are added to the fp32 accumulator with IEEE adds); it stays a certified variant. No fold
  spins on its split peers, so two routers on two streams never wait on each other.
Why fresh accumulators: the tensor core aligns and truncates its addends to the largest one, so a
chain that carries the running sum in C errs more than fp32 (a 448-MMA mma.sync chain over D = 7168
erred 3x more than the fp32 reference; 12-tile wgmma chains in C erred up to 3.06 u sum|x w| against
cuBLAS SGEMM's 1.76). The logit selects experts: it is held to fp32 accuracy, not to a bf16 GEMM's.

The top-k device code and how it selects: fused/router_topk_select.py.
"""
import dataclasses
from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg
from fused import skinny_gemm_mma as mma
from fused import skinny_gemm_wgmma as wgmma
from fused.router_topk_select import make_select
from fused.skinny_gemm_mma import SkinnyGemmMmaConfig

DTYPES = ("bfloat16", "float16")   # working dtypes of x and w (the harness draws only these)


SIMT_MAX = 1                        # tokens up to which the SIMT GEMV computes the logits


def split_for(D: int, m_pad: int = 8) -> int:
    """K-split of the tensor-core logits: the largest of 7, 4, 2 leaving >= 16 k-steps of 32 per CTA
    (4 first at 64 tokens, where the accumulators fill the registers: measured 13.4 us vs 16.6 at 7)."""
    steps = D // mma.KSTEP
    for S in ((4, 7, 2) if m_pad == 64 else (7, 4, 2)):
        if steps % S == 0 and steps // S >= 16:
            return S
    return 1


def mma_logits_config(M: int, E: int, D: int) -> SkinnyGemmMmaConfig | None:
    """The split-K, fresh-accumulator tensor-core config for M tokens, or None where it does not apply.
    16 weight rows per CTA where E allows (E = 896: 56 x S CTAs), measured faster than 8 at every M."""
    if not (2 <= M <= 64 and mma.supports(D) and E % 8 == 0):
        return None
    pad = mma.m_pad_for(M)
    S = split_for(D, pad)
    w = mma.warps_for(D // S)
    rows = 16 if E % 16 == 0 else 8
    return SkinnyGemmMmaConfig(pad, rows, w, mma._unroll(D // S, w, pad), True, S, True)


def wgmma_logits_config(M: int, E: int, D: int, fold: str = "cpush"):
    """The wgmma logits for M tokens: 64 weight rows, one CTA per SM, fresh accumulators per k-tile;
    the split-K partials folded inside each column block's cluster by skinny_gemm's "cpush" (at S =
    min(S, 8), the most a cluster holds; fp32 logits out, nothing for the top-k kernel to fold), or
    (fold "partials") written for the top-k kernel to fold; None where it does not apply (M over 64,
    E not a multiple of 64)."""
    if not (1 <= M <= 64 and wgmma.supports(D) and E % 64 == 0):
        return None
    for c in wgmma.configs_for(E, D, wgmma.m_pad_for(M)):
        if (c.rows, c.occupancy) == (64, 1):
            c = dataclasses.replace(c, fresh_acc=True)
            if c.ksplit == 1:
                return c
            if fold == "cpush":
                return wgmma.with_fold(c, "cpush", min(c.ksplit, wgmma.MAX_CLUSTER))
            return dataclasses.replace(c, fold="partials")
    return None


def logits_config(M: int, E: int, D: int):
    if M > SIMT_MAX:
        cfg = wgmma_logits_config(M, E, D) or mma_logits_config(M, E, D)
        if cfg is not None:
            return cfg
    return sg.simt_config(max(M, 1), E, D)


def partials(gemm) -> int:
    """Logit partials the top-k kernel folds: the split-K S of the mma.sync kernel and of the wgmma
    kernel's "partials" fold (the SIMT GEMV has none)."""
    if isinstance(gemm, SkinnyGemmMmaConfig) or (isinstance(gemm, wgmma.SkinnyGemmWgmmaConfig)
                                                 and gemm.writes_partials):
        return gemm.ksplit
    return 1


@dataclass(frozen=True)
class RouterTopkConfig:
    tokens_per_cta: int = 1          # tokens per CTA
    gemm: object = None              # logits GEMM config; None: logits_config(M, E, D)
    warps_per_token: int = 4         # 1: a warp per token; 4: a token's experts over 128 threads
    select: str = "threshold"        # "threshold": rank the experts above a bound; "rounds": k argmax rounds

    @property
    def name(self) -> str:
        base = (f"warp_argmax_t{self.tokens_per_cta}" if self.warps_per_token == 1
                else f"cta_argmax_w{self.warps_per_token}")
        if self.select == "threshold":
            base = f"cta_thresh_w{self.warps_per_token}"
        return base + (f"+{self.gemm.name}" if self.gemm is not None else "")


def all_configs() -> list[RouterTopkConfig]:
    """The default (threshold select over 4 warps), the argmax rounds over 4 warps, and the rounds
    with one warp per token (4 tokens or 1 per CTA)."""
    return [RouterTopkConfig(1, None, 4), RouterTopkConfig(1, None, 4, select="rounds"),
            RouterTopkConfig(4, None, 1, select="rounds"), RouterTopkConfig(1, None, 1, select="rounds")]


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs: every top-k kernel with the
    default logits GEMM, and the default top-k with each other logits path this M allows (the SIMT
    GEMV, the split-K mma.sync kernel, the wgmma kernel)."""
    M, D = tensors["x"].shape
    E = tensors["w_gate"].shape[0]
    default = logits_config(M, E, D)
    paths = [sg.simt_config(max(M, 1), E, D), mma_logits_config(M, E, D), wgmma_logits_config(M, E, D),
             wgmma_logits_config(M, E, D, "partials")]
    return all_configs() + [RouterTopkConfig(1, g, 4) for g in paths if g is not None and g != default]


class RouterTopk:
    def __init__(self, E: int, top_k: int, cfg: RouterTopkConfig, S: int = 1):
        if not 1 <= top_k <= min(32, E):
            raise ValueError(f"top_k: {top_k} must be in 1..{min(32, E)} for the warp kernel")
        if cfg.warps_per_token not in (1, 2, 4, 8) or (cfg.warps_per_token > 1 and cfg.tokens_per_cta != 1):
            raise ValueError(f"variant: {cfg}: warps_per_token in 1, 2, 4, 8; several warps need one token per CTA")
        if cfg.select not in ("rounds", "threshold") or (cfg.select == "threshold" and cfg.tokens_per_cta != 1):
            raise ValueError(f"variant: {cfg}: select is 'rounds' or 'threshold' (one token per CTA)")
        self.E, self.k, self.cfg, self.S = E, top_k, cfg, S

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        tpc, wpt = self.cfg.tokens_per_cta, self.cfg.warps_per_token

        @cute.jit
        def host(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                 routed_scale: cutlass.Float32, stream):
            B = mLogit.shape[1]
            kernel(mLogit, mBias, mIds, mW, routed_scale).launch(
                grid=[(B + tpc - 1) // tpc, 1, 1], block=[32 * tpc * wpt, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32
        c = self.cfg
        select = make_select(self.E, self.k, self.S, c.tokens_per_cta, c.warps_per_token, c.select)

        @cute.kernel
        def kernel(mLogit: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor,
                   routed_scale: Float32):
            bidx, _, _ = cute.arch.block_idx()
            select(mLogit, mBias, mIds, mW, routed_scale, bidx)

        return kernel


@runtime.compile_cache("router_topk")
def _compile(E: int, top_k: int, tokens_per_cta: int, S: int, warps_per_token: int, select: str):
    cutlass, _ = runtime.cutlass_modules()
    b = runtime.sym_int()
    op = RouterTopk(E, top_k, RouterTopkConfig(tokens_per_cta, None, warps_per_token, select), S)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor("float32", (S, b, E), align=4),
        runtime.fake_tensor("float32", (E,), align=4),
        runtime.fake_tensor("int64", (b, top_k), align=8),
        runtime.fake_tensor("float32", (b, top_k), align=4),
        cutlass.Float32(1.0))


def compile_all_for(dtype: str, E: int, D: int, top_k: int, cfg: RouterTopkConfig) -> list:
    """Every compiled function a launch with this top-k config can use, for any M (CPU compile checks):
    the SIMT GEMV, the split-K mma.sync and wgmma logits of each token bucket, and the top-k kernels."""
    tk = (cfg.tokens_per_cta, cfg.warps_per_token, cfg.select)
    out = [sg._compile(dtype, "float32", E, D, sg.simt_config(1, E, D)), _compile(E, top_k, tk[0], 1, *tk[1:])]
    for M in (8, 16, 32, 64):
        gs = [mma_logits_config(M, E, D), wgmma_logits_config(M, E, D), wgmma_logits_config(M, E, D, "partials")]
        for g in (g for g in gs if g is not None):
            out += [sg._compile(dtype, "float32", E, D, g), _compile(E, top_k, tk[0], partials(g), *tk[1:])]
    return out


def logits_workspace(B: int, E: int, D: int, device, gemm=None):
    S = partials(gemm or logits_config(B, E, D))
    return torch.empty(S, B, E, dtype=torch.float32, device=device)


def launch(x, w_gate, bias, top_k, routed_scale, ids, weights, logits, variant=None) -> None:
    """logits: fp32 [S, B, E] from logits_workspace (S given by the logits GEMM config)."""
    B, D = x.shape
    E = w_gate.shape[0]
    if B == 0:
        return
    variant = variant or RouterTopkConfig()
    gemm = variant.gemm or logits_config(B, E, D)
    S = partials(gemm)
    if logits.shape != (S, B, E):
        raise ValueError(f"logits: expected the workspace [{S}, {B}, {E}], got {tuple(logits.shape)}")
    sg.launch(x, w_gate, logits if S > 1 else logits[0], gemm)
    fn = _compile(E, top_k, variant.tokens_per_cta, S, variant.warps_per_token, variant.select)
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
    logits = logits_workspace(B, E, x.shape[1], x.device, variant.gemm if variant is not None else None)
    if variant is not None:
        launch(x.contiguous(), w_gate.contiguous(), bias.contiguous(), top_k, routed_scale,
               ids, weights, logits, variant)
    else:
        _custom_op()(x, w_gate, bias, top_k, float(routed_scale), ids, weights, logits)
    return ids, weights
