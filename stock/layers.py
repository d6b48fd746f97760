"""The stock K3 layer step: references.layers' math and rounding points, batched and sync-free.

One decode step (`StockLayer.step`) runs only device-side torch ops on static shapes: no .item(), no
int()/bool() of a tensor, no nonzero, no host-built tensor, no Python branch on a tensor's value, so
it can be captured in a CUDA graph and replayed. Checks (shapes, dtypes, page room in block_table)
live in `validate_state`, run once before the steps, outside any capture.

Kernels, as a serving engine without custom fusion composes them:
  GEMMs        torch.nn.functional.linear / torch.bmm in the working dtype (cuBLAS on CUDA: fp32
               accumulation, one rounding to wd, as references.primitives.linear)
  router       fp32 logits GEMM (router weight converted once at prepare), sigmoid + bias, torch.topk on
               an int64 key (choice bits, then the lower expert id): the reference's tie order
  experts      the chosen (token, slot) pairs' MXFP4 weights gathered on the device, dequantised by one
               table lookup (each (scale byte, code) value rounded once to wd: the reference's exact
               dequant), two batched GEMMs, SiTU in fp32, the weighted combine in fp32
  KDA          the short conv, gate and gated norm in torch; the recurrence through fla-core's
               fused_recurrent_kda on CUDA when importable, else in torch (fp32, V-first state)
  MLA          paged latent attention through FlashMLA's Hopper kernel (stock.flashmla: its split
               scheduler reads seq_lens on the device) on sm_90 where its library is built and the
               shapes are its own (576-wide keys, pages of 64), as vLLM decodes MLA on Hopper; else in
               torch over every page of block_table, masked on the device by seq_lens (no
               per-sequence loop), scores and softmax in fp32
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from references.config import K3Config, get_config
from references.layers import attn_res_layout, check_layer_idx, kda_kind_of, layer_kind_of, stacked_ids
from references.mxfp4 import E2M1_LUT, GROUP, scale_values
from references.primitives import FLOAT_DTYPES, check_tensor
from references.weights import FP32_PARAMS, MXFP4_PARAMS
from stock.sm90 import capturing  # noqa: F401  (fused.layers calls stock.capturing)

RENORM_EPS = 1e-20                # references.moe.RENORM_EPS
DEQUANT_CHUNK_ELEMS = 1 << 30     # dequantised expert elements per batched chunk (K3: 32 pairs, ~7 GB transient)
# Declared scope (verify.plan.scope): the K3 serving dtype. On the CPU, fp32 GEMM bits depend on the
# intra-op thread count (guard:thread_count) and fp16 GEMMs sum in another order than the reference.
DTYPES = ("bfloat16",)


# ---------------------------------------------------------------------------------------------- prepare
@dataclass
class StockLayer:
    """One layer prepared for stepping: weights contiguous on their device, the router weight in fp32,
    the MXFP4 dequant table; `layer_idx` fixes the AttnRes layout (blocks before, push or not)."""
    kind: str
    cfg: K3Config
    layer_idx: int
    wd: torch.dtype
    w: dict
    dequant_table: torch.Tensor | None     # [256 * 16] wd: value of (scale byte << 4 | code)
    use_fla: bool
    use_flashmla: bool = False
    scratch: dict = field(default_factory=dict)     # FlashMLA's buffers per (B, H, dtype, device)

    def step(self, prefix: torch.Tensor, blocks: torch.Tensor, *state: torch.Tensor,
             routing: list | None = None, peers: tuple | None = None) -> torch.Tensor:
        """One decode step; state tensors updated in place. Returns the new prefix (the next layer's h);
        appends the step's expert ids [B,k] to `routing` when given (MoE layers). peers: (peer_attn,
        peer_mlp), the other ranks' partials when this layer is one rank's shards (allreduce)."""
        return STEPS[self.kind](self, prefix, blocks, *state, routing=routing, peers=peers)


@functools.cache
def dequant_table(wd: torch.dtype, device: torch.device) -> torch.Tensor:
    """[4096] wd: entry (s << 4) | c = E2M1[c] * 2^(s-127), exact in float64, rounded once to wd. One
    read-only table per dtype and device, made on the first call: a later prepare inside a CUDA graph
    capture (the harness captures a whole registry call) then copies nothing from the host."""
    values = E2M1_LUT[None, :] * scale_values(torch.arange(256, dtype=torch.uint8))[:, None]
    return values.reshape(-1).to(wd).to(device)


def fla_available(device) -> bool:
    """fla-core's Triton KDA runs only on CUDA; a CPU-run stock layer never imports it."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from fla.ops.kda import fused_recurrent_kda  # noqa: F401
    except Exception:  # noqa: BLE001  (missing package, or triton without a usable device)
        return False
    return True


