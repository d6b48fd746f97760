"""Planted bugs in the MoE ops (references/moe.py)."""
from __future__ import annotations

import torch

from references.moe import RENORM_EPS, moe_experts_mxfp4, router_choice_scores, router_topk, shared_experts
from references.primitives import acc_dtype, linear


def router_topk_higher_id_wins(x, w_gate, bias, top_k: int, routed_scale: float):
    """Warp argmax compares with >= instead of >: on equal choice scores the HIGHER id wins."""
    s, choice = router_choice_scores(x, w_gate, bias)
    E = choice.shape[1]
    rev = torch.sort(choice.flip(-1), dim=-1, descending=True, stable=True).indices[:, :top_k]
    ids = (E - 1 - rev).contiguous()
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + RENORM_EPS) * routed_scale


def router_topk_ids_by_expert(x, w_gate, bias, top_k: int, routed_scale: float):
    """The right experts and weights, listed by expert id (a bitmask select's natural order) instead of
    by descending score: the MoE combine then sums the slots in another order."""
    s, choice = router_choice_scores(x, w_gate, bias)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k].sort(-1).values.contiguous()
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + RENORM_EPS) * routed_scale


def router_topk_renorm_over_all(x, w_gate, bias, top_k: int, routed_scale: float):
    """Renormalises by the sum of ALL experts' scores instead of the selected top-k."""
    s, choice = router_choice_scores(x, w_gate, bias)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return ids, s.gather(1, ids) / (s.sum(-1, keepdim=True) + RENORM_EPS) * routed_scale


def router_topk_not_renormalised(x, w_gate, bias, top_k: int, routed_scale: float):
    """Returns the raw sigmoid scores of the chosen experts (norm_topk_prob ignored)."""
    s, choice = router_choice_scores(x, w_gate, bias)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return ids, s.gather(1, ids) * routed_scale


def router_topk_weights_in_wd(x, w_gate, bias, top_k: int, routed_scale: float):
    """Stores the weights in the activation dtype instead of fp32."""
    ids, w = router_topk(x, w_gate, bias, top_k, routed_scale)
    return ids, w.to(x.dtype)


def router_topk_bf16_logits(x, w_gate, bias, top_k: int, routed_scale: float):
    """The gate GEMM in the activation dtype (cuBLAS bf16 out), then sigmoid in fp32: logits rounded
    to bf16 (2^-9 relative). The magnitude floor (ulps of sum|x w|) must still see it."""
    logits = (x @ w_gate.T).to(torch.float32)
    s = torch.sigmoid(logits)
    ids = torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + RENORM_EPS) * routed_scale


def router_topk_weights_from_choice(x, w_gate, bias, top_k: int, routed_scale: float):
    """Weights renormalised from the biased choice scores s + bias instead of the unbiased s."""
    _, choice = router_choice_scores(x, w_gate, bias)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = choice.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + RENORM_EPS) * routed_scale


def moe_experts_mxfp4_no_linear_beta(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                     situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """SiTU-and-mul without the up-branch soft cap 25 tanh(up / 25) (linear_beta dropped)."""
    return moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, None)


def shared_experts_halves_swapped(x, w_gate_up, w_down, situ_beta: float = 4.0,
                                  situ_linear_beta: float = 25.0):
    """Reads w_gate_up as [up; gate] (the other fused-layout convention)."""
    half = w_gate_up.shape[0] // 2
    swapped = torch.cat([w_gate_up[half:], w_gate_up[:half]], dim=0)
    return shared_experts(x, swapped, w_down, situ_beta, situ_linear_beta)


def latent_norm_up_batch_rms(y_latent, norm_w, w_up, shared_out, eps: float):
    """RMSNorm reduction over the whole batch (mean over every element), not per row."""
    x32 = y_latent.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean() + eps)).to(y_latent.dtype) * norm_w
    return linear(y, w_up) + shared_out


def l2_prefetch_returns_handle(*weights, **named_weights):
    """Returns the prefetch 'handle' (the dense weight) instead of nothing."""
    return named_weights.get("w_dense")


