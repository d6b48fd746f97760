"""The fused K3 layer step: references.layers' composition with each op through its fused kernel.

One decode step (`FusedLayer.step`) is the reference layer's sequence of ops, in its order and on its
rounding points, each op called through the kernel table the layer was prepared with:

  attn side  attn_res_rmsnorm (AttnRes mix + input RMSNorm + block push)
  KDA        kda_in_proj -> kda_decode -> skinny_gemm (o_proj)
  MLA        mla_qkv_a -> mla_q_absorb and mla_cache_append (the latent at the slot of seq_lens,
             seq_lens advanced) (two launches for three at one token: JOINT) -> mla_decode_attn ->
             mla_out_gate -> skinny_gemm (o_proj)
  mlp side   attn_res_rmsnorm (prefix += attn, AttnRes mix + post-attention RMSNorm)
  LatentMoE  shared_experts started on its side stream first, then router_topk and skinny_gemm (latent
             down) (one launch: JOINT), moe_experts_mxfp4; the shared experts joined;
             allreduce_latent_norm_up (its one-partial case: latent norm, up-projection, shared add
             and prefix + mlp in one launch)
  dense MLP  shared_experts' kernels on the dense weights, then prefix + mlp (a working-dtype add)

`KERNELS` names the fused kernel of every op. `JOINT` names kernels that run two consecutive, independent
ops of the step in one grid, giving each op's bits (router_topk and the latent-down GEMV, both reading
h; the q_b GEMV of mla_q_absorb and mla_cache_append): the fused table calls the joint kernel where the
layer has both ops, and where the table has none, or it refuses the shapes, `SPLIT` runs the ops' own
calls in its place (`FusedLayer.joint`). `prepare(..., kernels="fused")` resolves them;
`kernels="reference"` puts the op references in their place (on the CPU this is the reference layer
itself, bit for bit: the composition is checked there without a GPU). A fused kernel that refuses
the layer's shapes (its argument checks raise before any launch or write, as the MLA kernels do for
a cache past their 32-bit slot offsets) is replaced, from that call on, by a
sync-free torch form of its op, and `FusedLayer.unfused` names it with the refusal: the step's launch
count stays honest. `GLUE` lists the torch ops the step runs between kernels, one launch each (a CPU
trace of the step counts them: property_tests/test_fused_layers.py).

The step is sync-free (no host read of a tensor value, static shapes): on CUDA it is captured in a
CUDA graph and replayed (`step_launch`). Checks of values (page room in block_table) run once before
the steps (stock.layers.validate_state). The registry forms (`layer_steps`) make this module a
candidate of kda_layer and mla_layer: `--candidate fused.layers:layer_steps`.

`layer_steps_shared_inline` is the same step with the shared experts' launches on the caller's
stream, after the routed experts' inputs are queued and before the MoE tail: the same kernels and
bits, no overlap. Benched beside `layer_steps`, it is the step time without the side stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from references.config import K3Config
from references.layers import attn_res_layout
from stock import layers as stock

# Declared scope (verify.plan.scope): the fused kernels' working dtypes.
DTYPES = ("bfloat16", "float16")

KERNELS = {
    "attn_res_rmsnorm": "fused.attn_res_rmsnorm:attn_res_rmsnorm",
    "allreduce_attn_res_rmsnorm": "fused.allreduce_attn_res_rmsnorm:allreduce_attn_res_rmsnorm",
    "allreduce_fold": "fused.allreduce_fold:allreduce_fold",
    "l2_prefetch": "fused.l2_prefetch:l2_prefetch",
    "kda_in_proj": "fused.kda_in_proj_onelaunch:kda_in_proj",
    "kda_decode": "fused.kda_decode:kda_decode",
    "skinny_gemm": "fused.skinny_gemm:skinny_gemm",
    "router_topk": "fused.router_topk_onelaunch:router_topk",
    "moe_experts_mxfp4": "fused.moe_experts_mxfp4_slots:moe_experts_mxfp4",
    "shared_experts": "fused.shared_experts_actdown:start",
    "latent_norm_up": "fused.latent_norm_up:latent_norm_up",
    "allreduce_latent_norm_up": "fused.allreduce_latent_norm_up_prefold:allreduce_latent_norm_up",
    "mla_qkv_a": "fused.mla_qkv_a_onelaunch:mla_qkv_a",
    "mla_q_absorb": "fused.mla_q_absorb:mla_q_absorb",
    "mla_cache_append": "fused.mla_cache_append:mla_cache_append",
    "mla_decode_attn": "fused.mla_decode_attn:mla_decode_attn",
    "mla_out_gate": "fused.mla_out_gate:mla_out_gate",
}
# joint kernel -> (its import path, the ops it runs in order); SPLIT has each one's calls of its ops
JOINT = {
    "router_topk_latent_down": ("fused.router_topk_latent_down:router_topk_latent_down",
                                ("router_topk", "skinny_gemm")),
    "mla_q_absorb_cache_append": ("fused.mla_q_absorb_cache_append:mla_q_absorb_cache_append",
                                  ("mla_q_absorb", "mla_cache_append")),
}
REFERENCES = {
    "attn_res_rmsnorm": "references.attn_res:attn_res_rmsnorm",
    "allreduce_attn_res_rmsnorm": "references.attn_res:allreduce_attn_res_rmsnorm",
    "allreduce_fold": "references.allreduce:allreduce_fold",
    "l2_prefetch": "references.moe:l2_prefetch",
    "kda_in_proj": "references.kda:kda_in_proj",
    "kda_decode": "references.kda:kda_decode",
    "skinny_gemm": "references.gemm:skinny_gemm",
    "router_topk": "references.moe:router_topk",
    "moe_experts_mxfp4": "references.moe:moe_experts_mxfp4",
    "shared_experts": "references.moe:shared_experts",
    "latent_norm_up": "references.moe:latent_norm_up",
    "allreduce_latent_norm_up": "references.moe_tp:allreduce_latent_norm_up",
    "mla_qkv_a": "references.mla:mla_qkv_a",
    "mla_q_absorb": "references.mla:mla_q_absorb",
    "mla_cache_append": "references.mla_cache_append:mla_cache_append",
    "mla_decode_attn": "references.mla:mla_decode_attn",
    "mla_out_gate": "references.mla:mla_out_gate",
}
LAYER_OPS = {
    "kda": ("attn_res_rmsnorm", "kda_in_proj", "kda_decode", "skinny_gemm", "router_topk", "moe_experts_mxfp4",
            "shared_experts", "allreduce_latent_norm_up"),
    "mla": ("attn_res_rmsnorm", "mla_qkv_a", "mla_q_absorb", "mla_cache_append", "mla_decode_attn", "mla_out_gate",
            "skinny_gemm", "router_topk", "moe_experts_mxfp4", "shared_experts", "allreduce_latent_norm_up"),
    # layer 0: KDA attention and the dense MLP, whose math is the shared experts' (references.moe.dense_mlp)
    "dense": ("attn_res_rmsnorm", "kda_in_proj", "kda_decode", "skinny_gemm", "shared_experts"),
}
GLUE = {
    "kda": ("prefix working copy",),
    "dense": ("prefix working copy", "prefix + mlp (residual add)"),
    "mla": ("prefix working copy",),
}
REFUSALS = (ValueError, TypeError)      # what a fused kernel's argument checks raise, before any launch


class _Done:
    """A shared-experts result computed in place (the reference form): wait() returns it."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