def flashmla_available(device, cfg: K3Config, wd: torch.dtype) -> bool:
    """FlashMLA's dense decode (stock.flashmla) runs here: CUDA sm_90, its library built, bf16 / fp16, and
    the config's latent, rope and page sizes its own (K3's)."""
    if torch.device(device).type != "cuda" or wd not in (torch.bfloat16, torch.float16):
        return False
    from stock import flashmla

    if (cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_dim, cfg.page_size) != \
            (flashmla.HEAD_DIM_V, flashmla.HEAD_DIM_K, flashmla.PAGE):
        return False
    try:
        flashmla._lib()
    except (ImportError, OSError):
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def prepare(kind: str, weights: dict, config: str | K3Config, layer_idx: int, wd: torch.dtype,
            use_fla: bool | None = None, use_flashmla: bool | None = None) -> StockLayer:
    """Make the layer's step-ready form once (outside any captured step)."""
    if kind not in ("kda", "mla", "dense"):
        raise ValueError(f"kind: {kind!r} is not a stock layer kind; use 'kda', 'mla' or 'dense'")
    cfg = get_config(config) if isinstance(config, str) else config
    check_layer_idx(layer_idx)
    if layer_kind_of(layer_idx) != kind:
        raise ValueError(f"layer_idx: K3 layer {layer_idx} is a {layer_kind_of(layer_idx)!r} layer, not {kind!r}")
    w = {n: t.contiguous() for n, t in weights.items()}
    for name, t in w.items():
        want = (torch.uint8,) if name in MXFP4_PARAMS else (torch.float32, torch.float64) if name in FP32_PARAMS \
            else (wd,)
        check_tensor(f"weights[{name!r}]", t, dtypes=want)
    acc = torch.float64 if wd == torch.float64 else torch.float32
    if kind != "dense":
        w["w_router_acc"] = w["w_router"].to(acc)
    device = next(iter(w.values())).device
    if use_fla is None:
        use_fla = fla_available(device) and cfg.l2_eps == 1e-6     # fla's in-kernel L2 norm eps
    if use_flashmla is None:
        use_flashmla = kind == "mla" and flashmla_available(device, cfg, wd)
    return StockLayer(kind, cfg, layer_idx, wd, w, dequant_table(wd, device), use_fla, use_flashmla)


# ---------------------------------------------------------------------------------------------- small ops
def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in acc (torch's rms_norm), round to wd, multiply by the weight in wd."""
    y = F.rms_norm(x.to(_acc(x)), (x.shape[-1],), eps=eps)
    return weight.to(x.dtype) * y.to(x.dtype)


def situ_and_mul(x: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    d = x.shape[-1] // 2
    gate, up = x[..., :d].to(_acc(x)), x[..., d:].to(_acc(x))
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))
            ).to(x.dtype)


def attn_res_mix_norm(sources: torch.Tensor, res_norm_w, res_proj_w, norm_w, eps: float) -> torch.Tensor:
    """AttnRes softmax mix of sources[B,S,D] in acc (keys RMS-normalised, query = norm_w * proj_w), one
    rounding to wd, then the RMSNorm."""
    v = sources.to(_acc(sources))
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    query = res_norm_w.to(v.dtype) * res_proj_w.to(v.dtype)
    probs = (keys * query).sum(-1).softmax(-1)                              # [B, S]
    mixed = torch.bmm(probs.unsqueeze(1), v).squeeze(1).to(sources.dtype)
    return rms_norm(mixed, norm_w, eps)