def l2_prefetch_store_not_prefetch(*weights, **named_weights):
    """Uses a store (st.global.L2) for the touch instead of prefetch.global.L2: the last element of
    every weight is written back as zero."""
    for w in list(weights) + list(named_weights.values()):
        w.view(-1)[-1] = 0
    return None


def router_topk_ignores_routed_scale(x, w_gate, bias, top_k: int, routed_scale: float):
    """The epilogue never multiplies by routed_scale (1.0 in every config)."""
    s, choice = router_choice_scores(x, w_gate, bias)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + RENORM_EPS)


def moe_experts_mxfp4_minus1_is_last_expert(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                            situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Indexes the experts with the raw id: a padding slot (-1) runs the last expert instead of nothing."""
    ids = torch.where(ids < 0, ids + w13_packed.shape[0], ids)
    return moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                             situ_linear_beta)


def moe_experts_mxfp4_renormalises_weights(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                           situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Divides the routing weights by their row sum again (they already carry routed_scale)."""
    weights = weights / weights.sum(-1, keepdim=True)
    return moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                             situ_linear_beta)


def shared_experts_fixed_situ(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """SiTU's betas baked in at K3's 4 and 25; the arguments are ignored."""
    return shared_experts(x, w_gate_up, w_down, 4.0, 25.0)


def moe_experts_mxfp4_nan_scale_as_one(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                       situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """E8M0 decode that ignores the NaN encoding: scale byte 0xFF read as 2^0. Certified while
    the expert draws held no 0xFF byte and a NaN oracle row made the whole case vacuous; the
    scales='extreme' case now holds them, and NaN oracle elements are judged."""
    w13_scale = torch.where(w13_scale == 0xFF, torch.full_like(w13_scale, 127), w13_scale)
    w2_scale = torch.where(w2_scale == 0xFF, torch.full_like(w2_scale, 127), w2_scale)
    return moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                             situ_linear_beta)


def moe_experts_mxfp4_all_pad_rows_unwritten(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                             situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """A grouped GEMM that scatters each (token, expert) pair's result into the output and never writes
    a token none of whose slots is real (every id -1: under expert parallelism, a token routed only to
    other ranks' experts): that row keeps what the allocation held."""
    y = moe_experts_mxfp4(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta)
    out = torch.empty_like(y)
    live = (ids >= 0).any(-1)
    out[live] = y[live]
    return out


def _experts_combined(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta,
                      combine_in_wd: bool = False, weight_shift: int = 0):
    """Per (token, slot) expert outputs as the reference computes them (o in wd), combined in slot order:
    in fp32 (the reference's combine), or with every partial sum rounded to wd (`combine_in_wd`); each
    slot weighted by the weight `weight_shift` pairs further on in the flattened [B * k] order."""
    from references.moe import _dequant_expert, _expert_forward, dtype_name

    B, k = ids.shape
    flat_w = weights.reshape(-1)
    y = torch.zeros((B, z.shape[1]), dtype=torch.float32)
    cache = {}
    for b in range(B):
        for j in range(k):
            e = int(ids[b, j])
            if e < 0:
                continue
            if e not in cache:
                cache[e] = _dequant_expert(e, w13_packed, w13_scale, w2_packed, w2_scale, dtype_name(z.dtype))
            o = _expert_forward(z[b:b + 1], *cache[e], situ_beta, situ_linear_beta)[0].to(torch.float32)
            w = flat_w[(b * k + j + weight_shift) % flat_w.numel()].to(torch.float32)
            y[b] = y[b] + w * o
            if combine_in_wd:
                y[b] = y[b].to(z.dtype).to(torch.float32)
    return y.to(z.dtype)


def moe_experts_mxfp4_control(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                              situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """The helper of the two bugs below with neither bug: must certify."""
    return _experts_combined(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                             situ_linear_beta)


def moe_experts_mxfp4_combined_in_wd(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                     situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """The experts' weighted outputs summed in the working dtype (bf16 / fp16 partial sums), not fp32:
    within tolerance on plain draws, many ulps off where two slots' terms cancel (routing='edges')."""
    return _experts_combined(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                             situ_linear_beta, combine_in_wd=True)


def moe_experts_mxfp4_neighbour_weight(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                                       situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """A grouped combine that reads the weight of the next (token, slot) pair: each expert's output
    weighted by its neighbour's routing weight."""
    return _experts_combined(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta,
                             situ_linear_beta, weight_shift=1)


# ---------------------------------------------------------------------------------- fused-kernel twins
def _situ_mul_rows(x, w_gate_up, w_down, situ_beta: float, situ_linear_beta: float,
                   sigmoid_of_up: bool = False, betas_swapped: bool = False):
    """shared_experts as fused/shared_experts.py computes it: h = wd(x W_gu^T), a thread's SiTU-and-mul
    on the gate chunk and the up chunk in fp32, a = wd(act * up), y = wd(a W_d^T). The switches plant
    the bugs of the rows below; both off, it is the reference's math."""
    beta, lbeta = (situ_linear_beta, situ_beta) if betas_swapped else (situ_beta, situ_linear_beta)
    h = linear(x, w_gate_up)
    inter = h.shape[1] // 2
    acc = acc_dtype(x)
    g, u = h[:, :inter].to(acc), h[:, inter:].to(acc)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(u if sigmoid_of_up else g)
    a = (act * (lbeta * torch.tanh(u / lbeta))).to(x.dtype)
    return linear(a, w_down)


def shared_experts_control(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """No bug: the helper the two rows below plant their bugs in (test_planted_bugs checks it certifies)."""
    return _situ_mul_rows(x, w_gate_up, w_down, situ_beta, situ_linear_beta)


def shared_experts_sigmoid_of_up(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """SiTU's sigmoid taken of the up chunk instead of the gate chunk (the wrong register of the pair)."""
    return _situ_mul_rows(x, w_gate_up, w_down, situ_beta, situ_linear_beta, sigmoid_of_up=True)


def shared_experts_betas_swapped(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """The kernel's two scalar arguments passed in the wrong order: the gate capped by linear_beta,
    the up branch by beta."""
    return _situ_mul_rows(x, w_gate_up, w_down, situ_beta, situ_linear_beta, betas_swapped=True)


def _norm_up_rows(y_latent, norm_w, w_up, shared_out, eps: float, padded_mean: bool = False,
                  shared_of_token0: bool = False):
    """latent_norm_up as fused/latent_norm_up.py computes it: per token r = rsqrt(sum x^2 / L + eps) in
    fp32, xn = wd(norm_w * wd(x r)), o = wd(xn W_up^T), out = wd(o + shared_out). The switches plant
    the bugs of the rows below; both off, it is the reference's math."""
    acc = acc_dtype(y_latent)
    wd = y_latent.dtype
    x = y_latent.to(acc)
    L = x.shape[1]
    width = -(-L // 256) * 256 if padded_mean else L
    r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / width + eps)
    xn = (norm_w.to(acc) * (x * r).to(wd).to(acc)).to(wd)
    s = shared_out[:1].expand_as(shared_out) if shared_of_token0 else shared_out
    return (linear(xn, w_up).to(acc) + s.to(acc)).to(wd)


def latent_norm_up_control(y_latent, norm_w, w_up, shared_out, eps: float):
    """No bug: the helper the two rows below plant their bugs in (test_planted_bugs checks it certifies)."""
    return _norm_up_rows(y_latent, norm_w, w_up, shared_out, eps)


def latent_norm_up_padded_mean(y_latent, norm_w, w_up, shared_out, eps: float):
    """The mean of squares divided by the lanes' padded width (32 lanes x 16-byte chunks: L rounded up to
    256) instead of L: right where L is a multiple of 256 (K3), wrong by sqrt(256 / L) elsewhere."""
    return _norm_up_rows(y_latent, norm_w, w_up, shared_out, eps, padded_mean=True)


def latent_norm_up_shared_of_token0(y_latent, norm_w, w_up, shared_out, eps: float):
    """The epilogue adds token 0's shared_out to every token (the row index of shared_out dropped)."""
    return _norm_up_rows(y_latent, norm_w, w_up, shared_out, eps, shared_of_token0=True)
