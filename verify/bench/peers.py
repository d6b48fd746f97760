"""Peers: other libraries' implementations of an op, as the registry declares them (OpDef.peers).

Each is `prepare(tensors, params) -> launch`: the op's own inputs (one rank's, on the device) in,
a zero-argument launch out. What a serving engine using that library would keep in the library's
own layout (an fp32 router weight, fla's conv cache) is made here, untimed; the launch does only
what the library does per decode step. A library that is not installed raises ImportError.
"""
from __future__ import annotations


def torch_linear(tensors: dict, params: dict):
    """skinny_gemm as torch.nn.functional.linear (cuBLAS / cuBLASLt): y = x @ w.T in the working dtype."""
    import torch.nn.functional as F

    x, w = tensors["x"], tensors["w"]
    return lambda: F.linear(x, w)


def cublas_logits(tensors: dict, params: dict):
    """router_topk's logits GEMM alone, bf16 in and out through cuBLAS: a lower bound on any router
    built on cuBLAS's GEMM (no sigmoid, no top-k)."""
    import torch

    x, w = tensors["x"], tensors["w_gate"]
    return lambda: torch.matmul(x, w.T)


def _fp32_logits(x, w):
    """fp32 logits of bf16 x and w through one cuBLAS GEMM: bf16 operands with fp32 output where torch
    offers it (torch.mm's out_dtype), else an fp32 GEMM of w converted once, here, untimed."""
    import torch

    try:
        torch.mm(x[:1], w[:1].T, out_dtype=torch.float32)
        return lambda: torch.mm(x, w.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        w32 = w.float()
        return lambda: torch.mm(x.float(), w32.T)


def cublas_logits_topk(tensors: dict, params: dict):
    """router_topk as a serving engine composes it from library calls: the fp32 logits GEMM (cuBLAS),
    sigmoid, + bias, torch.topk, gather and renormalise x routed_scale. Ties go as torch.topk puts
    them (not the op's declared lower-id order): a speed peer, not a certified candidate."""
    import torch

    bias, k, scale = tensors["bias"].float(), int(params["top_k"]), float(params["routed_scale"])
    logits = _fp32_logits(tensors["x"], tensors["w_gate"])

    def launch():
        s = torch.sigmoid(logits())
        ids = torch.topk(s + bias, k, dim=-1, sorted=True).indices
        w = s.gather(1, ids)
        return ids, w / w.sum(-1, keepdim=True) * scale
    return launch


def _fla():
    try:
        try:
            from fla.modules.causal_conv1d import causal_conv1d_update
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
        except ModuleNotFoundError:         # fla-core 0.5's layout of the same functions
            from fla.modules.convolution import causal_conv1d_update
            from fla.modules.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import fused_recurrent_kda
    except Exception as e:  # noqa: BLE001  (missing package, or triton without a device)
        raise ImportError(f"fla-core is not importable here ({type(e).__name__}: {e}); "
                          "install it with `pip install fla-core`") from None
    return causal_conv1d_update, fused_recurrent_kda, rms_norm_gated


def _kda_dims(tensors: dict) -> tuple[int, int, int, int]:
    B, C = tensors["q_raw"].shape
    H = tensors["A_log"].shape[0]
    return B, C, H, C // H


def _recurrence(fused_recurrent_kda, q, k, v, tensors: dict, params: dict):
    """fla's recurrence on one decode token per sequence: q/k L2 norm, the lower-bound gate, sigmoid
    beta in the kernel; the fp32 state V-first (the op's layout), written to a new tensor."""
    B, C, H, Dh = _kda_dims(tensors)
    g = tensors["g_raw"].view(B, 1, H, Dh)
    beta = tensors["beta_raw"].view(B, 1, H)
    return lambda: fused_recurrent_kda(
        q.view(B, 1, H, Dh), k.view(B, 1, H, Dh), v.view(B, 1, H, Dh), g, beta,
        A_log=tensors["A_log"], dt_bias=tensors["dt_bias"], scale=Dh ** -0.5, initial_state=tensors["state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=float(params["lower_bound"]), state_v_first=True)


def fla_recurrence(tensors: dict, params: dict):
    """kda_decode's recurrence alone through fla.ops.kda.fused_recurrent_kda, on the short convs'
    outputs computed here, untimed: a lower bound on the op through fla (no convs, no gated norm)."""
    from references.kda import short_conv_update

    _, fused_recurrent_kda, _ = _fla()
    conv_state = tensors["conv_state"].clone()
    q, k, v = (short_conv_update(tensors[n], tensors["conv_w"][i], conv_state[:, i])
               for i, n in enumerate(("q_raw", "k_raw", "v_raw")))
    return _recurrence(fused_recurrent_kda, q, k, v, tensors, params)


def fla_kda_decode(tensors: dict, params: dict):
    """The whole of kda_decode through fla: three causal_conv1d_update launches (SiLU; fla's cache
    layout [B, C, W], made here from the op's conv_state), fused_recurrent_kda, and the gated RMSNorm
    (rms_norm_gated, sigmoid gate) -> y [B, C] in the working dtype."""
    import torch

    causal_conv1d_update, fused_recurrent_kda, rms_norm_gated = _fla()
    B, C, H, Dh = _kda_dims(tensors)
    conv_w, conv_state = tensors["conv_w"], tensors["conv_state"]
    W = conv_w.shape[-1]
    caches = [torch.cat([conv_state.new_zeros(B, C, 1), conv_state[:, i]], dim=-1).contiguous() for i in range(3)]
    weights = [conv_w[i].contiguous() for i in range(3)]
    assert caches[0].shape == (B, C, W)
    outs = {}

    def convs():
        for i, n in enumerate(("q_raw", "k_raw", "v_raw")):
            outs[n], _ = causal_conv1d_update(tensors[n], caches[i], weight=weights[i], activation="silu")

    z, w_norm, eps = tensors["z"].view(B * H, Dh), tensors["o_norm_w"], float(params["norm_eps"])

    def launch():
        convs()
        o, _ = _recurrence(fused_recurrent_kda, outs["q_raw"], outs["k_raw"], outs["v_raw"], tensors, params)()
        return rms_norm_gated(o.reshape(B * H, Dh), z, w_norm, None, activation="sigmoid", eps=eps).view(B, C)
    return launch


def kda_decode_per_token(tensors: dict, params: dict):
    """kda_verify without a multi-token kernel: n_q fused kda_decode launches over the batch (every slot
    of every sequence; a serving engine pads the ragged counts), each token's conv window and state
    copied to its checkpoint slot. The committed state is not changed (the launches run on a copy)."""
    import torch

    from fused.kda_decode import kda_decode

    n_q = tensors["q_raw"].shape[1]
    cs, st = tensors["conv_state"].clone(), tensors["state"].clone()
    layer = {n: tensors[n] for n in ("conv_w", "A_log", "dt_bias", "o_norm_w")}
    scalars = {n: params[n] for n in ("lower_bound", "l2_eps", "norm_eps")}

    def launch():
        cs.copy_(tensors["conv_state"])
        st.copy_(tensors["state"])
        ys = []
        for t in range(n_q):
            ys.append(kda_decode(*(tensors[n][:, t] for n in ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")),
                                 layer["conv_w"], cs, layer["A_log"], layer["dt_bias"], layer["o_norm_w"], st,
                                 **scalars))
            tensors["conv_ckpt"][:, t].copy_(cs)
            tensors["state_ckpt"][:, t].copy_(st)
        return torch.stack(ys, 1)
    return launch


def fla_recurrence_tokens(tensors: dict, params: dict):
    """fla's fused_recurrent_kda over the n_q draft tokens of every sequence (the convs computed here,
    untimed), final state only: what fla offers for a multi-token step, without per-token checkpoints,
    convs or the gated norm."""
    import torch

    from references.kda import short_conv_update

    _, fused_recurrent_kda, _ = _fla()
    B, n_q, C = tensors["q_raw"].shape
    H = tensors["A_log"].shape[0]
    Dh = C // H
    conv_state = tensors["conv_state"].clone()
    outs = {n: [] for n in ("q_raw", "k_raw", "v_raw")}
    for t in range(n_q):
        for i, n in enumerate(("q_raw", "k_raw", "v_raw")):
            outs[n].append(short_conv_update(tensors[n][:, t], tensors["conv_w"][i], conv_state[:, i]))
    q, k, v = (torch.stack(outs[n], 1).view(B, n_q, H, Dh) for n in ("q_raw", "k_raw", "v_raw"))
    g, beta = tensors["g_raw"].view(B, n_q, H, Dh), tensors["beta_raw"]
    return lambda: fused_recurrent_kda(
        q, k, v, g, beta, A_log=tensors["A_log"], dt_bias=tensors["dt_bias"], scale=Dh ** -0.5,
        initial_state=tensors["state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=float(params["lower_bound"]),
        state_v_first=True)


def dequant_cublas_experts(tensors: dict, params: dict):
    """moe_experts_mxfp4 the way a user without a fused MXFP4 MoE kernel runs it: each distinct chosen
    expert's w13 and w2 dequantised to the working dtype by the fused mxfp4_dequant kernel (into two
    scratch buffers made here, reused expert after expert on the one stream), then cuBLAS GEMMs over the
    rows routed to that expert, SiTU-and-mul in torch, and the routing-weighted combine in fp32
    (index_add), rounded once to the working dtype. The (token, slot) pairs are grouped by expert here,
    untimed, from the ids: the launch has no host sync (capturable), which makes it no slower than an
    engine that groups them per step. Off CUDA the dequantisation is the reference's (tests)."""
    import torch

    from references.mxfp4 import mxfp4_dequant
    from references.primitives import situ_and_mul

    z, ids, weights = tensors["z"], tensors["ids"], tensors["weights"]
    p13, s13, p2, s2 = (tensors[n] for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"))
    if z.is_cuda:
        from fused.mxfp4_dequant import launch as dequant
    else:
        def dequant(packed, scale, out):
            out.copy_(mxfp4_dequant(packed, scale, str(out.dtype).removeprefix("torch.")))
    B, k = ids.shape
    flat = ids.reshape(-1).long().cpu()
    groups = []
    for e in sorted(set(flat[flat >= 0].tolist())):
        pairs = torch.nonzero(flat == e).flatten()
        groups.append((e, (pairs // k).to(z.device), pairs.to(z.device)))
    w13 = torch.empty(p13.shape[1], p13.shape[2] * 2, dtype=z.dtype, device=z.device)
    w2 = torch.empty(p2.shape[1], p2.shape[2] * 2, dtype=z.dtype, device=z.device)
    route = weights.reshape(-1).float()
    beta, linear_beta = float(params["situ_beta"]), float(params["situ_linear_beta"])

    def launch():
        y = torch.zeros(B, w2.shape[0], dtype=torch.float32, device=z.device)
        for e, rows, pairs in groups:
            dequant(p13[e], s13[e], w13)
            dequant(p2[e], s2[e], w2)
            h = situ_and_mul(torch.nn.functional.linear(z[rows], w13), beta, linear_beta)
            o = torch.nn.functional.linear(h, w2)
            y.index_add_(0, rows, o.float() * route[pairs].unsqueeze(1))
        return y.to(z.dtype)
    return launch


def fold_norm_up_add(tensors: dict, params: dict):
    """allreduce_latent_norm_up as the project's separate kernels compute it, in four launches
    (allreduce_fold of each half, latent_norm_up, the residual add): the one-launch tail must beat it."""
    from fused.allreduce_fold import allreduce_fold
    from fused.latent_norm_up import latent_norm_up

    t, eps = tensors, params["eps"]
    return lambda: t["prefix"] + latent_norm_up(allreduce_fold(t["y_parts"]), t["norm_w"], t["w_up"],
                                                allreduce_fold(t["shared_parts"]), eps)


def fold_then_tail(tensors: dict, params: dict):
    """allreduce_latent_norm_up in two launches (fused.allreduce_latent_norm_up_prefold): the latent half
    folded once, then the one-launch tail on it. Benched beside the one-launch tail, it says at which
    T and B folding in every CTA costs more than the extra launch."""
    from fused.allreduce_latent_norm_up_prefold import allreduce_latent_norm_up

    t, eps = tensors, params["eps"]
    return lambda: allreduce_latent_norm_up(t["prefix"], t["y_parts"], t["shared_parts"], t["norm_w"], t["w_up"], eps)
