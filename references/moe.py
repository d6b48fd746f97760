"""LatentMoE of K3 (layers 1-92) and the layer-0 dense MLP: router, MXFP4 routed experts, latent
norm + up-projection, shared experts. Math: shared/reference/kimi-k3-math.md §4 and §6.

dtype-generic: float64 inputs give the oracle, bf16/fp16/fp32 the working-precision baseline.
"""
from __future__ import annotations

import torch

from references.mxfp4 import GROUP, mxfp4_dequant
from references.primitives import FLOAT_DTYPES, acc_dtype, check_tensor, linear, rms_norm, situ_and_mul

RENORM_EPS = 1e-20      # moe_renormalize: w / (sum + 1e-20)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- router
def router_choice_scores(x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor):
    """(s, choice): s = sigmoid(x.acc @ w.acc.T) (unbiased, for weights), choice = s + bias (selection)."""
    acc = acc_dtype(x)
    s = torch.sigmoid(x.to(acc) @ w_gate.to(acc).T)
    return s, s + bias.to(acc)


def select_topk(choice: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k ids by descending choice; equal choices -> lower id first (a stable sort keeps id order)."""
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]


def renormalise(s: torch.Tensor, ids: torch.Tensor, routed_scale: float) -> torch.Tensor:
    w = s.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + RENORM_EPS) * routed_scale


def router_topk(x: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                routed_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x[B,D] wd, w_gate[E,D] wd, bias[E] fp32 -> (ids[B,k] int64, weights[B,k] acc (fp32)).

    Declared tie-break: ids sorted by descending choice score, lower id first on equal scores.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    B, D = x.shape
    check_tensor("w_gate", w_gate, shape=(None, D), dtypes=FLOAT_DTYPES)
    E = w_gate.shape[0]
    check_tensor("bias", bias, shape=(E,), dtypes=FLOAT_DTYPES)
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: {top_k!r} must be an int in 1..{E} (number of experts)")
    s, choice = router_choice_scores(x, w_gate, bias)
    ids = select_topk(choice, top_k)
    return ids, renormalise(s, ids, routed_scale)


def expert_ranges(n_experts: int, T: int) -> list[tuple[int, int]]:
    """Contiguous expert range per rank: ceil(E/T) each, the last ranks shorter or empty."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T: {T!r} must be a positive int (ranks)")
    per = -(-n_experts // T)
    return [(min(r * per, n_experts), min((r + 1) * per, n_experts)) for r in range(T)]


def router_topk_scores_split(x, w_gate, bias, top_k: int, routed_scale: float, T: int):
    """Router with its scores split over T ranks by expert ranges, then gathered (concat in rank
    order) and selected once: each rank's logits are its own [B, E_r] GEMV, so only the top-k runs
    on the gathered scores. Must equal `router_topk` (each logit is one independent dot product)."""
    parts = [router_choice_scores(x, w_gate[lo:hi], bias[lo:hi]) for lo, hi in expert_ranges(w_gate.shape[0], T)]
    s = torch.cat([p[0] for p in parts], dim=1)
    choice = torch.cat([p[1] for p in parts], dim=1)
    ids = select_topk(choice, top_k)
    return ids, renormalise(s, ids, routed_scale)


# ---------------------------------------------------------------------------------------------- experts
def _check_expert_args(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale):
    check_tensor("z", z, ndim=2, dtypes=FLOAT_DTYPES)
    B, L = z.shape
    check_tensor("ids", ids, ndim=2, dtypes=(torch.int64, torch.int32))
    if ids.shape[0] != B:
        raise ValueError(f"ids: expected {B} rows (tokens of z), got shape {tuple(ids.shape)}")
    check_tensor("weights", weights, shape=tuple(ids.shape), dtypes=FLOAT_DTYPES)
    check_tensor("w13_packed", w13_packed, ndim=3, dtypes=(torch.uint8,))
    E, two_i = w13_packed.shape[0], w13_packed.shape[1]
    if two_i % 2 or w13_packed.shape[2] * 2 != L:
        raise ValueError(f"w13_packed: expected [E, 2I, {L // 2}] (L={L} packed two per byte), got {tuple(w13_packed.shape)}")
    inter = two_i // 2
    if inter % GROUP:
        raise ValueError(f"w13_packed: intermediate {inter} is not a multiple of the MXFP4 group {GROUP}")
    check_tensor("w13_scale", w13_scale, shape=(E, two_i, L // GROUP), dtypes=(torch.uint8,))
    check_tensor("w2_packed", w2_packed, shape=(E, L, inter // 2), dtypes=(torch.uint8,))
    check_tensor("w2_scale", w2_scale, shape=(E, L, inter // GROUP), dtypes=(torch.uint8,))
    if ids.numel() and (int(ids.max()) >= E or int(ids.min()) < -1):
        raise ValueError(f"ids: values must be expert ids in 0..{E - 1} or -1 (padding), got "
                         f"{int(ids.min())}..{int(ids.max())}")


def _dequant_expert(e, w13_packed, w13_scale, w2_packed, w2_scale, wd: str):
    """(w13[2I, L], w2[L, I]) of expert e in the working dtype; exact, so caching it changes nothing."""
    return (mxfp4_dequant(w13_packed[e], w13_scale[e], wd), mxfp4_dequant(w2_packed[e], w2_scale[e], wd))


def _expert_forward(z_rows, w13, w2, beta, linear_beta):
    """One expert on rows z_rows[M, L]: w2( situ_and_mul( w13 z ) ), every GEMV rounded to wd."""
    return linear(situ_and_mul(linear(z_rows, w13), beta, linear_beta), w2)


def moe_experts_mxfp4(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                      w2_packed: torch.Tensor, w2_scale: torch.Tensor,
                      situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """Routed experts: y[b] = wd( sum_j weights[b,j] * E_{ids[b,j]}(z[b]) ), the sum in acc, slot order.

    Per (token, expert): dequantise w1/w3 and w2 to wd (exact), GEMV in acc rounded to wd, SiTU-and-mul,
    w2 GEMV rounded to wd. ids == -1 is padding (skipped). w13 rows = [w1 (gate); w3 (up)].
    """
    _check_expert_args(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
    acc = acc_dtype(z)
    B, k = ids.shape
    y = torch.zeros((B, z.shape[1]), dtype=acc, device=z.device)
    dequantised = {}
    for b in range(B):
        for j in range(k):
            e = int(ids[b, j])
            if e < 0:
                continue
            if e not in dequantised:
                dequantised[e] = _dequant_expert(e, w13_packed, w13_scale, w2_packed, w2_scale, dtype_name(z.dtype))
            o = _expert_forward(z[b:b + 1], *dequantised[e], situ_beta, situ_linear_beta)
            y[b] += weights[b, j].to(acc) * o[0].to(acc)
    return y.to(z.dtype)


def moe_experts_mxfp4_grouped(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                              situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """Independent formulation for tests: (token, slot) pairs sorted by expert, one batched GEMM per
    expert (the grouped-GEMM layout of serving kernels), outputs scattered back and combined in acc."""
    _check_expert_args(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
    acc = acc_dtype(z)
    B, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    per_pair = torch.zeros((B * k, z.shape[1]), dtype=acc, device=z.device)
    for e in torch.unique(flat[flat >= 0]).tolist():
        pairs = order[flat[order] == e]
        rows = z[pairs // k]
        weights_e = _dequant_expert(e, w13_packed, w13_scale, w2_packed, w2_scale, dtype_name(z.dtype))
        per_pair[pairs] = _expert_forward(rows, *weights_e, situ_beta, situ_linear_beta).to(acc)
    weighted = per_pair.reshape(B, k, -1) * weights.to(acc).unsqueeze(-1)
    return weighted.sum(1).to(z.dtype)


def moe_tp_shard_width(inter: int, T: int) -> int:
    """Per-rank intermediate width of the routed experts under TP.

    vLLM pads 3072/T up to 256 per rank (T=16: 192 -> 256, 4096 in all, zero-filled); we scale that
    floor with the config (inter // 12 = 256 at K3) and round up to the MXFP4 group so the w2 scales
    of a rank are whole groups.
    """
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T: {T!r} must be a positive int (ranks)")
    width = max(-(-inter // T), inter // 12)
    return -(-width // GROUP) * GROUP


# ---------------------------------------------------------------------------------------------- dense
def latent_norm_up(y_latent: torch.Tensor, norm_w: torch.Tensor, w_up: torch.Tensor,
                   shared_out: torch.Tensor, eps: float) -> torch.Tensor:
    """out = wd( linear(rms_norm(y_latent, norm_w, eps), w_up) ) + shared_out (a wd add, as HF)."""
    check_tensor("y_latent", y_latent, ndim=2, dtypes=FLOAT_DTYPES)
    B, L = y_latent.shape
    wd = (y_latent.dtype,)
    check_tensor("norm_w", norm_w, shape=(L,), dtypes=wd)
    check_tensor("w_up", w_up, shape=(None, L), dtypes=wd)
    check_tensor("shared_out", shared_out, shape=(B, w_up.shape[0]), dtypes=wd)
    return linear(rms_norm(y_latent, norm_w, eps), w_up) + shared_out


def shared_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """y = w_down( situ_and_mul( w_gate_up x ) ); w_gate_up rows = [gate; up] (the fused pair of
    2 shared experts, inter 2 x 3072). Each GEMM accumulates in acc, rounded once to wd."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    D = x.shape[1]
    check_tensor("w_gate_up", w_gate_up, shape=(None, D), dtypes=(x.dtype,))
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up: rows {w_gate_up.shape[0]} must be even ([gate; up] halves)")
    check_tensor("w_down", w_down, shape=(D, w_gate_up.shape[0] // 2), dtypes=(x.dtype,))
    return linear(situ_and_mul(linear(x, w_gate_up), situ_beta, situ_linear_beta), w_down)


def dense_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """Layer-0 dense MLP (intermediate 33792): the same math as the shared experts."""
    return shared_experts(x, w_gate_up, w_down, situ_beta, situ_linear_beta)


def l2_prefetch(*weights: torch.Tensor, **named_weights: torch.Tensor) -> None:
    """Prefetch the next layer's weights into L2. The reference has no effect at all: no output, no
    write; the fused kernel is judged on leaving every tensor bitwise unchanged."""
    for i, w in enumerate(weights):
        check_tensor(f"weights[{i}]", w)
    for name, w in named_weights.items():
        check_tensor(name, w)
    return None
