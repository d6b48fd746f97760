"""Registry entries for whole layers over decode steps: kda_layer and mla_layer (references/layers.py).

A case is one K3 layer (index from the seed or the `layer_idx` knob) with seeded synthetic weights
(references.weights, seed = case.seed), B sequences with warm state, stepped N decode steps (knob
`steps`, else drawn in 2..5). x_steps follows the case's distribution; weights stay as references.weights
draws them. The block snapshots fill all 8 slots (those past n_blocks must be ignored; a push layer
overwrites slot n_blocks) at per-block scales 2^-2..2^2, as block sums differ in size.
"""
from __future__ import annotations

import torch

from references.config import get_config
from references.layers import BLOCK_SLOTS, layer_kind_of
from references.weights import make_layer_weights
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, Peer
from verify.ops.common_splits import activation, gen_for, working_dtype
from verify.ops.kda import starting_state

STEP_RANGE = (2, 5)      # decode steps per case, drawn
# and in the knob sweep, runs of 64 steps with their state (a fused layer's per-step error must not
# grow with the steps: the specs' derivations bound it at every step)
LONG_RUNS = ({"steps": 64},)
DENSE_LAYER = ({"layer_idx": 0},)        # kda_layer's knob sweep: layer 0, the dense MLP's layer
# one rank of a T-rank layer (the registry forms' tp form: rank_inputs): heads, expert width and the
# shared / dense intermediate split T ways, the other ranks' partials given
RANK_FORMS = ({"tp": 2}, {"tp": 4})
DENSE_RANK = ({"layer_idx": 0, "tp": 2},)   # the dense layer's rank step: its MLP split T ways too
MAX_BATCH = 4            # the reference loops over (token, expert) pairs in Python: keep a case ~1 s
MAX_CONTEXT_PAGES = 4    # MLA context already cached before the first step, per sequence
# layer indices worth drawing: first layer of a block (push), 1..8 blocks before the layer, the last layers
KDA_LAYERS = (1, 2, 12, 13, 24, 50, 84, 85, 90)
MLA_LAYERS = (3, 11, 15, 47, 83, 87, 91, 92)
DISTS = ("normal", "heavy_tailed", "outliers", "zero_rows", "small_rows")


def _layer_idx(case: Case, kind: str) -> int:
    """The case's layer (knob `layer_idx`, else drawn); kda_layer takes layer 0 too (the knob sweep's
    dense layer: KDA attention, the dense MLP)."""
    choices = KDA_LAYERS if kind == "kda" else MLA_LAYERS
    idx = int(case.knob("layer_idx", choices[int(torch.randint(0, len(choices), (1,), generator=gen_for(case, "layer")))]))
    if layer_kind_of(idx) != kind and not (kind == "kda" and idx == 0):
        raise ValueError(f"layer_idx={idx}: K3 layer {idx} is a {layer_kind_of(idx)!r} layer, not {kind!r}")
    return idx


def _steps(case: Case) -> int:
    """Decode steps: the `steps` knob, else drawn in STEP_RANGE from the seed (a layer that resets its
    state every 3 steps, or stops advancing seq_lens after step 3, was certified while every case ran 3)."""
    drawn = int(torch.randint(STEP_RANGE[0], STEP_RANGE[1] + 1, (1,), generator=gen_for(case, "steps")))
    n = int(case.knob("steps", drawn))
    if n < 1:
        raise ValueError(f"steps={n}: a layer case needs at least one decode step")
    return n


def _rank_form(case: Case, inputs: OpInputs) -> OpInputs:
    """The `tp` knob (T > 1): rank 0's step of a T-rank layer, the other ranks' partials given as
    inputs (rank_inputs, seeded by the case)."""
    T = int(case.knob("tp", 1))
    if T < 1:
        raise ValueError(f"tp={T}: a layer case runs on 1 or more ranks")
    return inputs if T == 1 else rank_inputs(inputs, T, seed=case.seed)


