"""Seeded synthetic weights for one Kimi K3 decoder layer (KDA, MLA, or the layer-0 dense MLP).

Real K3 weights are not needed to certify numerics; these have the checkpoint's shapes and dtypes
(shared/reference/kimi-k3-math.md §0) and are scaled so activations stay O(1) over layers and steps:
  projections  normal, std fan_in^-1/2 (fan_in = the summed dimension)
  RMSNorm / o_norm / latent norm weights  1 + 0.1 N(0,1)  (near 1; a dropped weight still shows)
  AttnRes pseudo-query res_proj_w  std 2 D^-1/2, so scores are O(1): neither uniform nor one-hot
  KDA A_log = log U(1, 16), dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]  (fla init ranges)
  KDA conv weights  std W^-1/2
  router bias  0.01 N(0,1) (fp32; small next to the sigmoid scores it shifts)
  routed experts  normal draw (std fan_in^-1/2) quantised with references.mxfp4.quantize_mxfp4_ocp
Every tensor draws from its own generator salted by its name (a new tensor never shifts another's
values), always in float64, then rounds once to its storage dtype: the same seed gives the same bits.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from references.config import K3Config
from references.kda import in_proj_layout
from references.mxfp4 import quantize_mxfp4_ocp

LAYER_KINDS = ("kda", "mla", "dense")      # dense = layer 0: KDA attention + dense MLP
# fp32 in the checkpoint (and in the kernels) whatever the working dtype; float64 for the oracle.
FP32_PARAMS = frozenset({"conv_w", "A_log", "dt_bias", "o_norm_w", "router_bias"})
MXFP4_PARAMS = frozenset({"w13_packed", "w13_scale", "w2_packed", "w2_scale"})
WORKING_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _gen(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def _normal(seed: int, name: str, shape, std: float) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=_gen(seed, name), dtype=torch.float64) * std


def _near_one(seed: int, name: str, n: int) -> torch.Tensor:
    return 1.0 + _normal(seed, name, (n,), 0.1)


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights: `tensors` maps the names the layer references take to tensors.

    `dtype` is the working dtype of the floating weights; FP32_PARAMS are fp32 (float64 in the
    oracle), MXFP4_PARAMS are uint8.
    """
    kind: str
    config: K3Config
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"weights: a {self.kind} layer has no tensor {name!r}; it has {sorted(self.tensors)}") from None

    def to(self, dtype: torch.dtype) -> "LayerWeights":
        """Cast the floating weights to `dtype`; FP32_PARAMS stay fp32 unless dtype is float64 (oracle)."""
        if dtype not in WORKING_DTYPES:
            raise TypeError(f"dtype: {dtype} is not a working dtype; use one of {[str(d) for d in WORKING_DTYPES]}")
        out = {}
        for name, t in self.tensors.items():
            if not t.is_floating_point():
                out[name] = t
            elif name in FP32_PARAMS and dtype != torch.float64:
                out[name] = t.to(torch.float32)
            else:
                out[name] = t.to(dtype)
        return LayerWeights(self.kind, self.config, dtype, out)


def _attn_res_and_norms(seed: int, D: int) -> dict[str, torch.Tensor]:
    return {
        "attn_res_norm_w": _near_one(seed, "attn_res_norm_w", D),
        "attn_res_proj_w": _normal(seed, "attn_res_proj_w", (D,), 2 * D ** -0.5),
        "input_norm_w": _near_one(seed, "input_norm_w", D),
        "mlp_res_norm_w": _near_one(seed, "mlp_res_norm_w", D),
        "mlp_res_proj_w": _normal(seed, "mlp_res_proj_w", (D,), 2 * D ** -0.5),
        "post_norm_w": _near_one(seed, "post_norm_w", D),
    }


def _kda_attention(seed: int, cfg: K3Config) -> dict[str, torch.Tensor]:
    D, H, Dh, r, W = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.f_rank, cfg.conv_kernel
    C = H * Dh
    rows = in_proj_layout(H, Dh, r)["beta"].stop
    A = 1.0 + 15.0 * torch.rand(H, generator=_gen(seed, "A_log"), dtype=torch.float64)
    log_dt = math.log(1e-3) + torch.rand(C, generator=_gen(seed, "dt_bias"), dtype=torch.float64) * math.log(100.0)
    dt = log_dt.exp()
    return {
        "w_in": _normal(seed, "w_in", (rows, D), D ** -0.5),
        "w_fb": _normal(seed, "w_fb", (C, r), r ** -0.5),
        "conv_w": _normal(seed, "conv_w", (3, C, W), W ** -0.5),
        "A_log": A.log(),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),          # softplus^-1(dt)
        "o_norm_w": _near_one(seed, "o_norm_w", Dh),
        "w_o": _normal(seed, "w_o", (D, C), C ** -0.5),
    }


