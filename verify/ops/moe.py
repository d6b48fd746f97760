"""Registry entries for the LatentMoE ops (references/moe.py): router_topk, moe_experts_mxfp4,
latent_norm_up, shared_experts, l2_prefetch. Splits live in verify/ops/moe_splits.py.

Weights are normal with std fan_in^-1/2 (MXFP4 experts: quantised the same way), so every
activation stays O(1); activations follow the case's distribution.
"""
from __future__ import annotations

import torch

from references.config import get_config
from references.moe import router_choice_scores, renormalise
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, Peer
from verify.ops.common_splits import (RMS_EPS_DRAWS, activation, gen_for, norm_weight, replicated_split,
                                      scalar_param, weight, working_dtype)
from verify.ops.moe_edges import edge_routing, every_byte_scales, mirror_expert
from verify.ops.moe_splits import MOE_EXPERTS_TP_SPLIT, SHARED_EXPERTS_SPLIT
from verify.ops.mxfp4 import mxfp4_weight
from verify.model.values import GENERIC_DISTS

ROUTER_BIAS_STD = 0.1          # e_score_correction_bias: small next to the sigmoid's (0, 1) range
ROUTED_SCALES = (2.827, 0.5)   # routed_scale besides the config's 1.0 (Kimi's routed_scaling_factor ~2.827)
PAD_SLOTS = 0.125              # moe_experts_mxfp4: share of id -1 (padding) slots, slot 0 always real
K3_CPU_EXPERTS = 32            # k3 expert dims with fewer experts (896 x 16.5 MB of MXFP4 = 14.8 GB)


# ---------------------------------------------------------------------------------------------- router
def _near_tie_router(case: Case, x: torch.Tensor, w_gate: torch.Tensor, top_k: int):
    """Scores that tie or nearly tie at the k-th place, for every token.

    A group of g experts (random ids) shares one gate row and one bias, and competes for the last m
    slots (m < g): the k-m surest experts get bias +2, every other expert -2. Members other than the
    first are exact copies (exact tie: lower id wins), differ by one fp32 ulp in the bias (a near tie
    inside the scores' rounding band) or by one wd ulp in one gate weight (a close call, ~1e-4 apart,
    just outside the band: the selection must then match exactly).
    """
    g = gen_for(case, "near_ties")
    E = w_gate.shape[0]
    perm = torch.randperm(E, generator=g)
    size = int(torch.randint(2, min(4, E - top_k + 1) + 1, (1,), generator=g))
    slots = int(torch.randint(1, min(top_k, size - 1) + 1, (1,), generator=g))
    sure, group = perm[:top_k - slots], perm[top_k - slots:top_k - slots + size]
    bias = torch.full((E,), -2.0, dtype=torch.float32)
    bias[sure] = 2.0
    bias[group] = 0.5
    w_gate = w_gate.clone()
    base = w_gate[group[0]].clone()
    for e in group[1:].tolist():
        w_gate[e] = base
        kind = int(torch.randint(0, 3, (1,), generator=g))   # 0 exact, 1 weight ulp, 2 bias ulp
        if kind == 1:
            d = int(torch.randint(0, w_gate.shape[1], (1,), generator=g))
            w_gate[e, d] = torch.nextafter(base[d:d + 1], torch.tensor([float("inf")], dtype=base.dtype))[0]
        elif kind == 2:
            bias[e] = torch.nextafter(bias[e:e + 1], torch.tensor([1.0]))[0]
    return x, w_gate, bias


def make_router_topk_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, D, E = working_dtype(case), case.batch, cfg.hidden, cfg.n_experts
    top_k = int(case.knob("top_k", cfg.top_k))
    x = activation(case, "x", (B, D), wd)
    w_gate = weight(case, "w_gate", (E, D), D, wd)
    bias = (torch.randn(E, generator=gen_for(case, "bias")) * ROUTER_BIAS_STD).to(torch.float32)
    if case.dist == "near_ties":
        x, w_gate, bias = _near_tie_router(case, x, w_gate, top_k)
    return OpInputs({"x": x, "w_gate": w_gate, "bias": bias},
                    {"top_k": top_k, "routed_scale": scalar_param(case, "routed_scale", cfg.routed_scale, ROUTED_SCALES)})