def _common(case: Case, kind: str, weights=None) -> tuple[dict, dict]:
    cfg, wd, B = get_config(case.config), working_dtype(case), case.batch
    layer_idx = _layer_idx(case, kind)
    weights = make_layer_weights(layer_kind_of(layer_idx), cfg, case.seed, wd) if weights is None else weights
    scales = torch.exp2(torch.randint(-2, 3, (BLOCK_SLOTS,), generator=gen_for(case, "block_scales")).double())
    blocks = torch.stack([activation(case, f"block{i}", (B, cfg.hidden), wd, scale=float(scales[i]))
                          for i in range(BLOCK_SLOTS)], dim=1)
    x_steps = activation(case, "x_steps", (_steps(case), B, cfg.hidden), wd)
    params = {"layer_idx": layer_idx, "config": case.config}
    return {"x_steps": x_steps, "blocks": blocks, **weights.tensors}, params


def make_kda_layer_inputs(case: Case, weights=None) -> OpInputs:
    """The case's inputs; `weights` (a references.weights.LayerWeights) in place of the seeded draw
    (the bench's K3 rows take weights drawn on the device: stock.weights.make_layer_weights_on)."""
    tensors, params = _common(case, "kda", weights)
    cfg, wd, B = get_config(case.config), working_dtype(case), case.batch
    C = cfg.n_heads * cfg.head_dim
    tensors["conv_state"] = activation(case, "conv_state", (B, 3, C, cfg.conv_kernel - 1), wd, dist="normal")
    tensors["recurrent_state"] = starting_state(case, B, cfg.n_heads, cfg.head_dim)
    return _rank_form(case, OpInputs(tensors, params))


