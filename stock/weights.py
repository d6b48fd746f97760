"""Seeded synthetic K3 layer weights drawn on the device, for timing at K3 shapes.

references.weights.make_layer_weights draws every tensor in float64 on the CPU and quantises the 896
MXFP4 experts there (minutes per layer at K3). `make_layer_weights_on` draws the same tensors (names,
shapes, dtypes, distributions and scales of references.weights, experts quantised by the same OCP FLOOR
rule) with a generator on `device`, in float32 (experts quantised in float64 on the device, one at a
time). Same seed and device give the same bits; the values are NOT those of make_layer_weights (another
random stream), so certification keeps the registry's inputs and this builder serves benches and
graph/launch checks at K3.
"""
from __future__ import annotations

import math
import zlib

import torch

from references.config import K3Config
from references.kda import in_proj_layout
from references.mxfp4 import GROUP, MIDPOINTS, TIES_UP, _floor_log2, _grouped_amax, _scale_bytes, scale_values
from references.weights import FP32_PARAMS, LAYER_KINDS, LayerWeights


def _gen(seed: int, name: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def quantize_mxfp4_ocp_on(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """references.mxfp4.quantize_mxfp4_ocp on w's device (its E2M1 midpoints there too): FLOOR scale
    2^(floor(log2 amax) - 2), round to nearest even, saturate at 6, sign bit kept on zeros."""
    g, amax = _grouped_amax(w)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    byte = _scale_bytes(_floor_log2(torch.nan_to_num(safe, nan=1.0)) - 2, amax)
    a = (g / scale_values(byte).unsqueeze(-1)).abs()
    idx = torch.bucketize(a, MIDPOINTS.to(w.device)) + torch.isin(a, TIES_UP.to(w.device)).to(torch.int64)
    idx = torch.where(torch.isnan(a), torch.zeros_like(idx), idx)
    codes = (idx + 8 * torch.signbit(g).to(torch.int64)).to(torch.uint8).reshape(w.shape)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), byte


class _Draw:
    """Per-tensor generators on one device (a new tensor never shifts another's values)."""

    def __init__(self, seed: int, device):
        self.seed, self.device = seed, torch.device(device)

    def normal(self, name: str, shape, std: float, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=_gen(self.seed, name, self.device), device=self.device,
                           dtype=dtype) * std

    def uniform(self, name: str, n: int) -> torch.Tensor:
        return torch.rand(n, generator=_gen(self.seed, name, self.device), device=self.device, dtype=torch.float64)

    def near_one(self, name: str, n: int) -> torch.Tensor:
        return 1.0 + self.normal(name, (n,), 0.1)

    def experts(self, name: str, n_experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.empty(n_experts, rows, cols // 2, dtype=torch.uint8, device=self.device)
        scale = torch.empty(n_experts, rows, cols // GROUP, dtype=torch.uint8, device=self.device)
        for e in range(n_experts):
            packed[e], scale[e] = quantize_mxfp4_ocp_on(self.normal(f"{name}[{e}]", (rows, cols), cols ** -0.5,
                                                                    torch.float64))
        return packed, scale


def _tensors(kind: str, cfg: K3Config, d: _Draw) -> dict[str, torch.Tensor]:
    D, H, Dh = cfg.hidden, cfg.n_heads, cfg.head_dim
    t = {"attn_res_norm_w": d.near_one("attn_res_norm_w", D),
         "attn_res_proj_w": d.normal("attn_res_proj_w", (D,), 2 * D ** -0.5),
         "input_norm_w": d.near_one("input_norm_w", D), "mlp_res_norm_w": d.near_one("mlp_res_norm_w", D),
         "mlp_res_proj_w": d.normal("mlp_res_proj_w", (D,), 2 * D ** -0.5), "post_norm_w": d.near_one("post_norm_w", D)}
    if kind == "mla":
        rope, ql, kv = cfg.qk_rope_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        t.update({"w_qkv_a": d.normal("w_qkv_a", (ql + kv + rope, D), D ** -0.5),
                  "q_a_norm_w": d.near_one("q_a_norm_w", ql), "kv_a_norm_w": d.near_one("kv_a_norm_w", kv),
                  "w_q_b": d.normal("w_q_b", (H * (Dh + rope), ql), ql ** -0.5),
                  "w_uk": d.normal("w_uk", (H, Dh, kv), kv ** -0.5), "w_uv": d.normal("w_uv", (H, Dh, kv), kv ** -0.5),
                  "w_g": d.normal("w_g", (H * Dh, D), D ** -0.5), "w_o": d.normal("w_o", (D, H * Dh), (H * Dh) ** -0.5)})
    else:
        C, r, W = H * Dh, cfg.f_rank, cfg.conv_kernel
        dt = (math.log(1e-3) + d.uniform("dt_bias", C) * math.log(100.0)).exp()
        t.update({"w_in": d.normal("w_in", (in_proj_layout(H, Dh, r)["beta"].stop, D), D ** -0.5),
                  "w_fb": d.normal("w_fb", (C, r), r ** -0.5), "conv_w": d.normal("conv_w", (3, C, W), W ** -0.5),
                  "A_log": (1.0 + 15.0 * d.uniform("A_log", H)).log(), "dt_bias": dt + torch.log(-torch.expm1(-dt)),
                  "o_norm_w": d.near_one("o_norm_w", Dh), "w_o": d.normal("w_o", (D, C), C ** -0.5)})
    if kind == "dense":
        I = cfg.dense_inter
        t.update({"w_dense_gate_up": d.normal("w_dense_gate_up", (2 * I, D), D ** -0.5),
                  "w_dense_down": d.normal("w_dense_down", (D, I), I ** -0.5)})
        return t
    E, I, L, S = cfg.n_experts, cfg.moe_inter, cfg.latent, cfg.shared_inter
    t["w13_packed"], t["w13_scale"] = d.experts("w13", E, 2 * I, L)
    t["w2_packed"], t["w2_scale"] = d.experts("w2", E, L, I)
    t.update({"w_router": d.normal("w_router", (E, D), D ** -0.5), "router_bias": d.normal("router_bias", (E,), 0.01),
              "w_latent_down": d.normal("w_latent_down", (L, D), D ** -0.5),
              "latent_norm_w": d.near_one("latent_norm_w", L), "w_latent_up": d.normal("w_latent_up", (D, L), L ** -0.5),
              "w_shared_gate_up": d.normal("w_shared_gate_up", (2 * S, D), D ** -0.5),
              "w_shared_down": d.normal("w_shared_down", (D, S), S ** -0.5)})
    return t


def make_layer_weights_on(kind: str, cfg: K3Config, seed: int, dtype: torch.dtype = torch.bfloat16,
                          device="cuda") -> LayerWeights:
    """One `kind` layer's weights drawn on `device` (see the module doc); floating weights in `dtype`,
    FP32_PARAMS in fp32, experts MXFP4 uint8. K3 on an H200: the expert quantisation dominates."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind: {kind!r} is not a layer kind; use one of {LAYER_KINDS}")
    if not isinstance(cfg, K3Config):
        raise TypeError(f"cfg: expected a references.config.K3Config, got {type(cfg).__name__}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype: {dtype} is not a working dtype; use bfloat16, float16 or float32")
    tensors = _tensors(kind, cfg, _Draw(seed, device))
    out = {n: t if not t.is_floating_point() else t.to(torch.float32 if n in FP32_PARAMS else dtype)
           for n, t in tensors.items()}
    return LayerWeights(kind, cfg, dtype, out)