def _mla_attention(seed: int, cfg: K3Config) -> dict[str, torch.Tensor]:
    D, H, Dh, rope = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.qk_rope_dim
    ql, kv = cfg.q_lora_rank, cfg.kv_lora_rank
    return {
        "w_qkv_a": _normal(seed, "w_qkv_a", (ql + kv + rope, D), D ** -0.5),
        "q_a_norm_w": _near_one(seed, "q_a_norm_w", ql),
        "kv_a_norm_w": _near_one(seed, "kv_a_norm_w", kv),
        "w_q_b": _normal(seed, "w_q_b", (H * (Dh + rope), ql), ql ** -0.5),
        "w_uk": _normal(seed, "w_uk", (H, Dh, kv), kv ** -0.5),     # kv_b_proj rows: fan_in = kv_lora
        "w_uv": _normal(seed, "w_uv", (H, Dh, kv), kv ** -0.5),
        "w_g": _normal(seed, "w_g", (H * Dh, D), D ** -0.5),
        "w_o": _normal(seed, "w_o", (D, H * Dh), (H * Dh) ** -0.5),
    }


def _mxfp4_experts(seed: int, name: str, n_experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """E experts of [rows, cols], each drawn from its own generator (memory: one expert at a time)."""
    packed, scale = [], []
    for e in range(n_experts):
        p, s = quantize_mxfp4_ocp(_normal(seed, f"{name}[{e}]", (rows, cols), cols ** -0.5))
        packed.append(p)
        scale.append(s)
    return torch.stack(packed), torch.stack(scale)


def _latent_moe(seed: int, cfg: K3Config) -> dict[str, torch.Tensor]:
    D, E, I, L, S = cfg.hidden, cfg.n_experts, cfg.moe_inter, cfg.latent, cfg.shared_inter
    w13_packed, w13_scale = _mxfp4_experts(seed, "w13", E, 2 * I, L)
    w2_packed, w2_scale = _mxfp4_experts(seed, "w2", E, L, I)
    return {
        "w_router": _normal(seed, "w_router", (E, D), D ** -0.5),
        "router_bias": _normal(seed, "router_bias", (E,), 0.01),
        "w_latent_down": _normal(seed, "w_latent_down", (L, D), D ** -0.5),
        "w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed, "w2_scale": w2_scale,
        "latent_norm_w": _near_one(seed, "latent_norm_w", L),
        "w_latent_up": _normal(seed, "w_latent_up", (D, L), L ** -0.5),
        "w_shared_gate_up": _normal(seed, "w_shared_gate_up", (2 * S, D), D ** -0.5),
        "w_shared_down": _normal(seed, "w_shared_down", (D, S), S ** -0.5),
    }


def _dense_mlp(seed: int, cfg: K3Config) -> dict[str, torch.Tensor]:
    D, I = cfg.hidden, cfg.dense_inter
    return {"w_dense_gate_up": _normal(seed, "w_dense_gate_up", (2 * I, D), D ** -0.5),
            "w_dense_down": _normal(seed, "w_dense_down", (D, I), I ** -0.5)}


def make_layer_weights(kind: str, cfg: K3Config, seed: int, dtype: torch.dtype = torch.bfloat16) -> LayerWeights:
    """Weights of one `kind` layer ("kda", "mla" or "dense" = layer 0) for `cfg`, bit-for-bit from `seed`.

    Floating weights are drawn in float64 and rounded once to `dtype` (FP32_PARAMS to fp32, or float64
    when dtype is float64); `.to(torch.float64)` of the result is the exact oracle copy.
    At k3 the 896 MXFP4 experts alone are ~9.9 GB packed per layer and take long on CPU.
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind: {kind!r} is not a layer kind; use one of {LAYER_KINDS}")
    if not isinstance(cfg, K3Config):
        raise TypeError(f"cfg: expected a references.config.K3Config, got {type(cfg).__name__}")
    if not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    tensors = _attn_res_and_norms(seed, cfg.hidden)
    tensors.update(_mla_attention(seed, cfg) if kind == "mla" else _kda_attention(seed, cfg))
    tensors.update(_dense_mlp(seed, cfg) if kind == "dense" else _latent_moe(seed, cfg))
    exact = LayerWeights(kind, cfg, torch.float64, tensors)
    return exact if dtype == torch.float64 else exact.to(dtype)