# ---------------------------------------------------------------------------------------------- LatentMoE
def router(layer: StockLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids[B,k], weights[B,k] acc): top-k of sigmoid(fp32 logits) + bias, descending, lower id first
    on equal choice scores (torch.topk over a key that orders by choice bits, then by -id)."""
    w, cfg = layer.w, layer.cfg
    s = torch.sigmoid(F.linear(x.to(w["w_router_acc"].dtype), w["w_router_acc"]))
    choice = s + w["router_bias"].to(s.dtype)
    E = choice.shape[-1]
    if choice.dtype == torch.float32:
        bits = choice.view(torch.int32)
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)   # monotone in the float
        lower_first = (E - 1) - torch.arange(E, device=choice.device, dtype=torch.int64)
        ids = torch.topk((ordered << 32) | lower_first, cfg.top_k, dim=-1, sorted=True).indices
    else:                                                                        # the float64 oracle form
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]
    sw = s.gather(1, ids)
    return ids, sw / (sw.sum(-1, keepdim=True) + RENORM_EPS) * cfg.routed_scale


def dequant_experts(layer: StockLayer, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed[P, O, I/2], scale[P, O, I/32] uint8 -> [P, O, I] wd, one table lookup per element."""
    P, O, half = packed.shape
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(P, O, half * 2 // GROUP, GROUP)
    index = (scale.to(torch.int32).unsqueeze(-1) << 4) | codes.to(torch.int32)
    return layer.dequant_table.index_select(0, index.reshape(-1)).view(P, O, half * 2)


def expert_outputs(layer: StockLayer, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """o[B,k,L] wd = E_ids[b,j](z[b]) for every (token, slot) pair: the pair's expert weights gathered and
    dequantised, both GEMMs batched over the pairs (chunks bound the dequantised bytes)."""
    w, cfg = layer.w, layer.cfg
    B, k = ids.shape
    L, two_i = z.shape[1], w["w13_packed"].shape[1]
    flat = ids.reshape(-1)
    rows = z.unsqueeze(1).expand(B, k, L).reshape(B * k, L)                   # pair p = (p // k, p % k)
    chunk = max(1, DEQUANT_CHUNK_ELEMS // (3 * (two_i // 2) * L))
    outs = []
    for lo in range(0, B * k, chunk):
        e = flat[lo:lo + chunk]
        w13 = dequant_experts(layer, w["w13_packed"][e], w["w13_scale"][e])     # [c, 2I, L]
        w2 = dequant_experts(layer, w["w2_packed"][e], w["w2_scale"][e])        # [c, L, I]
        h = torch.bmm(rows[lo:lo + chunk].unsqueeze(1), w13.transpose(1, 2))   # [c, 1, 2I] wd
        a = situ_and_mul(h, cfg.situ_beta, cfg.situ_linear_beta)
        outs.append(torch.bmm(a, w2.transpose(1, 2)).squeeze(1))               # [c, L] wd
    return torch.cat(outs).view(B, k, L)


def routed_experts(layer: StockLayer, z: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
    """y[b] = wd(sum_j route_w[b,j] * E_ids[b,j](z[b])), the weighted sum in acc, rounded once."""
    acc = _acc(z)
    return (route_w.to(acc).unsqueeze(-1) * expert_outputs(layer, z, ids).to(acc)).sum(1).to(z.dtype)


def allreduce(own: torch.Tensor, peers: torch.Tensor | None) -> torch.Tensor:
    """A rank's all-reduce in one process: its partial and the other ranks' (peers[T-1,...]) summed in
    acc, rounded once (NCCL's sum, the peers' contributions given); own itself when unsplit."""
    if peers is None:
        return own
    return torch.cat([own.unsqueeze(0), peers]).to(_acc(own)).sum(0).to(own.dtype)


def latent_moe(layer: StockLayer, x: torch.Tensor, routing: list | None = None,
               peers: torch.Tensor | None = None) -> torch.Tensor:
    """The LatentMoE; peers[T-1,B,L+D]: the other ranks' latent and shared-experts partials, reduced
    with this rank's in one all-reduce (as K3 sends them)."""
    w, cfg = layer.w, layer.cfg
    ids, route_w = router(layer, x)
    if routing is not None:
        routing.append(ids)
    y = routed_experts(layer, F.linear(x, w["w_latent_down"]), ids, route_w)
    shared = F.linear(situ_and_mul(F.linear(x, w["w_shared_gate_up"]), cfg.situ_beta, cfg.situ_linear_beta),
                      w["w_shared_down"])
    if peers is not None:
        both = allreduce(torch.cat([y, shared], -1), peers)
        y, shared = both[:, :cfg.latent], both[:, cfg.latent:]
    return F.linear(rms_norm(y, w["latent_norm_w"], cfg.rms_eps), w["w_latent_up"]) + shared


# ---------------------------------------------------------------------------------------------- attention
def kda_attention(layer: StockLayer, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """in_proj GEMM, f_a/f_b, short conv + SiLU, gate, delta-rule recurrence, gated RMSNorm, o_proj."""
    w, cfg = layer.w, layer.cfg
    B, H, Dh, r = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.f_rank
    C, wd = H * Dh, x.dtype
    merged = F.linear(x, w["w_in"])                                       # q | k | v | z | f_a | beta
    raw = merged[:, :3 * C].view(B, 3, C)
    z = merged[:, 3 * C:4 * C]
    g_raw = F.linear(merged[:, 4 * C:4 * C + r], w["w_fb"])
    beta_raw = merged[:, 4 * C + r:]
    window = torch.cat([conv_state, raw.unsqueeze(-1)], dim=-1)           # [B, 3, C, W]
    acc = _acc(x)
    conv = F.silu((window.to(acc) * w["conv_w"].to(acc)).sum(-1)).to(wd)  # [B, 3, C] wd
    conv_state.copy_(window[..., 1:])
    if layer.use_fla:
        o = _fla_recurrence(layer, conv, g_raw, beta_raw, state)
    else:
        o = _torch_recurrence(layer, conv, g_raw, beta_raw, state)
    o32 = o.to(acc)
    y = (F.rms_norm(o32, (Dh,), eps=cfg.rms_eps) * w["o_norm_w"].to(acc)
         * torch.sigmoid(z.view(B, H, Dh).to(acc))).to(wd).reshape(B, C)
    return F.linear(y, w["w_o"])


def _torch_recurrence(layer, conv, g_raw, beta_raw, state) -> torch.Tensor:
    """The gated delta rule in acc on the V-first state; o rounded to wd (as fla stores it)."""
    w, cfg = layer.w, layer.cfg
    B, H, Dh = conv.shape[0], cfg.n_heads, cfg.head_dim
    acc = state.dtype
    q, k, v = (conv[:, i].to(acc).view(B, H, Dh) for i in range(3))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + cfg.l2_eps) * Dh ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + cfg.l2_eps)
    A = w["A_log"].to(acc).exp().view(H, 1)
    alpha = (cfg.gate_lower_bound * torch.sigmoid(A * (g_raw.view(B, H, Dh).to(acc) + w["dt_bias"].to(acc).view(H, Dh)))
             ).exp()
    beta = torch.sigmoid(beta_raw.to(acc))
    decayed = state * alpha.unsqueeze(-2)
    u = beta.unsqueeze(-1) * (v - torch.matmul(decayed, k.unsqueeze(-1)).squeeze(-1))
    state.copy_(decayed + u.unsqueeze(-1) * k.unsqueeze(-2))
    return torch.matmul(state, q.unsqueeze(-1)).squeeze(-1).to(conv.dtype)


def _fla_recurrence(layer, conv, g_raw, beta_raw, state) -> torch.Tensor:
    """fla-core's fused_recurrent_kda on one token per sequence (L2 norm, lower-bound gate and sigmoid
    beta in the kernel, V-first fp32 state); the final state copied back into `state`."""
    from fla.ops.kda import fused_recurrent_kda

    w, cfg = layer.w, layer.cfg
    B, H, Dh = conv.shape[0], cfg.n_heads, cfg.head_dim
    q, k, v = (conv[:, i].reshape(B, 1, H, Dh) for i in range(3))
    o, final = fused_recurrent_kda(
        q, k, v, g_raw.view(B, 1, H, Dh), beta_raw.reshape(B, 1, H), A_log=w["A_log"], dt_bias=w["dt_bias"],
        scale=Dh ** -0.5, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=float(cfg.gate_lower_bound),
        state_v_first=True)
    state.copy_(final)
    return o.view(B, H, Dh)


def mla_attention(layer: StockLayer, x: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor) -> torch.Tensor:
    """qkv_a GEMM + latent norms, q_b + W_UK absorb (bmm), the latent written at seq_lens' slot, paged
    attention over the first seq_lens + 1 tokens (FlashMLA where it runs, else torch over every page of
    block_table), W_UV (bmm), the output gate, o_proj. seq_lens advanced by one (in place)."""
    w, cfg = layer.w, layer.cfg
    B, H, Dh, ql, kv = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    wd, acc, page = x.dtype, _acc(x), cache.shape[1]
    qkv = F.linear(x, w["w_qkv_a"])
    q_c = rms_norm(qkv[:, :ql], w["q_a_norm_w"], cfg.mla_latent_eps)
    kv_c = rms_norm(qkv[:, ql:ql + kv], w["kv_a_norm_w"], cfg.mla_latent_eps)
    q = F.linear(q_c, w["w_q_b"]).view(B, H, -1)
    q_nope = torch.bmm(q[..., :Dh].transpose(0, 1), w["w_uk"]).transpose(0, 1)       # [B, H, kv] wd
    q_abs = torch.cat([q_nope, q[..., Dh:]], dim=-1)
    pos = seq_lens.long()
    page_ids = block_table.long().gather(1, (pos // page).unsqueeze(1)).squeeze(1)
    cache[page_ids, pos % page] = torch.cat([kv_c, qkv[:, ql + kv:]], dim=-1)
    if layer.use_flashmla:             # FlashMLA reads the new lengths on the device
        seq_lens.add_(1)
        o_lat = flashmla_attention(layer, q_abs, cache, block_table, seq_lens)
    else:                              # (pos may alias an int64 seq_lens: read before the advance)
        o_lat = paged_latent_attention(q_abs, cache, block_table, pos + 1, cfg.mla_scale, kv)   # [B, H, kv]
        seq_lens.add_(1)
    o = torch.bmm(o_lat.transpose(0, 1), w["w_uv"].transpose(1, 2)).transpose(0, 1).reshape(B, H * Dh)
    gate = torch.sigmoid(F.linear(x, w["w_g"]).to(acc)).to(wd)
    return F.linear((o.to(acc) * gate.to(acc)).to(wd), w["w_o"])


def flashmla_attention(layer: StockLayer, q_abs: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                       lens: torch.Tensor) -> torch.Tensor:
    """o_latent[B,H,kv] wd of one query token per sequence over its first lens[b] slots, by FlashMLA (its
    scheduler, split-KV attention and combine: three launches); its buffers made on the first call."""
    from stock import flashmla

    B, H, C = q_abs.shape
    key = (B, H, q_abs.dtype, q_abs.device)
    if key not in layer.scratch:
        flashmla._check(q_abs.view(B, 1, H, C), cache, layer.cfg.kv_lora_rank)
        layer.scratch[key] = flashmla.Plan.make(B, 1, H, q_abs.dtype, q_abs.device)
    q, kv, table, lens = flashmla.operands(q_abs.reshape(B, 1, H, C), cache, block_table, lens)
    flashmla.launch(layer.scratch[key], q, kv, table, lens, layer.cfg.mla_scale, schedule=True)
    return layer.scratch[key].out.view(B, H, layer.cfg.kv_lora_rank)


def paged_latent_attention(q_abs: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                           lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """o_latent[B,H,kv] wd: one query token per sequence over every page of block_table, masked on the
    device to the first lens[b] tokens (no per-sequence loop, no host read), scores and softmax in acc."""
    B, acc = q_abs.shape[0], _acc(q_abs)
    table = block_table.long().clamp(min=0)
    keys = cache[table].reshape(B, -1, cache.shape[-1])                              # [B, pages*page, C]
    visible = torch.arange(keys.shape[1], device=q_abs.device).unsqueeze(0) < lens.long().unsqueeze(1)
    keys = torch.where(visible.unsqueeze(-1), keys.to(acc), 0.0)                     # unwritten slots may hold NaN
    s = torch.bmm(q_abs.to(acc), keys.transpose(1, 2)) * scale                       # [B, H, T]
    p = s.masked_fill(~visible.unsqueeze(1), float("-inf")).softmax(-1)
    return torch.bmm(p, keys[..., :kv_lora_rank]).to(q_abs.dtype)


# ---------------------------------------------------------------------------------------------- one step
def _attn_side(layer: StockLayer, prefix: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(normed x, the prefix after the attn side, blocks the mlp side sees); a push writes blocks[:, n]."""
    w, eps = layer.w, layer.cfg.rms_eps
    n_blocks, push = attn_res_layout(layer.layer_idx, layer.cfg.attn_res_block)
    x = attn_res_mix_norm(torch.cat([blocks[:, :n_blocks], prefix.unsqueeze(1)], dim=1), w["attn_res_norm_w"],
                          w["attn_res_proj_w"], w["input_norm_w"], eps)
    if push:
        blocks[:, n_blocks] = prefix
        return x, torch.zeros_like(prefix), n_blocks + 1
    return x, prefix, n_blocks


def dense_mlp(layer: StockLayer, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's dense MLP: gate_up GEMM, SiTU-and-mul, down GEMM (the shared experts' math)."""
    w, cfg = layer.w, layer.cfg
    return F.linear(situ_and_mul(F.linear(x, w["w_dense_gate_up"]), cfg.situ_beta, cfg.situ_linear_beta),
                    w["w_dense_down"])


def _mlp_side(layer: StockLayer, prefix: torch.Tensor, attn: torch.Tensor, blocks: torch.Tensor,
              n_blocks: int, routing: list | None = None, peers: tuple | None = None) -> torch.Tensor:
    w, eps = layer.w, layer.cfg.rms_eps
    peer_attn, peer_mlp = peers or (None, None)
    p = prefix + allreduce(attn, peer_attn)                                       # one wd rounding
    h = attn_res_mix_norm(torch.cat([blocks[:, :n_blocks], p.unsqueeze(1)], dim=1), w["mlp_res_norm_w"],
                          w["mlp_res_proj_w"], w["post_norm_w"], eps)
    if layer.kind == "dense":
        return p + allreduce(dense_mlp(layer, h), peer_mlp)
    return p + latent_moe(layer, h, routing, peer_mlp)


def kda_step(layer: StockLayer, prefix, blocks, conv_state, recurrent_state, routing: list | None = None,
             peers: tuple | None = None) -> torch.Tensor:
    """One KDA layer step: prefix[B,D] is the layer input h; returns the new prefix."""
    x, p, n = _attn_side(layer, prefix, blocks)
    return _mlp_side(layer, p, kda_attention(layer, x, conv_state, recurrent_state), blocks, n, routing, peers)


def mla_step(layer: StockLayer, prefix, blocks, cache, block_table, seq_lens, routing: list | None = None,
             peers: tuple | None = None) -> torch.Tensor:
    """One gated-MLA layer step; the token's latent goes to the slot of seq_lens in block_table."""
    x, p, n = _attn_side(layer, prefix, blocks)
    return _mlp_side(layer, p, mla_attention(layer, x, cache, block_table, seq_lens), blocks, n, routing, peers)


STEPS = {"kda": kda_step, "dense": kda_step, "mla": mla_step}      # dense: _mlp_side takes the dense MLP


# ---------------------------------------------------------------------------------------------- validation
def validate_state(layer: StockLayer, prefix: torch.Tensor, blocks: torch.Tensor, state: dict, n_steps: int) -> None:
    """Every check the steps leave out, made once before them (host reads allowed here): shapes and
    dtypes as references.layers.check_layer_args, and for MLA a valid cache page for each of the next
    n_steps tokens of every sequence (the reference's next_slots check, for all steps at once). While a
    CUDA graph is captured only the shape and dtype checks run."""
    from references.layers import LayerState, check_layer_args
    from references.weights import LayerWeights

    check_layer_args(LayerWeights(layer.kind, layer.cfg, layer.wd, layer.w), LayerState(prefix, blocks, **state),
                     layer.kind)
    if layer.kind != "mla" or capturing():
        return
    cache, table, seq_lens = state["cache"], state["block_table"], state["seq_lens"]
    page, n_pages = cache.shape[1], cache.shape[0]
    last = seq_lens.long() + (n_steps - 1)
    if bool((seq_lens < 0).any()):
        raise ValueError(f"state.seq_lens: lengths must be >= 0, got {seq_lens.tolist()}")
    if int(last.max()) // page >= table.shape[1]:
        b = int(torch.argmax((last // page >= table.shape[1]).int()))
        raise ValueError(f"state.block_table: sequence {b} runs out of pages within {n_steps} steps "
                         f"({int(last[b]) + 1} tokens, {table.shape[1]} pages of {page}); give it more pages")
    pos = seq_lens.long().unsqueeze(1) + torch.arange(n_steps, device=seq_lens.device)
    pages = table.long().gather(1, pos // page)
    bad = (pages < 0) | (pages >= n_pages)
    if bool(bad.any()):
        b, t = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"state.block_table: sequence {b} writes position {int(pos[b, t])} to page "
                         f"{int(pages[b, t])}, outside the cache of {n_pages} pages; assign it a page in "
                         f"0..{n_pages - 1}")


# ---------------------------------------------------------------------------------------------- registry form
def rank_form(config, tp: int, tensors: dict) -> tuple:
    """(config, weights, peers) of a registry call: at tp > 1 one rank's layer (references.layers_tp):
    the rank config, the tensors less the peer partials, and those (peer_attn, peer_mlp) [N,T-1,B,*]."""
    cfg = get_config(config) if isinstance(config, str) else config
    if tp == 1:
        return cfg, tensors, None
    from references.layers_tp import rank_config, split_rank_tensors

    weights, peers = split_rank_tensors(tensors, tp)
    return rank_config(cfg, tp), weights, peers


def run_steps(kind: str, x_steps, blocks, state: dict, layer_idx, config, weights: dict,
              prepare_fn=None, tp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The registry form of any prepared layer (`prepare_fn(kind, weights, config, layer_idx, wd)`,
    this module's by default): validate once, then one step per x_steps[t]; (prefix_steps[N,B,D],
    router_ids[N,B,k] int64: each step's experts, [N,B,0] for the dense layer). The steps update dense
    working copies of state tensors given as strided or offset views, written back at the end, so the
    kernels a layer runs (and so its bits) do not depend on the caller's layout: a fused kernel that
    refuses a strided state would otherwise hand its op to a torch stand-in for that call only.
    tp > 1: one rank's layer (rank_form), each step given its peers' partials."""
    check_tensor("x_steps", x_steps, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("blocks", blocks, ndim=3, dtypes=(x_steps.dtype,))
    config, weights, peers = rank_form(config, tp, weights)
    layer = (prepare_fn or prepare)(kind, weights, config, layer_idx, x_steps.dtype)
    blocks = blocks.contiguous().clone()          # the working copy: the registry's blocks is a plain input
    work = {n: t.contiguous() for n, t in state.items()}
    validate_state(layer, x_steps[0], blocks, work, x_steps.shape[0])
    routing: list = []
    out = torch.stack([layer.step(x, blocks, *work.values(), routing=routing,
                                  **({} if peers is None else {"peers": (peers[0][t], peers[1][t])}))
                       for t, x in enumerate(x_steps)])
    for n, t in state.items():
        if work[n] is not t:
            t.copy_(work[n])
    return out, stacked_ids(routing, x_steps)


def kda_layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                    **weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """references.layers.kda_layer_steps through the stock step: (prefix_steps, router_ids); conv_state and
    recurrent_state updated in place."""
    return run_steps(kda_kind_of(layer_idx), x_steps, blocks,
                     {"conv_state": conv_state, "recurrent_state": recurrent_state}, layer_idx, config, weights,
                     tp=tp)


def mla_layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                    **weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """references.layers.mla_layer_steps through the stock step: (prefix_steps, router_ids); cache written and
    seq_lens advanced by N in place."""
    return run_steps("mla", x_steps, blocks, {"cache": cache, "block_table": block_table, "seq_lens": seq_lens},
                     layer_idx, config, weights, tp=tp)


def layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                **tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both registry forms under one name, told apart by their state (`cache` = MLA), so one
    `--candidate stock.layers:layer_steps` certifies kda_layer and mla_layer in one run."""
    return registry_steps(x_steps, blocks, layer_idx, config, tensors, tp=tp)


REGISTRY_STATE = {"mla": ("cache", "block_table", "seq_lens"), "kda": ("conv_state", "recurrent_state")}


def registry_steps(x_steps, blocks, layer_idx: int, config: str, tensors: dict, prepare_fn=None, tp: int = 1):
    """run_steps over the layer whose registry tensors these are (`cache` = MLA, else KDA), prepared by
    prepare_fn (this module's by default); a missing state tensor is named in one line."""
    family = "mla" if "cache" in tensors else "kda"
    missing = [n for n in REGISTRY_STATE[family] if n not in tensors]
    if missing:
        raise TypeError(f"{family}_layer steps: missing state tensor(s) {', '.join(missing)}")
    state = {n: tensors[n] for n in REGISTRY_STATE[family]}
    weights = {n: t for n, t in tensors.items() if n not in state}
    kind = "mla" if family == "mla" else kda_kind_of(layer_idx)
    return run_steps(kind, x_steps, blocks, state, layer_idx, config, weights, prepare_fn, tp)


# ---------------------------------------------------------------------------------------------- one-step launch
def step_launch(kind: str, tensors: dict, params: dict, graph: bool | None = None, prepare_fn=None):
    """A zero-argument launch of one decode step on the registry's inputs (x_steps[0], working copies
    of blocks and state), made untimed: prepare and validate here, and on CUDA the step captured in a
    CUDA graph (the launch replays it; graph=False keeps it eager). The launch returns the new prefix
    [B,D]. MLA: seq_lens is put back to its starting value before each step (a device copy inside the
    graph), so repeated launches write the same cache slot instead of running out of pages. The
    prepared layer is the launch's `layer`. params["tp"] > 1: one rank's step (rank_form), given step
    0's peer partials."""
    if kind == "kda":
        kind = kda_kind_of(params["layer_idx"])
    names = ("cache", "block_table", "seq_lens") if kind == "mla" else ("conv_state", "recurrent_state")
    x = tensors["x_steps"][0].contiguous().clone()
    blocks = tensors["blocks"].contiguous().clone()
    state = {n: tensors[n].clone(memory_format=torch.contiguous_format) for n in names}
    config, weights, peers = rank_form(params["config"], params.get("tp", 1),
                                       {n: t for n, t in tensors.items() if n not in (*names, "x_steps", "blocks")})
    peers = None if peers is None else tuple(p[0].contiguous() for p in peers)
    layer = (prepare_fn or prepare)(kind, weights, config, params["layer_idx"], x.dtype)
    validate_state(layer, x, blocks, state, 1)
    start = state["seq_lens"].clone() if kind == "mla" else None

    def step():
        if start is not None:
            state["seq_lens"].copy_(start)
        return layer.step(x, blocks, *state.values(), **({} if peers is None else {"peers": peers}))
    step.layer = layer
    if x.device.type != "cuda" or graph is False:
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # lazy init and autotuning before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    try:
        g = torch.cuda.CUDAGraph(keep_graph=True)      # its nodes stay readable (launch counts)
    except TypeError:                                  # a torch without keep_graph
        g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()

    def replay():
        g.replay()
        return out
    replay.cuda_graph = g
    replay.layer = layer
    return replay


def kda_layer_step_peer(tensors: dict, params: dict):
    """verify.bench peer protocol (prepare(tensors, params) -> launch): one stock KDA layer step, eager
    (the bench's GraphClock captures the launches into its own CUDA graph)."""
    return step_launch("kda", tensors, params, graph=False)


def mla_layer_step_peer(tensors: dict, params: dict):
    """verify.bench peer protocol (prepare(tensors, params) -> launch): one stock MLA layer step, eager
    (the bench's GraphClock captures the launches into its own CUDA graph)."""
    return step_launch("mla", tensors, params, graph=False)