def router_tie_scores(inputs: OpInputs) -> torch.Tensor:
    """The selection scores (sigmoid + bias) as the reference computes them for these inputs: float64
    for the oracle's inputs, fp32 for the working ones, so their difference is the scores' own rounding."""
    t = inputs.tensors
    return router_choice_scores(t["x"], t["w_gate"], t["bias"])[1]


def router_reweigh(inputs: OpInputs, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference's weights for the candidate's ids (judged when a near-tie let it choose)."""
    t = inputs.tensors
    s, _ = router_choice_scores(t["x"], t["w_gate"], t["bias"])
    return {"weights": renormalise(s, ids.to(device=s.device, dtype=torch.int64), inputs.params["routed_scale"])}


def router_weights_magnitude(inputs: OpInputs, cand: dict) -> dict[str, torch.Tensor]:
    """First-order running-error magnitude of the renormalised weights for the candidate's ids, and of
    the selection scores s + bias ("ids": widens the tie band on cancelling rows), in fp64:
    any fp32 order of the length-D logit errs by about u * A, A = sum_d |x_d w_ed| (measured on the H200:
    cuBLAS fp32 up to 1.76 u A, the fused kernel 0.53 u A), so
      m(s_e)   = s_e (1 - s_e) A_e + s_e                    (sigmoid' = s (1 - s); its own ulps)
      m(w_i)   = r (m(s_i) / S + s_i sum_j m(s_j) / S^2) + |w_i|     (w_i = r s_i / S, S = sum over the ids)
    A row whose logits cancel (A >> |logit|) errs by ulps of A, not of its weights."""
    t = inputs.tensors
    x, w = t["x"].to(torch.float64), t["w_gate"].to(torch.float64)
    logit = x @ w.T
    A = x.abs() @ w.abs().T
    s = torch.sigmoid(logit)
    m_s = s * (1 - s) * A + s
    ids = cand["ids"].to(device=s.device, dtype=torch.int64).clamp(0, s.shape[1] - 1)
    si, mi = s.gather(1, ids), m_s.gather(1, ids)
    S = si.sum(-1, keepdim=True)
    r = inputs.params["routed_scale"]
    choice = s + t["bias"].to(torch.float64)
    return {"weights": r * (mi / S + si * mi.sum(-1, keepdim=True) / S ** 2) + r * si / S,
            "ids": m_s + choice.abs()}              # the selection scores' magnitude (tie band)


# ---------------------------------------------------------------------------------------------- experts
def expert_dims(case: Case) -> tuple[int, int, int, int]:
    """(E, L, I, top_k); k3 keeps its per-expert dims with K3_CPU_EXPERTS experts (knob 'n_experts')."""
    cfg = get_config(case.config)
    E = cfg.n_experts if case.config != "k3" else K3_CPU_EXPERTS
    return int(case.knob("n_experts", E)), cfg.latent, cfg.moe_inter, cfg.top_k


def make_moe_experts_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B = working_dtype(case), case.batch
    E, L, I, k = expert_dims(case)
    g = gen_for(case, "routing")
    ids = torch.argsort(torch.rand((B, E), generator=g), dim=1)[:, :k].contiguous()   # k distinct per token
    w = torch.rand((B, k), generator=g, dtype=torch.float64) + 0.05
    # the router's weights: rows sum to routed_scale (drawn: 1.0 or another), not always to 1, so a
    # kernel that renormalises them again is wrong; about 1 in 8 slots padding (id -1, an expert
    # parallel rank's foreign experts, skipped), so a kernel that reads -1 as
    # the last expert is wrong (both certified by probing while every row held k real ids summing to 1)
    scale = scalar_param(case, "routed_scale", cfg.routed_scale, ROUTED_SCALES)
    weights = (w / w.sum(-1, keepdim=True) * scale).to(torch.float32)
    pad = torch.rand((B, k), generator=g) < PAD_SLOTS
    pad[:, 0] = False
    # in half the cases of B >= 3 one row all padding (under expert parallelism a token routed only to
    # other ranks' experts, the common case): its output is zero, not left unwritten (certified by
    # probing while every row held a real slot 0); never token 0 or B-1, whose slot 0 extreme_scales uses
    if B >= 3 and torch.rand((), generator=g) < 0.5:
        pad[int(torch.randint(1, B - 1, (), generator=g))] = True
    ids[pad] = -1
    wdist = "mxfp4_grid" if case.dist == "mxfp4_grid" else "normal"
    # all experts in one [E*O, I] draw + quantisation (MXFP4 groups never cross a row)
    w13_p, w13_s = mxfp4_weight(case, "w13", (E * 2 * I, L), L, wdist)
    w2_p, w2_s = mxfp4_weight(case, "w2", (E * L, I), I, wdist)
    w13_p, w13_s = w13_p.reshape(E, 2 * I, L // 2), w13_s.reshape(E, 2 * I, -1)
    w2_p, w2_s = w2_p.reshape(E, L, I // 2), w2_s.reshape(E, L, -1)
    if case.knob("routing") is not None:            # edge routings (verify/ops/moe_edges.py)
        ids, weights = edge_routing(case.knob("routing"), gen_for(case, "edge_routing"), ids, weights, E)
        if case.knob("routing") == "edges":
            w13_p, w13_s, w2_p, w2_s = mirror_expert(ids, w13_p, w13_s, w2_p, w2_s)
    if case.knob("scales") == "extreme":
        w13_s, w2_s = extreme_scales(case, ids, w13_s, w2_s)
    elif case.knob("scales") == "every_byte":
        w13_p, w13_s, w2_p, w2_s = every_byte_scales(gen_for(case, "every_byte"), int(ids[0, 0]),
                                                     w13_p, w13_s, w2_p, w2_s)
    return OpInputs(
        {"z": activation(case, "z", (B, L), wd), "ids": ids, "weights": weights,
         "w13_packed": w13_p, "w13_scale": w13_s, "w2_packed": w2_p, "w2_scale": w2_s},
        situ_params(case, cfg))


def extreme_scales(case: Case, ids: torch.Tensor, w13_s: torch.Tensor, w2_s: torch.Tensor):
    """Knob scales='extreme' (run as an explicit case in every profile): E8M0 bytes the quantised
    draws never hold. In an expert every token routes to (token 0's slot 0, always real): one w2 byte
    0xFF (NaN: one output column of its tokens must come out NaN) and a quarter of the other w2 bytes
    0x00 (2^-127: subnormal products in fp32); in token B-1's first expert, when it is another one, one
    w13 byte 0xFF (its tokens' rows NaN). A decode that reads 0xFF as a number, or flushes 2^-127,
    was certified while no draw held them."""
    g = gen_for(case, "extreme_scales")
    w13_s, w2_s = w13_s.clone(), w2_s.clone()
    e0, e1 = int(ids[0, 0]), int(ids[-1, 0])
    L, G2 = w2_s.shape[1:]
    w2_s[e0][torch.rand((L, G2), generator=g) < 0.25] = 0
    w2_s[e0, int(torch.randint(0, L, (1,), generator=g)), int(torch.randint(0, G2, (1,), generator=g))] = 0xFF
    if e1 != e0:
        O, G13 = w13_s.shape[1:]
        w13_s[e1, int(torch.randint(0, O, (1,), generator=g)), int(torch.randint(0, G13, (1,), generator=g))] = 0xFF
    return w13_s, w2_s


def situ_params(case: Case, cfg) -> dict[str, float]:
    """SiTU's betas: the config's (4, 25) or others, drawn per case (a kernel that bakes them in was
    certified while every case passed the config's)."""
    return {"situ_beta": scalar_param(case, "situ_beta", cfg.situ_beta, (2.0, 8.0)),
            "situ_linear_beta": scalar_param(case, "situ_linear_beta", cfg.situ_linear_beta, (10.0, 50.0))}


# ---------------------------------------------------------------------------------------------- dense
def make_latent_norm_up_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, D, L = working_dtype(case), case.batch, cfg.hidden, cfg.latent
    return OpInputs({"y_latent": activation(case, "y_latent", (B, L), wd),
                     "norm_w": norm_weight(case, "norm_w", L, wd),
                     "w_up": weight(case, "w_up", (D, L), L, wd),
                     "shared_out": activation(case, "shared_out", (B, D), wd)},
                    {"eps": scalar_param(case, "eps", cfg.rms_eps, RMS_EPS_DRAWS)})


def make_shared_experts_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, D, SI = working_dtype(case), case.batch, cfg.hidden, cfg.shared_inter
    return OpInputs({"x": activation(case, "x", (B, D), wd),
                     "w_gate_up": weight(case, "w_gate_up", (2 * SI, D), D, wd),
                     "w_down": weight(case, "w_down", (D, SI), SI, wd)},
                    situ_params(case, cfg))


def make_l2_prefetch_inputs(case: Case) -> OpInputs:
    """The next layer's expert weights (uint8) and a dense weight in the case dtype."""
    cfg = get_config(case.config)
    L, I = cfg.latent, cfg.moe_inter
    packed, scale = mxfp4_weight(case, "next_w13", (2 * I, L), L, "mxfp4_grid")
    return OpInputs({"w13_packed": packed, "w13_scale": scale,
                     "w_dense": weight(case, "next_dense", (L, cfg.hidden), cfg.hidden, working_dtype(case))})


def router_topk_bytes(inputs: OpInputs) -> int:
    """x, w_gate and the fp32 bias read; ids (int64) and fp32 weights [B, k] written."""
    t = inputs.tensors
    (B, D), E, k = t["x"].shape, t["w_gate"].shape[0], inputs.params["top_k"]
    return (B * D + E * D) * t["x"].element_size() + E * 4 + B * k * (8 + 4)


def moe_experts_mxfp4_bytes(inputs: OpInputs) -> int:
    """z, ids and weights read; the MXFP4 weights and scales of the distinct experts the ids name
    (0..E-1; padding ids are no expert), each once however many tokens chose it; y written."""
    t = inputs.tensors
    E = t["w13_packed"].shape[0]
    ids = t["ids"]
    distinct = int(torch.unique(ids[(ids >= 0) & (ids < E)]).numel())
    per_expert = sum(t[k][0].numel() * t[k].element_size() for k in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"))
    small = sum(t[k].numel() * t[k].element_size() for k in ("z", "ids", "weights"))
    return small + distinct * per_expert + t["z"].numel() * t["z"].element_size()


def latent_norm_up_bytes(inputs: OpInputs) -> int:
    """y_latent, norm_w, w_up and shared_out read once; out [B, D] written."""
    t = inputs.tensors
    read = sum(t[k].numel() * t[k].element_size() for k in ("y_latent", "norm_w", "w_up", "shared_out"))
    return read + t["shared_out"].numel() * t["shared_out"].element_size()


def shared_experts_bytes(inputs: OpInputs) -> int:
    """x, w_gate_up and w_down read once; y [B, D] written (the gate_up and activation scratch
    between the launches is the implementation's own traffic, not the op's)."""
    t = inputs.tensors
    read = sum(t[k].numel() * t[k].element_size() for k in ("x", "w_gate_up", "w_down"))
    return read + t["x"].numel() * t["x"].element_size()


ROUTER_PEERS = (Peer("cublas_logits_topk", "verify.bench.peers:cublas_logits_topk"),
                Peer("cublas_logits", "verify.bench.peers:cublas_logits", part="the logits GEMM alone (bf16)"))

OPS = [
    OpDef(
        name="router_topk", family="moe", reference="references.moe:router_topk", collective="gathered_scores",
        make_inputs=make_router_topk_inputs, outputs=("ids", "weights"),
        signature=("x[B,D] wd, w_gate[E,D] wd, bias[E] fp32, top_k: int, routed_scale: float "
                   "-> ids[B,k] int64 (descending choice, lower id first on ties), weights[B,k] fp32"),
        batch_dims={"x": 0, "ids": 0, "weights": 0},
        split=replicated_split(), fused="fused.router_topk:router_topk",
        dists=GENERIC_DISTS + ("near_ties",), tie_scores=router_tie_scores, reweigh=router_reweigh,
        magnitudes=router_weights_magnitude, moved_bytes=router_topk_bytes, peers=ROUTER_PEERS,
        notes="Split: replicated (vLLM GateLinear). The expert-range scores split + gather is "
              "references.moe.router_topk_scores_split, tested in test_tp_split_moe.py. near_ties "
              "builds a tie group at the k-th place (exact copies and 1-ulp differences).",
    ),
    OpDef(
        name="moe_experts_mxfp4", family="moe", reference="references.moe:moe_experts_mxfp4", collective="split",
        make_inputs=make_moe_experts_inputs, outputs=("y",),
        signature=("z[B,L] wd, ids[B,k] int64, weights[B,k] fp32, w13_packed[E,2I,L/2] u8, "
                   "w13_scale[E,2I,L/32] u8, w2_packed[E,L,I/2] u8, w2_scale[E,L,I/32] u8, "
                   "situ_beta: float, situ_linear_beta: float -> y[B,L] wd"),
        batch_dims={"z": 0, "ids": 0, "weights": 0, "y": 0},
        split=MOE_EXPERTS_TP_SPLIT, fused="fused.moe_experts_mxfp4:moe_experts_mxfp4",
        moved_bytes=moe_experts_mxfp4_bytes,
        configs=("tiny", "small"), compile_heavy=True, cpu_ok=False, max_batch=32,
        dists=GENERIC_DISTS + ("mxfp4_grid",),
        knob_sweep=({"scales": "extreme"}, {"scales": "every_byte"}, {"routing": "edges"}, {"routing": "same"}),
        notes="k3 is not in configs: 896 experts hold 14.8 GB of MXFP4 and the float64 oracle costs "
              "~0.2 s per (token, expert) at k3 dims, so a case exceeds the ~2 s CPU budget; "
              "make_inputs serves k3 dims with 32 experts (knob 'n_experts') for device runs; "
              "max_batch 32 keeps a small-config case (256 (token, expert) pairs) near 1 s. "
              "Knob scales='extreme' (every run): 0xFF and 0x00 scale bytes in routed experts; "
              "scales='every_byte', routing='edges' and routing='same': verify/ops/moe_edges.py. "
              "Split: TP over the intermediate dim (zero-padded, moe_tp_shard_width); EP is "
              "verify.ops.moe_splits.MOE_EXPERTS_EP_SPLIT, tested in test_tp_split_moe.py.",
    ),
    OpDef(
        name="latent_norm_up", family="moe", reference="references.moe:latent_norm_up",
        make_inputs=make_latent_norm_up_inputs, outputs=("out",),
        signature="y_latent[B,L] wd, norm_w[L] wd, w_up[D,L] wd, shared_out[B,D] wd, eps: float -> out[B,D] wd",
        batch_dims={"y_latent": 0, "shared_out": 0, "out": 0},
        split=replicated_split(), fused="fused.latent_norm_up:latent_norm_up", moved_bytes=latent_norm_up_bytes,
        notes="Replicated: runs after the one all-reduce of (latent partial, shared partial).",
    ),
    OpDef(
        name="shared_experts", family="moe", reference="references.moe:shared_experts", collective="split",
        make_inputs=make_shared_experts_inputs, outputs=("y",),
        signature=("x[B,D] wd, w_gate_up[2I,D] wd ([gate; up]), w_down[D,I] wd, situ_beta: float, "
                   "situ_linear_beta: float -> y[B,D] wd"),
        batch_dims={"x": 0, "y": 0},
        split=SHARED_EXPERTS_SPLIT, fused="fused.shared_experts:shared_experts", moved_bytes=shared_experts_bytes,
        notes="Column (gate/up rows) then row (down columns) split; partial [B,D] per rank, rank-order "
              "fp32 fold. k3 weights are 12288x7168 + 7168x6144 (about 1 GB upcast to float64).",
    ),
    OpDef(
        name="l2_prefetch", family="moe", reference="references.moe:l2_prefetch",
        make_inputs=make_l2_prefetch_inputs, outputs=(), state=("w13_packed", "w13_scale", "w_dense"),
        signature="w13_packed[2I,L/2] u8, w13_scale[2I,L/32] u8, w_dense[L,D] wd -> None (no effect)",
        split=None, dists=("normal",),
        notes="No observable effect: every input bitwise unchanged, nothing written. The inputs are "
              "declared state only so that they are judged (bitwise) after the call. dtype = the dense weight's.",
    ),
]