@dataclass
class FusedLayer:
    """One layer prepared for stepping: the weights (the reference's names and layouts), the kernel of
    each op, the sync-free torch form that stands in for a kernel that refuses the shapes, and a zero
    delta for the attn-side AttnRes call and the working prefix (kept, so a step allocates no fill)."""
    kind: str
    cfg: K3Config
    layer_idx: int
    wd: torch.dtype
    w: dict
    kernels: dict
    fallbacks: dict
    unfused: dict = field(default_factory=dict)     # op -> why its fused kernel is not used
    kept: dict = field(default_factory=dict)        # buffers made once: the working prefix, the zero delta

    def step(self, prefix: torch.Tensor, blocks: torch.Tensor, *state: torch.Tensor,
             routing: list | None = None) -> torch.Tensor:
        """One decode step from the layer input h = prefix (left as it is: the AttnRes ops update their
        prefix in place, so the step works on a kept buffer, as the reference layer on state.prefix);
        state tensors and blocks updated in place. Returns the new prefix (the next layer's h); appends
        the step's expert ids [B,k] to `routing` when given (MoE layers)."""
        work = self.buffer("prefix", prefix)
        work.copy_(prefix)
        return (mla_step if self.kind == "mla" else kda_step)(self, work, blocks, *state, routing=routing)

    def call(self, op: str, *args, out: torch.Tensor | None = None, fallback=None):
        """`op` through its kernel; a fused kernel's refusal of these shapes (outside a capture) moves the
        op to its torch form (`fallback`, else fallbacks[op]) for good and records why. `out`: where the
        result goes (the routed and shared experts only, whose every form takes it: a fused kernel writes
        there, a torch form's result is copied in)."""
        kw = {} if out is None else {"out": out}
        fallback = fallback or self.fallbacks.get(op)
        if op in self.unfused:
            return fallback(*args, **kw)
        try:
            return self.kernels[op](*args, **kw)
        except REFUSALS as e:
            if fallback is None or stock.capturing():
                raise
            self.unfused[op] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return fallback(*args, **kw)

    def joint(self, name: str, *args):
        """The joint kernel `name`'s results: its call where the table has it, its ops' own calls in order
        (SPLIT[name]) where it has none or the kernel refused. The split is bound here, per call: a
        layer holding a function bound to itself would be a reference cycle, its weights (tens of GB at
        K3) freed only by a garbage-collector pass."""
        split = partial(SPLIT[name], self)
        if name in self.kernels:
            return self.call(name, *args, fallback=split)
        return split(*args)

    def buffer(self, name: str, like: torch.Tensor, shape: tuple | None = None) -> torch.Tensor:
        """A contiguous tensor of `like`'s dtype and device, shaped like it (or `shape`), made once per
        (name, shape, device) and kept (it starts zero: the "zero" delta)."""
        shape = tuple(like.shape if shape is None else shape)
        key = (name, shape, like.device)
        if key not in self.kept:
            self.kept[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.kept[key]


def _resolve(path: str):
    from verify.ops.registry import import_callable

    return import_callable(path)


def _inline_shared(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out=None):
    """The kernel table's shared-experts start with the caller's current stream as its "side" stream: the
    fork and join are a stream waiting on itself (no-ops), so the launches run in line."""
    start = _resolve(KERNELS["shared_experts"])
    return start(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out=out,
                 stream=torch.cuda.current_stream(x.device))


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`result`, or `out` holding it (a torch form's result where the caller asked for it in `out`)."""
    return result if out is None else out.copy_(result)


def _copying(fn):
    """`fn` (a reference without `out=`) taking `out=`: its result copied in."""
    def call(*args, out=None):
        return _into(fn(*args), out)
    return call


def _reference_shared(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out=None):
    from references.moe import shared_experts

    return _Done(_into(shared_experts(x, w_gate_up, w_down, situ_beta, situ_linear_beta), out))


def _fallbacks(layer: stock.StockLayer) -> dict:
    """Sync-free torch forms of the ops whose references read tensor values on the host (the routed
    experts' id checks and per-pair expert ids, the cache append's slot checks and masked write, the
    decode attention's per-sequence lengths); the others' references are sync-free as written."""
    def routed(z, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta, out=None):
        return _into(stock.routed_experts(layer, z, ids, weights), out)

    def decode(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank):
        n_seq, n_q, H, C = q_abs.shape
        if n_q != 1:
            raise ValueError(f"q_abs: the layer step decodes one token per sequence, got {n_q}")
        return stock.paged_latent_attention(q_abs.view(n_seq, H, C), cache, block_table, seq_lens, scale,
                                            kv_lora_rank).view(n_seq, 1, H, kv_lora_rank)

    def cache_append(kv_c, k_rot, cache, block_table, seq_lens, validate=True):
        """The layer's slots are valid and distinct (validate_state): a row copy per sequence."""
        from references.mla_cache_append import append_slots

        slots = append_slots(cache, block_table, seq_lens)
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, torch.cat([kv_c, k_rot], dim=-1))
        seq_lens.add_(1)

    out = {op: _resolve(path) for op, path in REFERENCES.items()}
    out.update(moe_experts_mxfp4=routed, mla_decode_attn=decode, shared_experts=_reference_shared,
               mla_cache_append=cache_append)
    return out


def prepare(kind: str, weights: dict, config: str | K3Config, layer_idx: int, wd: torch.dtype,
            kernels: str = "fused", shared_stream: bool = True) -> FusedLayer:
    """Make the layer's step-ready form once (outside any captured step). kernels: "fused" (the fused
    kernels, CUDA) or "reference" (the op references: the reference layer's composition).
    shared_stream=False runs the fused shared experts in line on the caller's stream."""
    if kernels not in ("fused", "reference"):
        raise ValueError(f"kernels: {kernels!r} is not a kernel table; use 'fused' or 'reference'")
    base = stock.prepare(kind, weights, config, layer_idx, wd, use_fla=False, use_flashmla=False)
    table = KERNELS if kernels == "fused" else REFERENCES
    resolved = {op: _resolve(table[op]) for op in LAYER_OPS[kind]}
    if kernels == "reference":
        resolved["shared_experts"] = _reference_shared
        if "moe_experts_mxfp4" in resolved:
            resolved["moe_experts_mxfp4"] = _copying(resolved["moe_experts_mxfp4"])
    elif not shared_stream:
        resolved["shared_experts"] = _inline_shared
    if kernels == "fused":
        resolved.update({name: _resolve(path) for name, (path, ops) in JOINT.items()
                         if set(ops) <= set(LAYER_OPS[kind])})
    return FusedLayer(kind, base.cfg, layer_idx, wd, base.w, resolved, _fallbacks(base) if kernels == "fused" else {})


def reference_prepare(kind: str, weights: dict, config, layer_idx: int, wd: torch.dtype) -> FusedLayer:
    return prepare(kind, weights, config, layer_idx, wd, kernels="reference")


def prepare_shared_inline(kind: str, weights: dict, config, layer_idx: int, wd: torch.dtype) -> FusedLayer:
    return prepare(kind, weights, config, layer_idx, wd, shared_stream=False)


# ---------------------------------------------------------------------------------------------- one step
def _attn_side(layer: FusedLayer, prefix: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(normed x, blocks the mlp side sees): prefix updated in place (0 after a push into blocks)."""
    w, eps = layer.w, layer.cfg.rms_eps
    n_blocks, push = attn_res_layout(layer.layer_idx, layer.cfg.attn_res_block)
    x = layer.call("attn_res_rmsnorm", prefix, layer.buffer("zero", prefix), blocks, w["attn_res_norm_w"],
                   w["attn_res_proj_w"], w["input_norm_w"], n_blocks, n_blocks if push else -1, eps, eps)
    return x, n_blocks + int(push)


def moe_experts(layer: FusedLayer, h: torch.Tensor, routing: list | None = None,
                outs: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(pending shared-experts output, routed latent output y): the shared experts started on their side
    stream first, then router_topk, skinny_gemm (latent down) and the routed experts (a rank's shards:
    both are its partials). outs: (y's [B, L], the shared experts' [B, D]) to write them into."""
    w, cfg = layer.w, layer.cfg
    y_out, shared_out = outs or (None, None)
    shared = layer.call("shared_experts", h, w["w_shared_gate_up"], w["w_shared_down"], cfg.situ_beta,
                        cfg.situ_linear_beta, out=shared_out)
    args = (h, w["w_router"], w["router_bias"], cfg.top_k, cfg.routed_scale, w["w_latent_down"])
    ids, route_w, z = layer.joint("router_topk_latent_down", *args)
    if routing is not None:
        routing.append(ids)
    y = layer.call("moe_experts_mxfp4", z, ids, route_w, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                   w["w2_scale"], cfg.situ_beta, cfg.situ_linear_beta, out=y_out)
    return shared, y


def _router_then_latent_down(layer: FusedLayer, h, w_router, bias, top_k: int, routed_scale: float, w_latent_down):
    """(ids, weights, z): router_topk, then skinny_gemm's latent down, each through its own table entry (the
    joint kernel's ops where the layer has none or it refused)."""
    ids, route_w = layer.call("router_topk", h, w_router, bias, top_k, routed_scale)
    return ids, route_w, layer.call("skinny_gemm", h, w_latent_down)


def _latent_moe(layer: FusedLayer, prefix: torch.Tensor, h: torch.Tensor, routing: list | None = None) -> torch.Tensor:
    """prefix + the LatentMoE's output: its tail (norm, up-projection, shared add, residual add) in one
    launch, the unsplit layer being the one-partial case of allreduce_latent_norm_up."""
    shared, y = moe_experts(layer, h, routing)
    return layer.call("allreduce_latent_norm_up", prefix, y[None], shared.wait()[None], layer.w["latent_norm_w"],
                      layer.w["w_latent_up"], layer.cfg.rms_eps)


def _mlp_side(layer: FusedLayer, prefix: torch.Tensor, attn: torch.Tensor, blocks: torch.Tensor,
              n_blocks: int, routing: list | None = None) -> torch.Tensor:
    """prefix += attn (in place, by the AttnRes op), mix + post norm, the MoE; returns prefix + mlp (the
    working prefix is the step's scratch: the next step starts from its own input)."""
    w, eps = layer.w, layer.cfg.rms_eps
    h = layer.call("attn_res_rmsnorm", prefix, attn, blocks, w["mlp_res_norm_w"], w["mlp_res_proj_w"],
                   w["post_norm_w"], n_blocks, -1, eps, eps)
    if layer.kind == "dense":
        return prefix + _dense_mlp(layer, h)
    return _latent_moe(layer, prefix, h, routing)


def _dense_mlp(layer: FusedLayer, h: torch.Tensor) -> torch.Tensor:
    w, cfg = layer.w, layer.cfg
    return layer.call("shared_experts", h, w["w_dense_gate_up"], w["w_dense_down"], cfg.situ_beta,
                      cfg.situ_linear_beta).wait()


def kda_attention(layer: FusedLayer, x, conv_state, recurrent_state, n_heads: int) -> torch.Tensor:
    """in_proj -> kda_decode -> o_proj over `n_heads` heads (a rank's: its partial o_proj output)."""
    w, cfg = layer.w, layer.cfg
    q_raw, k_raw, v_raw, g_raw, beta_raw, z = layer.call("kda_in_proj", x, w["w_in"], w["w_fb"], n_heads)
    y = layer.call("kda_decode", q_raw, k_raw, v_raw, g_raw, beta_raw, z, w["conv_w"], conv_state, w["A_log"],
                   w["dt_bias"], w["o_norm_w"], recurrent_state, cfg.gate_lower_bound, cfg.l2_eps, cfg.rms_eps)
    return layer.call("skinny_gemm", y, w["w_o"])


def mla_attention(layer: FusedLayer, x, cache, block_table, seq_lens) -> torch.Tensor:
    """qkv_a -> q_absorb -> the token's latent appended at the slot of seq_lens in block_table, seq_lens
    advanced in place (validated once before the steps: validate_state) -> the attention over the new
    lengths -> out_gate -> o_proj (a rank's heads: its partial o_proj output)."""
    w, cfg = layer.w, layer.cfg
    q_c, kv_c, k_rot = layer.call("mla_qkv_a", x, w["w_qkv_a"], w["q_a_norm_w"], w["kv_a_norm_w"],
                                  cfg.mla_latent_eps)
    q_abs = layer.joint("mla_q_absorb_cache_append", q_c, w["w_q_b"], w["w_uk"], kv_c, k_rot, cache, block_table,
                        seq_lens, False)
    B, H = q_abs.shape[0], q_abs.shape[1]
    o_latent = layer.call("mla_decode_attn", q_abs.view(B, 1, H, -1), cache, block_table, seq_lens,
                          cfg.mla_scale, cfg.kv_lora_rank)
    o = layer.call("mla_out_gate", o_latent.reshape(B, H, cfg.kv_lora_rank), w["w_uv"], x, w["w_g"])
    return layer.call("skinny_gemm", o, w["w_o"])


def _q_absorb_then_append(layer: FusedLayer, q_c, w_q_b, w_uk, kv_c, k_rot, cache, block_table, seq_lens,
                          validate: bool):
    """q_abs: mla_q_absorb, then mla_cache_append (cache and seq_lens in place), each through its own table
    entry (the joint kernel's ops where the layer has none or it refused)."""
    q_abs = layer.call("mla_q_absorb", q_c, w_q_b, w_uk)
    layer.call("mla_cache_append", kv_c, k_rot, cache, block_table, seq_lens, validate)
    return q_abs


# joint kernel -> its ops' own calls, (layer, *the joint's arguments) -> the joint's results
SPLIT = {"router_topk_latent_down": _router_then_latent_down, "mla_q_absorb_cache_append": _q_absorb_then_append}


def kda_step(layer: FusedLayer, prefix, blocks, conv_state, recurrent_state, routing: list | None = None) -> torch.Tensor:
    """One KDA layer step (layer 0: with the dense MLP): prefix[B,D] (the layer input h) is the working
    prefix, updated in place."""
    x, n = _attn_side(layer, prefix, blocks)
    return _mlp_side(layer, prefix, kda_attention(layer, x, conv_state, recurrent_state, layer.cfg.n_heads), blocks, n,
                     routing)


def mla_step(layer: FusedLayer, prefix, blocks, cache, block_table, seq_lens, routing: list | None = None) -> torch.Tensor:
    """One gated-MLA layer step (mla_attention: the cache slot, seq_lens advanced by one)."""
    x, n = _attn_side(layer, prefix, blocks)
    return _mlp_side(layer, prefix, mla_attention(layer, x, cache, block_table, seq_lens), blocks, n, routing)


# ---------------------------------------------------------------------------------------------- registry form
def _prepare_for(tp: int, prepare_fn=None):
    """The prepare of a registry call: `prepare_fn` (this module's prepare by default) unsplit; at tp > 1
    one rank's step (fused.layers_tp.prepare_peers_rank: the rank's shards, its peers' partials given)."""
    if tp == 1:
        return prepare_fn or prepare
    from fused.layers_tp import peers_rank_prepare

    return peers_rank_prepare(tp, shared_stream=prepare_fn is not prepare_shared_inline)


def kda_layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, conv_state: torch.Tensor,
                    recurrent_state: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                    **weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """references.layers.kda_layer_steps through the fused step: (prefix_steps, router_ids); conv_state and
    recurrent_state updated in place. tp > 1: one rank's step (the reference's tp form)."""
    return stock.registry_steps(x_steps, blocks, layer_idx, config,
                                dict(weights, conv_state=conv_state, recurrent_state=recurrent_state),
                                _prepare_for(tp), tp)


def mla_layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                    **weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """references.layers.mla_layer_steps through the fused step: (prefix_steps, router_ids); cache written and
    seq_lens advanced by N in place. tp > 1: one rank's step."""
    return stock.registry_steps(x_steps, blocks, layer_idx, config,
                                dict(weights, cache=cache, block_table=block_table, seq_lens=seq_lens),
                                _prepare_for(tp), tp)


def layer_steps(x_steps: torch.Tensor, blocks: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                **tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both registry forms under one name, told apart by their state (`cache` = MLA), so one
    `--candidate fused.layers:layer_steps` certifies kda_layer and mla_layer in one run."""
    return stock.registry_steps(x_steps, blocks, layer_idx, config, tensors, _prepare_for(tp), tp)


def layer_steps_shared_inline(x_steps: torch.Tensor, blocks: torch.Tensor, layer_idx: int, config: str, tp: int = 1,
                              **tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_steps with the shared experts in line on the caller's stream (no side stream)."""
    return stock.registry_steps(x_steps, blocks, layer_idx, config, tensors,
                                _prepare_for(tp, prepare_shared_inline), tp)


# ---------------------------------------------------------------------------------------------- one-step launch
def step_launch(kind: str, tensors: dict, params: dict, graph: bool | None = None):
    """stock.layers.step_launch with the fused step: prepared, validated and (on CUDA) captured in a
    CUDA graph untimed; the launch returns the new prefix. The prepared layer is the launch's `layer`
    (its `unfused` names the ops that did not run fused). params["tp"] > 1: one rank's step."""
    return stock.step_launch(kind, tensors, params, graph, prepare_fn=_prepare_for(params.get("tp", 1)))


def kda_layer_step_peer(tensors: dict, params: dict):
    """verify.bench peer protocol (prepare(tensors, params) -> launch): one fused KDA layer step, eager
    (the bench's GraphClock captures the launches into its own CUDA graph)."""
    return step_launch("kda", tensors, params, graph=False)


def mla_layer_step_peer(tensors: dict, params: dict):
    """verify.bench peer protocol (prepare(tensors, params) -> launch): one fused MLA layer step, eager
    (the bench's GraphClock captures the launches into its own CUDA graph)."""
    return step_launch("mla", tensors, params, graph=False)


def describe(layer: FusedLayer) -> dict:
    """What one step runs: the ops through their fused kernels, those through a torch form (and why),
    and the torch glue between them."""
    ops = [*LAYER_OPS[layer.kind], *(name for name in JOINT if name in layer.kernels)]
    return {"fused": [op for op in ops if op not in layer.unfused], "unfused": dict(layer.unfused),
            "glue": list(GLUE[layer.kind])}