def mla_paged_state(case: Case, n_steps: int) -> dict[str, torch.Tensor]:
    """Cached context of 0..MAX_CONTEXT_PAGES pages per sequence (lengths around page boundaries drawn
    too), pages a random permutation, room for n_steps more tokens, -1 past each row's pages; the whole
    cache holds normal values, so a stray read or write shows."""
    cfg, wd, B = get_config(case.config), working_dtype(case), case.batch
    page, g = cfg.page_size, gen_for(case, "paged")
    lengths = []
    for _ in range(B):
        m = int(torch.randint(0, MAX_CONTEXT_PAGES + 1, (1,), generator=g))
        lengths.append(max(0, m * page + int(torch.randint(-1, 2, (1,), generator=g))))
    need = [-(-(n + n_steps) // page) for n in lengths]
    n_pages = sum(need) + 1
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = torch.full((B, max(need) + 1), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n]
        start += n
    cache = activation(case, "cache", (n_pages, page, cfg.cache_dim), wd, dist="normal")
    return {"cache": cache, "block_table": table, "seq_lens": torch.tensor(lengths, dtype=torch.int32)}


def make_mla_layer_inputs(case: Case, weights=None) -> OpInputs:
    """As make_kda_layer_inputs, with the paged cache state."""
    tensors, params = _common(case, "mla", weights)
    tensors.update(mla_paged_state(case, tensors["x_steps"].shape[0]))
    return _rank_form(case, OpInputs(tensors, params))


EXPERT_TENSORS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")
STATE_TENSORS = {"kda": ("conv_state", "recurrent_state"), "mla": ("cache", "block_table", "seq_lens")}


def step_choices(inputs: OpInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids[B,k], choice scores[B,E]) of the reference's router at each of the case's steps, from the
    attention side only (copies of the state; the routed experts, whose output the next step never sees,
    are not run): the step's input is x_steps[t] and its state the one the earlier steps' attention left.
    In the inputs' dtype and on their device: float64 inputs give the oracle's scores. The dense layer
    0 routes nothing: ids [B,0], scores [B,0]. Memoised on the inputs' tensors (identity and version):
    the judge asks once per comparison, a dozen times a case."""
    return _memo(("choices",), inputs, lambda: _step_choices(inputs))


def _step_choices(inputs: OpInputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from references.attn_res import attn_res_rmsnorm
    from references.layers import attn_side, kda_attention, mla_attention, next_slots, router_choice
    from references.moe import router_topk

    from references.attn_res import fold_partials

    t, p = inputs.tensors, inputs.params
    kind = _kind(t)
    cfg, x_steps = layer_config(inputs), t["x_steps"]
    if "w_router" not in t:                      # layer 0: the dense MLP, no router
        none = torch.empty(x_steps.shape[1], 0, device=x_steps.device)
        return [(none.to(torch.int64), none.to(torch.float64)) for _ in range(x_steps.shape[0])]
    w, state = _weights(inputs, kind), _state_copy(inputs, kind)
    out = []
    for step, x in enumerate(x_steps):
        state.prefix.copy_(x)
        slots = next_slots(state) if kind == "mla" else None
        x_in, mlp_blocks = attn_side(w, state, p["layer_idx"])
        attn = kda_attention(x_in, w, state) if kind == "kda" else mla_attention(x_in, w, state, slots)
        if "peer_attn" in t:                   # one rank's step: its partial folded with its peers'
            attn = fold_partials(torch.cat([attn.unsqueeze(0), t["peer_attn"][step]]))
        h = attn_res_rmsnorm(state.prefix, attn, state.blocks, w["mlp_res_norm_w"], w["mlp_res_proj_w"],
                             w["post_norm_w"], mlp_blocks, -1, cfg.rms_eps, cfg.rms_eps)
        out.append((router_topk(h, w["w_router"], w["router_bias"], cfg.top_k, cfg.routed_scale)[0],
                    router_choice(h, w)))
    return out


def step_routing(inputs: OpInputs) -> list[torch.Tensor]:
    """ids[B,k] the reference's router picks at each of the case's steps (step_choices)."""
    return [ids for ids, _ in step_choices(inputs)]


def layer_tie_scores(inputs: OpInputs) -> torch.Tensor:
    """choice scores[N,B,E] of every step's router (step_choices): what router_ids are judged against."""
    return torch.stack([c for _, c in step_choices(inputs)])


def layer_reweigh(inputs: OpInputs, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """prefix_steps of the reference routed to the candidate's ids[N,B,k] at every step (decode_steps'
    route_ids), from copies of the state: the reference at the candidate's own choice inside a near-tie.
    The dense layer routes nothing: no output to recompute."""
    from references.layers import decode_steps

    t = inputs.tensors
    if "w_router" not in t:
        return {}
    kind = _kind(t)

    def run():
        layer_idx = inputs.params["layer_idx"]
        if "peer_attn" not in t:
            return {"prefix_steps": decode_steps(kind, _weights(inputs, kind), _state_copy(inputs, kind),
                                                 t["x_steps"], layer_idx, route_ids=ids)}
        from references.layers_tp import rank_steps            # one rank's steps, its peers' partials given
        return {"prefix_steps": rank_steps(kind, _weights(inputs, kind), _state_copy(inputs, kind), t["x_steps"],
                                           layer_idx, t["peer_attn"], t["peer_mlp"], route_ids=ids)}
    key = ("reweigh", ids.dtype, tuple(ids.shape), ids.detach().cpu().to(torch.int64).numpy().tobytes())
    return _memo(key, inputs, run)


def kda_layer_state_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """recurrent_state's error scale per element: FLIP_SCALE x the state change that one rounding flip of
    a k and one of a v conv output per head and step (verify.ops.kda_spec: another fp32 order before a
    rounding to wd lands one wd ulp away) leaves at the last step, each flip carried through the later
    steps' decay and delta-rule projection exactly (first order, along the float64 oracle's trajectory)
    and summed in absolute value. The spec's 16-fp32-ulp floor of a row covers this sum once. The
    working dtype is the candidate's prefix_steps' (fp32 without a candidate). The dense layer 0 has
    KDA's state too; an MLA layer has no such term: {}."""
    t = inputs.tensors
    if _kind(t) != "kda":
        return {}
    from verify.ops.kda_spec import _MANTISSA
    out = (cand or {}).get("prefix_steps")
    wd = out.dtype if out is not None and out.dtype in _MANTISSA else torch.float32
    return {"recurrent_state": _memo(("flips", wd), inputs, lambda: _carried_flips(inputs, wd))}


def _carried_flips(inputs: OpInputs, wd: torch.dtype) -> torch.Tensor:
    """FLIP_SCALE x sum over steps s of |F_s A_(s+1) ... A_N| (kda_layer_state_magnitude). F_s [B,H,V,K]:
    per state row (b, h, v), the change of token s's new row when
      v_j flips:       one wd ulp: beta ulp(v_j) k;
      ks_c flips:      k moves by dk = ulp(ks_c) / |ks| (e_c - k_c k) (the L2 norm's projection), the row
                       by u_j dk - beta (S'_j . dk) k; the channel c with the largest first-order change;
      g_raw_c flips:   alpha_c moves by da_c = |d alpha_c / d g_raw_c| ulp(g_raw_c) (the gate's slope,
                       references.kda.kda_gate), the row by S_jc da_c (e_c - beta k_c k); the channel c
                       with the largest |S_jc| da_c;
      beta_raw flips:  beta moves by db = sigmoid'(beta_raw) ulp(beta_raw), the row by (u_j / beta) db k.
    A_r: a row's error e becomes (e * alpha_r) (I - beta_r k_r k_r^T) at step r (references.kda.
    gated_delta_step), applied to each flip separately so the sum of magnitudes is taken at the end."""
    from references.kda import kda_decode, kda_gate, kda_in_proj, short_conv_update
    from references.layers import attn_side, kda_kind_of
    from verify.ops.kda_spec import FLIP_SCALE, _ulp

    t, p = inputs.tensors, inputs.params
    cfg, layer_idx = layer_config(inputs), p["layer_idx"]
    w = _weights(inputs, kda_kind_of(layer_idx))
    state = _state_copy(inputs, "kda")
    conv_w = t["conv_w"]
    carried = None                                              # [n, B, H, V, K]: the flips so far
    for x in t["x_steps"]:
        state.prefix.copy_(x)
        x_in, _ = attn_side(w, state, layer_idx)
        q_raw, k_raw, v_raw, g_raw, beta_raw, z = kda_in_proj(x_in, w["w_in"], w["w_fb"], cfg.n_heads)
        S = state.recurrent_state
        B, H, V, K = S.shape

        ks, v = (short_conv_update(x_raw, conv_w[i], state.conv_state[:, i].clone()).view(B, H, -1)
                 for i, x_raw in ((1, k_raw), (2, v_raw)))
        norm = torch.sqrt((ks * ks).sum(-1, keepdim=True) + cfg.l2_eps)
        k = ks / norm
        _, alpha = kda_gate(g_raw.view(B, H, K), w["A_log"], w["dt_bias"], cfg.gate_lower_bound)
        beta = torch.sigmoid(beta_raw).view(B, H, 1, 1)
        sd = S * alpha.unsqueeze(-2)                                            # [B, H, V, K]
        u = beta[..., 0] * (v - (sd * k.unsqueeze(-2)).sum(-1))                 # [B, H, V]
        f_v = (beta[..., 0] * _ulp(v, wd)).unsqueeze(-1) * k.unsqueeze(-2)      # [B, H, V, K]
        dk_c = _ulp(ks, wd) / norm                                              # [B, H, K]
        c = (dk_c.unsqueeze(-2) * (u.abs().unsqueeze(-1) + beta * sd.abs())).argmax(-1, keepdim=True)  # [B,H,V,1]
        dkc = dk_c.unsqueeze(-2).expand(B, H, V, K).gather(-1, c)               # [B, H, V, 1]
        kc = k.unsqueeze(-2).expand(B, H, V, K).gather(-1, c)
        e_c = torch.zeros_like(sd).scatter_(-1, c, 1.0)
        dk = dkc * (e_c - kc * k.unsqueeze(-2))                                 # [B, H, V, K]
        f_k = u.unsqueeze(-1) * dk - beta * (sd * dk).sum(-1, keepdim=True) * k.unsqueeze(-2)
        A = w["A_log"].exp().view(H, 1)
        gate = torch.sigmoid(A * (g_raw.view(B, H, K) + w["dt_bias"].view(H, K)))      # kda_gate's sigmoid
        da = (alpha * abs(cfg.gate_lower_bound) * A * gate * (1 - gate)
              * _ulp(g_raw.view(B, H, K), wd)).unsqueeze(-2).expand(B, H, V, K)           # [B, H, V, K]
        cg = (S.abs() * da).argmax(-1, keepdim=True)                                      # [B, H, V, 1]
        e_g = torch.zeros_like(sd).scatter_(-1, cg, 1.0)
        kg = k.unsqueeze(-2).expand(B, H, V, K).gather(-1, cg)
        f_g = S.gather(-1, cg) * da.gather(-1, cg) * (e_g - beta * kg * k.unsqueeze(-2))
        db = beta * (1 - beta) * _ulp(beta_raw.view(B, H, 1, 1), wd)                      # [B, H, 1, 1]
        f_b = (u / beta[..., 0]).unsqueeze(-1) * db * k.unsqueeze(-2)
        if carried is not None:                                 # the earlier flips through this step's map
            carried = carried * alpha.unsqueeze(-2)
            carried = carried - beta * (carried * k.unsqueeze(-2)).sum(-1, keepdim=True) * k.unsqueeze(-2)
        born = torch.stack([f_v, f_k, f_g, f_b])
        carried = born if carried is None else torch.cat([carried, born])
        kda_decode(q_raw, k_raw, v_raw, g_raw, beta_raw, z, conv_w, state.conv_state, w["A_log"], w["dt_bias"],
                   w["o_norm_w"], S, cfg.gate_lower_bound, cfg.l2_eps, cfg.rms_eps)
    return FLIP_SCALE * carried.abs().sum(0)


def _kind(tensors: dict) -> str:
    """"kda" (layer 0 too: its state is KDA's) or "mla", told apart by the state."""
    return "kda" if "conv_state" in tensors else "mla"


def _weights(inputs: OpInputs, kind: str):
    """The case's weights as the reference layer's LayerWeights (kind "dense" at layer 0)."""
    from references.weights import LayerWeights

    from references.layers_tp import PEER_TENSORS

    t = inputs.tensors
    state = STATE_TENSORS[_kind(t)]
    return LayerWeights(kind, layer_config(inputs), t["x_steps"].dtype,
                        {n: v for n, v in t.items() if n not in (*state, *PEER_TENSORS, "x_steps", "blocks")})


def layer_config(inputs: OpInputs):
    """The config of the layer the inputs hold: the case's, or at params["tp"] > 1 one rank's
    (references.layers_tp.rank_config)."""
    from references.layers_tp import rank_config

    cfg, tp = get_config(inputs.params["config"]), inputs.params.get("tp", 1)
    return cfg if tp == 1 else rank_config(cfg, tp)


def rank_inputs(inputs: OpInputs, T: int, seed: int = 0) -> OpInputs:
    """Rank 0's inputs of a T-rank layer step (the references' tp form, references.layers_tp.
    layer_step_rank): its shards of the weights and state, params["tp"] = T, and peer_attn
    [N,T-1,B,D] / peer_mlp [N,T-1,B,M] standing in for the other ranks' partials: normal draws at the
    spread of x_steps (a partial is an o_proj / expert output of the same stream), seeded, on the inputs'
    device. Every candidate of the row gets the same peers, so they are judged and timed on one input."""
    from references.layers import kda_kind_of
    from references.layers_tp import shard_state, shard_weights

    t, p = inputs.tensors, inputs.params
    kind = _kind(t)
    layer = "mla" if kind == "mla" else kda_kind_of(p["layer_idx"])
    cfg = get_config(p["config"])
    state = {n: t[n] for n in STATE_TENSORS[kind]}
    weights = {n: v for n, v in t.items() if n not in (*state, "x_steps", "blocks")}
    x = t["x_steps"]
    N, B, D = x.shape
    M = D if layer == "dense" else cfg.latent + D
    gen = torch.Generator(device=x.device).manual_seed(seed)
    spread = float(x.float().std())
    peers = {name: (torch.randn(N, T - 1, B, width, generator=gen, device=x.device) * spread).to(x.dtype)
             for name, width in (("peer_attn", D), ("peer_mlp", M))}
    return OpInputs({"x_steps": x, "blocks": t["blocks"], **shard_weights(layer, weights, cfg, x.dtype, T, 0),
                     **shard_state(kind, state, cfg, T, 0), **peers}, {**p, "tp": T})


def _state_copy(inputs: OpInputs, kind: str):
    """A LayerState on copies of the case's state and blocks (the reference steps write them in place)."""
    from references.layers import LayerState

    t = inputs.tensors
    return LayerState(prefix=torch.zeros_like(t["x_steps"][0]), blocks=t["blocks"].clone(),
                      **{n: t[n].clone() for n in STATE_TENSORS[kind]})


_MEMO: list[tuple[tuple, list, object]] = []      # (key, the inputs' tensors held alive, result), newest last
_MEMO_SIZE = 8


def _memo(key: tuple, inputs: OpInputs, compute):
    """compute() once per key and inputs (the same tensor objects at the same versions: an in-place write
    bumps a tensor's version; the held references keep their ids from being reused)."""
    tensors = list(inputs.tensors.values())
    try:
        full = key + (tuple(inputs.params.items()), tuple((id(v), v._version) for v in tensors))
    except RuntimeError:                          # inference tensors keep no version: not memoised
        return compute()
    for k, _, result in _MEMO:
        if k == full:
            return result
    result = compute()
    _MEMO.append((full, tensors, result))
    del _MEMO[:-_MEMO_SIZE]
    return result


def layer_steps_bytes(inputs: OpInputs) -> int:
    """Bytes the case's N decode steps must move, step by step (weights do not stay on chip between
    steps): every weight but the routed experts read once; the MXFP4 weights and scales of the distinct
    experts the step's router picks (step_routing), once each; x_steps[t] read, prefix_steps[t]
    written; the n_blocks block snapshots the layer attends to read (a push lands in the working copy
    of blocks, not an output). State: KDA conv_state and recurrent_state read and written; MLA the
    seq_lens[b] + t cached latents of each sequence read, one latent per sequence written, block_table
    read, seq_lens read and written."""
    from references.layers import attn_res_layout

    t, p = inputs.tensors, inputs.params
    kind = _kind(t)
    nb = {n: v.numel() * v.element_size() for n, v in t.items()}
    N, B, D = t["x_steps"].shape
    row = B * D * t["x_steps"].element_size()
    weights = sum(v for n, v in nb.items() if n not in (*STATE_TENSORS[kind], *EXPERT_TENSORS, "x_steps", "blocks"))
    per_expert = sum(nb[n] // t[n].shape[0] for n in EXPERT_TENSORS if n in t)
    n_blocks, _ = attn_res_layout(p["layer_idx"], layer_config(inputs).attn_res_block)
    total = 0
    for step, (ids, _) in enumerate(_step_choices(inputs)):     # not memoised: K3 inputs are not kept
        total += weights + per_expert * int(torch.unique(ids).numel()) + 2 * row + n_blocks * row
        if kind == "kda":
            total += 2 * (nb["conv_state"] + nb["recurrent_state"])
        else:
            latent = t["cache"].stride(1) * t["cache"].element_size()
            total += (int(t["seq_lens"].long().sum()) + step * B + B) * latent + nb["block_table"] + 2 * nb["seq_lens"]
    return total


RANK_BATCH_DIMS = {"peer_attn": 2, "peer_mlp": 2}     # the batch dims of rank_inputs' peer partials

# bench: one decode step per timed call (the stock layer's step, graph-capturable) beside the reference
KDA_LAYER_PEERS = (Peer("stock_layer", "stock.layers:kda_layer_step_peer"),)
MLA_LAYER_PEERS = (Peer("stock_layer", "stock.layers:mla_layer_step_peer"),)
BENCH_KNOBS = ({"steps": 1},)       # the timed unit is one layer step, as the peers time it

_SIG_COMMON = ("x_steps[N,B,D] wd (layer input h per step); blocks[B,8,D] wd (block snapshots)\n"
               "weights: the tensors of references.weights.make_layer_weights (wd; conv_w, A_log, dt_bias, "
               "o_norm_w, router_bias fp32; w13/w2 MXFP4 uint8)\n"
               "layer_idx: int (K3 0-based); config: str (tiny | small | k3)\n")
_NOTES = ("k3 is not run on CPU: the 896 MXFP4 experts are ~9.9 GB per layer and the Python (token, expert) "
          "loop is slow; tiny/small have the same structure. No harness split rule: a whole layer all-reduces "
          "mid-layer, which per-rank candidate calls cannot express; the TP form (references.layers_tp) is checked "
          "against the unsplit layer in property_tests/test_layers.py for T in 1, 2, 4. The knob tp=T (the knob "
          "sweep: 2 and 4) judges one rank's step, its peers' partials given (peer_attn, peer_mlp: rank_inputs), "
          "against the reference's tp form on the same inputs; the bench's T > 1 layer rows run it. "
          "kda_layer at layer_idx 0 "
          "(the knob sweep) is the dense layer: KDA attention and the dense MLP. router_ids[N,B,k] are "
          "each step's experts, judged tie-aware against the router scores of the oracle's own trajectory "
          "(step_choices); prefix_steps are judged against the reference routed to the candidate's ids "
          "(layer_reweigh), so a token whose top-k is inside the tie band may choose either set (measured ~3% of "
          "bf16 rows at small) but must then give that set's output. Knobs: steps, layer_idx, tp.")

OPS: list[OpDef] = [
    OpDef(
        name="kda_layer", family="layers", reference="references.layers:kda_layer_steps",
        make_inputs=make_kda_layer_inputs, outputs=("prefix_steps", "router_ids"), state=("conv_state", "recurrent_state"),
        signature=(_SIG_COMMON + "conv_state[B,3,H*Dh,W-1] wd (state); recurrent_state[B,H,Dh,Dh] fp32 (state)\n"
                   "-> prefix_steps[N,B,D] wd (the layer's output prefix = next layer's h, per step), "
                   "router_ids[N,B,k] int (each step's experts; k = 0 at the dense layer 0)"),
        batch_dims={"x_steps": 1, "blocks": 0, "conv_state": 0, "recurrent_state": 0, "prefix_steps": 1,
                    "router_ids": 1, "peer_attn": 2, "peer_mlp": 2},
        tie_scores=layer_tie_scores, reweigh=layer_reweigh, magnitudes=kda_layer_state_magnitude,
        # a conv_state row of W-1 = 3 time steps has no scale of its own (projections cancel): judge
        # all channels of one conv of one sequence together, [C, W-1]
        row_ndims={"conv_state": 2},
        configs=("tiny", "small"), dists=DISTS, max_batch=MAX_BATCH, compile_heavy=True, cpu_ok=False, notes=_NOTES,
        knob_sweep=LONG_RUNS + DENSE_LAYER + RANK_FORMS + DENSE_RANK,
        moved_bytes=layer_steps_bytes, peers=KDA_LAYER_PEERS, bench_knobs=BENCH_KNOBS,
    ),
    OpDef(
        name="mla_layer", family="layers", reference="references.layers:mla_layer_steps",
        make_inputs=make_mla_layer_inputs, outputs=("prefix_steps", "router_ids"), state=("cache", "seq_lens"),
        signature=(_SIG_COMMON + "cache[P,page,kv_lora+rope] wd (state); block_table[B,pages] int32 (-1 padded); "
                   "seq_lens[B] int32 (state: tokens cached, advanced by N)\n-> prefix_steps[N,B,D] wd, router_ids[N,B,k] int"),
        batch_dims={"x_steps": 1, "blocks": 0, "block_table": 0, "seq_lens": 0, "prefix_steps": 1,
                    "router_ids": 1, "peer_attn": 2, "peer_mlp": 2},
        tie_scores=layer_tie_scores, reweigh=layer_reweigh,
        configs=("tiny", "small"), dists=DISTS, max_batch=MAX_BATCH, compile_heavy=True, cpu_ok=False, notes=_NOTES,
        knob_sweep=LONG_RUNS + RANK_FORMS,
        moved_bytes=layer_steps_bytes, peers=MLA_LAYER_PEERS, bench_knobs=BENCH_KNOBS,
    ),
]
