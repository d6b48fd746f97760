"""Registry entries for the KDA family: kda_in_proj and kda_decode (references/kda.py).

Inputs are rebuilt from the case seed alone: each tensor draws from its own generator salted by
its name, so weights do not change with the batch size and one tensor's distribution never
shifts another's values. Activations use the case's distribution; weights are normal, scaled by
fan_in^-1/2 so every activation stays O(1).
"""
from __future__ import annotations

import zlib

import torch

from references.config import get_config
from references.kda import kda_gate
from references.primitives import silu
from references.kda_tp import (combine_kda_decode, combine_kda_in_proj, shard_kda_decode,
                               shard_kda_in_proj)
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, Peer, RankShard, SplitRule
from verify.ops.common_splits import scalar_param
from verify.model.values import draw, generator, row_scales

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}
STATE_WRITES = 8        # rank-1 writes that build the starting state ("as if after some decode steps")
DECODE_MAX_BATCH = 32   # k3: the fp32 state is 6 MiB per sequence; 32 keeps a case (with fp64 oracle) ~1 GB


def _gen(case: Case, name: str) -> torch.Generator:
    return generator(case.seed, zlib.crc32(name.encode()))


def _activation(case: Case, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    return draw(_gen(case, name), shape, case.dist, dtype=dtype, row_seed=case.seed)


def _weight(case: Case, name: str, shape, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal weight with std fan_in^-1/2, drawn in fp32 (k3 weights are large; fp64 draws double that)."""
    w = torch.randn(tuple(shape), generator=_gen(case, name), dtype=torch.float32)
    return (w * fan_in ** -0.5).to(dtype)


def _wd(case: Case) -> torch.dtype:
    try:
        return DTYPES[case.dtype]
    except KeyError:
        raise ValueError(f"dtype={case.dtype!r} is unknown; choose one of {sorted(DTYPES)}") from None


def starting_state(case: Case, batch: int, n_heads: int, head_dim: int) -> torch.Tensor:
    """fp32 state [B, H, V, K] as after a few decode steps: a decayed sum of rank-1 writes v k^T with
    unit keys (what the delta rule stores). Values follow the case's distribution, so zero_rows gives
    fresh (all-zero) sequences next to warm ones."""
    gen = _gen(case, "state")
    n = STATE_WRITES
    keys = torch.randn((batch, n_heads, n, head_dim), generator=gen, dtype=torch.float64)
    keys = keys / keys.norm(dim=-1, keepdim=True)
    vals = draw(gen, (batch, n_heads, n, head_dim), case.dist, dtype=torch.float64, row_seed=case.seed,
                range_dtype=_wd(case))      # range_edges: an fp16 case's state stays in fp16's range
    age = 0.8 ** torch.arange(n - 1, -1, -1, dtype=torch.float64)        # older writes decayed more
    weights = torch.rand((batch, n_heads, n), generator=gen, dtype=torch.float64) * age
    return torch.einsum("bhnv,bhnk->bhvk", vals * weights.unsqueeze(-1), keys).to(torch.float32)


def decode_weights(case: Case, n_heads: int, head_dim: int, conv_kernel: int) -> dict[str, torch.Tensor]:
    """The fp32 per-layer KDA parameters; ranges chosen so the gate spans its whole (lb, 0) range."""
    C = n_heads * head_dim
    a_log = torch.rand(n_heads, generator=_gen(case, "A_log"), dtype=torch.float64) * 2.5 - 1.0
    return {
        "conv_w": _weight(case, "conv_w", (3, C, conv_kernel), conv_kernel, torch.float32),
        "A_log": a_log.to(torch.float32),                                   # exp(A_log) in (0.37, 4.5)
        "dt_bias": torch.randn(C, generator=_gen(case, "dt_bias")).to(torch.float32),
        "o_norm_w": (1 + 0.1 * torch.randn(head_dim, generator=_gen(case, "o_norm_w"))).to(torch.float32),
    }


def _conv_inputs(case: Case, B: int, H: int, Dh: int, W: int, wd: torch.dtype) -> dict[str, torch.Tensor]:
    """q_raw, k_raw, v_raw [B, H*Dh] and their conv window conv_state [B, 3, H*Dh, W-1].

    small_rows: the L2 norms of q and k (and the conv) work on one (batch, head) row of Dh channels
    after the W-tap conv over [conv_state, x]; drawn per tensor, each tensor's rows would get other
    scales and the O(1) window would swamp a small x. So one set of per-(b, h) scales
    (values.row_scales) multiplies normal draws of all four, and a small row stays small into q/k."""
    C = H * Dh
    if case.dist != "small_rows":
        t = {name: _activation(case, name, (B, C), wd) for name in ("q_raw", "k_raw", "v_raw")}
        t["conv_state"] = _activation(case, "conv_state", (B, 3, C, W - 1), wd)    # past raw inputs
        return t
    s = row_scales(_gen(case, "row_scales"), B * H).view(B, H, 1).expand(B, H, Dh).reshape(B, C)
    t = {name: (draw(_gen(case, name), (B, C), "normal", dtype=torch.float64) * s).to(wd)
         for name in ("q_raw", "k_raw", "v_raw")}
    cs = draw(_gen(case, "conv_state"), (B, 3, C, W - 1), "normal", dtype=torch.float64)
    t["conv_state"] = (cs * s.view(B, 1, C, 1)).to(wd)
    return t


def make_kda_decode_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, H, Dh, W = _wd(case), case.batch, cfg.n_heads, cfg.head_dim, cfg.conv_kernel
    C = H * Dh
    conv = _conv_inputs(case, B, H, Dh, W, wd)
    t = {name: conv[name] for name in ("q_raw", "k_raw", "v_raw")}
    t["g_raw"] = _activation(case, "g_raw", (B, C), wd)
    t["beta_raw"] = _activation(case, "beta_raw", (B, H), wd)
    t["z"] = _activation(case, "z", (B, C), wd)
    w = decode_weights(case, H, Dh, W)
    t["conv_w"] = w["conv_w"]
    t["conv_state"] = conv["conv_state"]
    t["A_log"], t["dt_bias"], t["o_norm_w"] = w["A_log"], w["dt_bias"], w["o_norm_w"]
    t["state"] = starting_state(case, B, H, Dh)
    params = {"lower_bound": scalar_param(case, "lower_bound", cfg.gate_lower_bound, (-3.0, -8.0)),
              "l2_eps": scalar_param(case, "l2_eps", cfg.l2_eps, (1e-5,)),
              "norm_eps": scalar_param(case, "norm_eps", cfg.rms_eps, (1e-6,))}
    return OpInputs(tensors=t, params=params)


def decode_state_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """First-order running error magnitude of the new KDA state (Higham, Accuracy and Stability, 3.1):
    for every element, m such that any evaluation order of the reference's sums errs by about
    c * u * m (c ~ sqrt of the longest sum). Computed in fp64 from the case's inputs; |.| of every term:

      conv (W terms, then SiLU):  m(v_c) = 1.1 * sum_w |window_w conv_w_w| + |v_c|   (|silu'| <= 1.1)
      k = ks / |ks|:              m(k_i) = (m(ks_i) + |k_i| |m(ks)|_2) / |ks|_2
      S' = alpha S:               m(S'_i) = 2 |S'_i|                     (the gate's own few ulps)
      dot_j = sum_i S'_ji k_i:    m(dot_j) = sum_i (m(S'_ji) |k_i| + |S'_ji| m(k_i))
      u_j = beta (v_j - dot_j):   m(u_j) = beta (m(v_j) + m(dot_j)) + |u_j|
      new_ji = S'_ji + k_i u_j:   m(new_ji) = m(S'_ji) + m(k_i) |u_j| + |k_i| m(u_j)

    Where the conv's terms cancel (|v_c| << sum |terms|) an order change moves u_j, and with it the
    whole state row, by ulps of the terms, not of the result: the row's floor is scaled by this m."""
    t, p = inputs.tensors, inputs.params
    d = {n: t[n].to(torch.float64) for n in ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "conv_w",
                                             "conv_state", "A_log", "dt_bias", "state")}
    B, H, V, K = d["state"].shape

    def conv(i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat([d["conv_state"][:, i], x.unsqueeze(-1)], dim=-1)
        pre = (window * d["conv_w"][i]).sum(-1)
        val = silu(pre)
        mag = 1.1 * (window * d["conv_w"][i]).abs().sum(-1) + val.abs()
        return val.view(B, H, -1), mag.view(B, H, -1)

    ks, m_ks = conv(1, d["k_raw"])
    v, m_v = conv(2, d["v_raw"])
    norm = torch.sqrt((ks * ks).sum(-1, keepdim=True) + p["l2_eps"])
    k = ks / norm
    m_k = (m_ks + k.abs() * m_ks.norm(dim=-1, keepdim=True)) / norm
    _, alpha = kda_gate(d["g_raw"].view(B, H, K), d["A_log"], d["dt_bias"], p["lower_bound"])
    beta = torch.sigmoid(d["beta_raw"]).unsqueeze(-1)                               # [B, H, 1]
    sd = d["state"] * alpha.unsqueeze(-2)                                            # [B, H, V, K]
    m_sd = 2 * sd.abs()
    dot = (sd * k.unsqueeze(-2)).sum(-1)
    m_dot = (m_sd * k.abs().unsqueeze(-2) + sd.abs() * m_k.unsqueeze(-2)).sum(-1)  # [B, H, V]
    u = beta * (v - dot)
    m_u = beta * (m_v + m_dot) + u.abs()
    m_new = m_sd + m_k.unsqueeze(-2) * u.abs().unsqueeze(-1) + k.abs().unsqueeze(-2) * m_u.unsqueeze(-1)
    return {"state": m_new}


def in_proj_weights(case: Case, hidden: int, n_heads: int, head_dim: int, f_rank: int,
                    wd: torch.dtype) -> dict[str, torch.Tensor]:
    C = n_heads * head_dim
    return {"w_in": _weight(case, "w_in", (4 * C + f_rank + n_heads, hidden), hidden, wd),
            "w_fb": _weight(case, "w_fb", (C, f_rank), f_rank, wd)}


def make_kda_in_proj_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd = _wd(case)
    t = {"x": _activation(case, "x", (case.batch, cfg.hidden), wd)}
    t.update(in_proj_weights(case, cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.f_rank, wd))
    return OpInputs(tensors=t, params={"n_heads": cfg.n_heads})


def make_kda_attention_step_inputs(case: Case) -> OpInputs:
    """Inputs of references.kda:kda_attention_step (not a registered op; used by TP and layer tests)."""
    cfg = get_config(case.config)
    wd = _wd(case)
    dec = make_kda_decode_inputs(case)
    proj = make_kda_in_proj_inputs(case)
    t = {"x": proj.tensors["x"], "w_in": proj.tensors["w_in"], "w_fb": proj.tensors["w_fb"]}
    for name in ("conv_w", "conv_state", "A_log", "dt_bias", "o_norm_w", "state"):
        t[name] = dec.tensors[name]
    C = cfg.n_heads * cfg.head_dim
    t["w_o"] = _weight(case, "w_o", (cfg.hidden, C), C, wd)
    return OpInputs(tensors=t, params={"n_heads": cfg.n_heads, **dec.params})


def _split_rule(kind: str, shard_fn, combine_fn, reduction_order: str) -> SplitRule:
    """Wrap the dict-level functions of references.kda_tp in the OpInputs/RankShard contract."""
    def shard(inputs: OpInputs, T: int) -> list[RankShard]:
        return [RankShard(t, p) for t, p in shard_fn(inputs.tensors, inputs.params, T)]

    def combine(per_rank: list[dict[str, torch.Tensor]], inputs: OpInputs) -> dict[str, torch.Tensor]:
        return combine_fn(per_rank)
    return SplitRule(kind=kind, shard=shard, combine=combine, reduction_order=reduction_order)


_IN_PROJ_OUT = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")


def kda_in_proj_bytes(inputs: OpInputs) -> int:
    """x, w_in and w_fb read; q_raw, k_raw, v_raw, g_raw, z [B, H*Dh] and beta_raw [B, H] written (the
    merged scratch between the two launches is the implementation's own traffic, not the op's)."""
    t = inputs.tensors
    read = sum(t[k].numel() * t[k].element_size() for k in ("x", "w_in", "w_fb"))
    B, (C, _), H = t["x"].shape[0], t["w_fb"].shape, inputs.params["n_heads"]
    return read + B * (5 * C + H) * t["x"].element_size()

_DECODE_ACT = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")

KDA_IN_PROJ = OpDef(
    name="kda_in_proj",
    family="kda",
    reference="references.kda:kda_in_proj",
    make_inputs=make_kda_in_proj_inputs,
    outputs=_IN_PROJ_OUT,
    signature=("x[B,D] wd\n"
               "w_in[4*H*Dh + r + H, D] wd  rows: q | k | v | z (g_proj) | f_a | beta (b_proj)\n"
               "w_fb[H*Dh, r] wd  (f_b_proj)\n"
               "n_heads: int  (H on this rank)\n"
               "-> q_raw, k_raw, v_raw, g_raw, z [B,H*Dh] wd; beta_raw [B,H] wd"),
    batch_dims={"x": 0, **{name: 0 for name in _IN_PROJ_OUT}},
    split=_split_rule("column", shard_kda_in_proj, combine_kda_in_proj,
                      "none: q,k,v,z,beta,f_b columns by head, f_a replicated; concatenated"),
    cpu_ok=False,
    fused="fused.kda_in_proj:kda_in_proj", moved_bytes=kda_in_proj_bytes,
    notes=("k3 merged weight is [49376, 7168] (0.7 GB bf16, 2.8 GB as the fp64 oracle): run k3 on a large "
           "host or the device; tiny/small have the same structure."),
)

def kda_decode_bytes(inputs: OpInputs) -> int:
    """Activations (q, k, v, g, z [B, C] and beta [B, H]) and the fp32 parameters read; conv_state
    and the fp32 state read and written; y [B, C] written."""
    t = inputs.tensors
    (B, C), H = t["q_raw"].shape, t["A_log"].shape[0]
    Dh, W = C // H, t["conv_w"].shape[-1]
    e = t["q_raw"].element_size()
    activations = (5 * B * C + B * H) * e
    params = (3 * C * W + H + C + Dh) * 4
    conv = 2 * B * 3 * C * (W - 1) * t["conv_state"].element_size()
    state = 2 * B * H * Dh * Dh * 4
    return activations + params + conv + state + B * C * e


KDA_DECODE_PEERS = (
    Peer("fla_kda_decode", "verify.bench.peers:fla_kda_decode"),
    Peer("fla_recurrence", "verify.bench.peers:fla_recurrence",
         part="fla's fused_recurrent_kda alone: a lower bound on the op through fla"),
)

KDA_DECODE = OpDef(
    name="kda_decode",
    family="kda",
    reference="references.kda:kda_decode",
    make_inputs=make_kda_decode_inputs,
    outputs=("y",),
    signature=("q_raw, k_raw, v_raw, g_raw, z [B,H*Dh] wd; beta_raw[B,H] wd\n"
               "conv_w[3,H*Dh,W] fp32; conv_state[B,3,H*Dh,W-1] wd (state, oldest first)\n"
               "A_log[H] fp32; dt_bias[H*Dh] fp32; o_norm_w[Dh] fp32\n"
               "state[B,H,Dh(V),Dh(K)] fp32 (state, V-first)\n"
               "lower_bound, l2_eps, norm_eps: float\n"
               "-> y[B,H*Dh] wd"),
    state=("conv_state", "state"),
    batch_dims={**{name: 0 for name in _DECODE_ACT}, "conv_state": 0, "state": 0, "y": 0},
    split=_split_rule("heads", shard_kda_decode, combine_kda_decode,
                      "none: heads are independent; y, conv_state, state concatenated by head"),
    fused="fused.kda_decode:kda_decode",
    magnitudes=decode_state_magnitude, moved_bytes=kda_decode_bytes, peers=KDA_DECODE_PEERS,
    max_batch=DECODE_MAX_BATCH,
    notes=(f"batch capped at {DECODE_MAX_BATCH}: at k3 the fp32 state is 6 MiB per sequence and the oracle "
           "holds an fp64 copy; the batch-invariance guard covers the larger decode batches."),
)

OPS: list[OpDef] = [KDA_IN_PROJ, KDA_DECODE]
