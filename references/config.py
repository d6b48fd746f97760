"""Kimi K3 dimensions (published config.json) and small configs with the same structure."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class K3Config:
    hidden: int = 7168
    n_heads: int = 96               # KDA and MLA heads
    head_dim: int = 128             # KDA head dim, MLA qk_nope and v head dim
    conv_kernel: int = 4
    gate_lower_bound: float = -5.0
    f_rank: int = 128               # KDA f_a/f_b low-rank gate
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_rope_dim: int = 64
    n_experts: int = 896
    top_k: int = 16
    moe_inter: int = 3072           # routed expert intermediate size
    latent: int = 3584              # routed_expert_hidden_size
    shared_inter: int = 6144        # 2 shared experts fused: 2 x 3072
    dense_inter: int = 33792        # layer-0 dense MLP
    mxfp4_group: int = 32
    rms_eps: float = 1e-5
    mla_latent_eps: float = 1e-6    # q_a / kv_a layernorm eps: 1e-6 in HF copies, 1e-5 in vLLM
    l2_eps: float = 1e-6
    attn_res_block: int = 12
    max_sources: int = 9            # AttnRes: 8 blocks + prefix
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scale: float = 1.0
    page_size: int = 64

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim + self.qk_rope_dim

    @property
    def mla_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    def heads_per_rank(self, tp: int) -> int:
        if tp <= 0 or self.n_heads % tp:
            raise ValueError(f"tp={tp}: n_heads={self.n_heads} is not divisible by it; pick T dividing {self.n_heads}")
        return self.n_heads // tp

    def to_dict(self) -> dict:
        return asdict(self)


K3 = K3Config()

# Same structure, CPU-sized: heads divisible by 16, MXFP4 group 32 divides every expert dim.
SMALL = K3Config(
    hidden=256, n_heads=16, head_dim=32, f_rank=16, q_lora_rank=96, kv_lora_rank=64, qk_rope_dim=16,
    n_experts=48, top_k=8, moe_inter=128, latent=128, shared_inter=192, dense_inter=384, page_size=16,
)
TINY = K3Config(
    hidden=64, n_heads=16, head_dim=16, f_rank=8, q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=8,
    n_experts=20, top_k=4, moe_inter=64, latent=64, shared_inter=64, dense_inter=96, page_size=8,
)

CONFIGS = {"k3": K3, "small": SMALL, "tiny": TINY}


def get_config(name: str) -> K3Config:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"config={name!r} is unknown; choose one of {sorted(CONFIGS)}") from None
