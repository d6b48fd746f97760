"""The fused layer step on one tensor-parallel rank of T: references.layers_tp's split, each rank a process.

Rank r holds its shards (the references' shard rules: KDA in-proj columns, conv/gate/recurrent state and
o_proj rows by head; MLA q_b / W_UK / W_UV / g_proj by head, o_proj rows; routed experts by the padded
intermediate dim; shared experts column- then row-parallel) and its head slice of the KDA state or its
replica of the MLA cache. One step:

  attn side    attn_res_rmsnorm, replicated (every rank the same bits)
  attention    the rank's heads -> its partial o_proj output [B, D]
  all-reduce   the T partials gathered (rank order) -> allreduce_attn_res_rmsnorm: the fp32 rank-order
               fold inside the AttnRes + post-norm kernel (fused/allreduce_attn_res_rmsnorm.py); with
               `prefetch`, l2_prefetch of the MoE's first weights on a side stream during the gather
  MoE          shared experts (the rank's slice) on their side stream, router and latent down
               replicated, the rank's slice of every chosen expert -> partials of the latent output
               and of the shared experts (at B = 1 written by their kernels into the halves of the
               all-gather's send row, above it concatenated), gathered in one [T, B, L + D] all-gather, then
               allreduce_latent_norm_up (fused/allreduce_latent_norm_up_prefold.py): the whole row folded
               in rank order by one allreduce_fold (read in place), then the latent norm, the
               up-projection, the shared add and prefix + mlp in one launch; up to 8 partial rows
               (T x B), that one launch folds them itself
  dense MLP    the rank's slice of the dense MLP, gathered, folded by allreduce_fold, prefix + mlp

The gather is a `Collective`: `ProcessGroupGather` (torch.distributed: NCCL between GPUs, gloo on
CPUs; one process per rank), `PeersGather` (one process as rank 0, the other ranks' partials given:
the registry's tp > 1 form, references.layers_tp.layer_step_rank, which the harness and the bench
run at per-rank K3 shapes on one GPU) or `CopiesGather` (one process: the rank's own partial in all T
slots; shapes and compute only). The folds are the declared order on every rank, so every rank
computes the same replicated bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fused import layers as FL
from references.config import K3Config, get_config
from references.layers_tp import join_state, rank_config, shard_state, shard_weights  # noqa: F401 (the rank's shards)

TP_OPS = ("allreduce_attn_res_rmsnorm", "allreduce_fold", "l2_prefetch")
# prefetched into L2 on a side stream while the attention partials are gathered (prepare_rank's
# `prefetch`): the weights the MoE reads first, the router's and the rank's shared-experts gate_up
# (K3, T = 8: 12.8 + 22 MB, inside l2_prefetch's default budget of 3/4 of the H200's 50 MB L2)
PREFETCH = ("w_router", "w_shared_gate_up")
# tokens up to which the routed and shared experts write their partials into the halves of the MoE
# all-gather's send row [B, L + D] (the halves are compact views only at one token); above, concatenated
SEND_ROW_IN_PLACE_MAX = 1


# ---------------------------------------------------------------------------------------------- gathers
class ProcessGroupGather:
    """The T ranks' tensors stacked in rank order on every rank, through torch.distributed's default
    process group (one all-gather per call)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.T, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if self.dist.get_backend(self.group) == "nccl":
            out = torch.empty((self.T, *t.shape), dtype=t.dtype, device=t.device)
            self.dist.all_gather_into_tensor(out, t, group=self.group)
            return out
        parts = [torch.empty_like(t) for _ in range(self.T)]
        self.dist.all_gather(parts, t, group=self.group)
        return torch.stack(parts)


@dataclass
class PeersGather:
    """One process as rank 0 of T, the other ranks' partials given: each call returns [own, peers]
    (rank order) with the next of the step's peers, loaded by RankLayer.step: peer_attn[T-1,B,D] for
    the attention all-reduce, then peer_mlp[T-1,B,L+D] (the dense MLP's: [T-1,B,D])."""
    T: int
    rank: int = 0
    queue: list = None

    def load(self, peers: tuple) -> None:
        self.queue = list(peers)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not self.queue:
            raise RuntimeError("PeersGather: no peer partials loaded for this all-reduce (RankLayer.step loads "
                               "them from its peers argument)")
        return torch.cat([t.unsqueeze(0), self.queue.pop(0)])


@dataclass
class CopiesGather:
    """One process standing in for rank `rank` of T: the gather returns T copies of the rank's own
    tensor. Right shapes and the rank's own compute, not the layer's values (timing only)."""
    T: int
    rank: int = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0).expand(self.T, *t.shape).contiguous()


# ---------------------------------------------------------------------------------------------- shards
# ---------------------------------------------------------------------------------------------- prepare
@dataclass
class RankLayer(FL.FusedLayer):
    """A FusedLayer holding one rank's shards, with the gather its all-reduces go through."""
    gather: object = None
    T: int = 1
    rank: int = 0
    prefetch: tuple = ()                  # weight names l2_prefetch brings in during the attention gather

    def side_stream(self) -> torch.cuda.Stream:
        """The rank's side stream for the prefetch (made once)."""
        if "stream" not in self.kept:
            self.kept["stream"] = torch.cuda.Stream()
        return self.kept["stream"]

    def step(self, prefix: torch.Tensor, blocks: torch.Tensor, *state: torch.Tensor, routing: list | None = None,
             peers: tuple | None = None) -> torch.Tensor:
        """FusedLayer.step of this rank; `peers` (peer_attn, peer_mlp) go to a PeersGather."""
        if peers is not None:
            self.gather.load(peers)
        work = self.buffer("prefix", prefix)
        work.copy_(prefix)
        return (mla_step_tp if self.kind == "mla" else kda_step_tp)(self, work, blocks, *state, routing=routing)


def prepare_rank(kind: str, weights: dict, config: str | K3Config, layer_idx: int, wd: torch.dtype, gather,
                 kernels: str = "fused", prefetch: bool = False) -> RankLayer:
    """Rank gather.rank of gather.T: its shards of the unsplit `weights`, its kernel table; with
    `prefetch`, the MoE's first weights (PREFETCH) prefetched into L2 during the attention gather."""
    cfg = get_config(config) if isinstance(config, str) else config
    shards = shard_weights(kind, weights, cfg, wd, gather.T, gather.rank)
    return prepare_shards(kind, shards, rank_config(cfg, gather.T), layer_idx, wd, gather, kernels, prefetch)


def peers_rank_prepare(T: int, shared_stream: bool = True):
    """prepare(kind, shards, rank config, layer_idx, wd) of rank 0 of T with a PeersGather: the prepare of
    the registry's tp > 1 form (stock.layers.run_steps / step_launch hand it the rank's shards and
    references.layers_tp.rank_config)."""
    def prepare(kind, shards, config, layer_idx, wd):
        return prepare_shards(kind, shards, config, layer_idx, wd, PeersGather(T), shared_stream=shared_stream)
    return prepare


def prepare_shards(kind: str, shards: dict, config: K3Config, layer_idx: int, wd: torch.dtype, gather,
                   kernels: str = "fused", prefetch: bool = False, shared_stream: bool = True) -> RankLayer:
    """The RankLayer of shards already cut (config: references.layers_tp.rank_config, the rank's shapes)."""
    base = FL.prepare(kind, shards, config, layer_idx, wd, kernels, shared_stream)
    table = FL.KERNELS if kernels == "fused" else FL.REFERENCES
    for op in TP_OPS:
        base.kernels[op] = FL._resolve(table[op])
        if kernels == "fused":
            base.fallbacks[op] = FL._resolve(FL.REFERENCES[op])
    names = tuple(n for n in PREFETCH if n in shards) if prefetch else ()
    return RankLayer(**{f: getattr(base, f) for f in base.__dataclass_fields__}, gather=gather, T=gather.T,
                     rank=gather.rank, prefetch=names)


def _start_prefetch(layer: RankLayer):
    """l2_prefetch of layer.prefetch on a side stream forked from the current one (on CUDA; inline
    elsewhere); returns the event to join on, or None."""
    if not layer.prefetch:
        return None
    weights = [layer.w[n] for n in layer.prefetch]
    if not weights[0].is_cuda:
        layer.call("l2_prefetch", *weights)
        return None
    side = layer.side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.call("l2_prefetch", *weights)
        done = torch.cuda.Event()
        done.record(side)
    return done


# ---------------------------------------------------------------------------------------------- one step
def _mlp_side_tp(layer: RankLayer, prefix, partial: torch.Tensor, blocks, n_blocks: int,
                 routing: list | None = None) -> torch.Tensor:
    w, eps = layer.w, layer.cfg.rms_eps
    prefetched = _start_prefetch(layer)
    deltas = layer.gather(partial)
    if prefetched is not None:
        torch.cuda.current_stream().wait_event(prefetched)
    h = layer.call("allreduce_attn_res_rmsnorm", prefix, deltas, blocks, w["mlp_res_norm_w"],
                   w["mlp_res_proj_w"], w["post_norm_w"], n_blocks, -1, eps, eps)
    if layer.kind == "dense":                                              # the dense MLP's partial, folded
        return prefix + layer.call("allreduce_fold", layer.gather(FL._dense_mlp(layer, h)))
    B, D = h.shape
    L = layer.w["w_latent_down"].shape[0]
    outs = None
    if B <= SEND_ROW_IN_PLACE_MAX:      # the send row's halves [B, L] and [B, D]: written by the kernels
        row = layer.buffer("send", h, (B * (L + D),))
        outs = (row[:B * L].view(B, L), row[B * L:].view(B, D))
    shared, y = FL.moe_experts(layer, h, routing, outs)
    shared = shared.wait()
    send = row.view(B, L + D) if outs else torch.cat([y, shared], dim=-1)
    parts = layer.gather(send)                                             # [T, B, L + D]
    return layer.call("allreduce_latent_norm_up", prefix, parts[..., :L], parts[..., L:], w["latent_norm_w"],
                      w["w_latent_up"], eps)


def kda_step_tp(layer: RankLayer, prefix, blocks, conv_state, recurrent_state, routing: list | None = None) -> torch.Tensor:
    """One KDA layer step of this rank (layer 0: the dense MLP's slice): conv_state / recurrent_state
    are its head slices (layer.cfg: the rank's head count)."""
    x, n = FL._attn_side(layer, prefix, blocks)
    partial = FL.kda_attention(layer, x, conv_state, recurrent_state, layer.cfg.n_heads)
    return _mlp_side_tp(layer, prefix, partial, blocks, n, routing)


def mla_step_tp(layer: RankLayer, prefix, blocks, cache, block_table, seq_lens, routing: list | None = None) -> torch.Tensor:
    """One MLA layer step of this rank: the cache is its replica (every rank writes the same latent)."""
    x, n = FL._attn_side(layer, prefix, blocks)
    return _mlp_side_tp(layer, prefix, FL.mla_attention(layer, x, cache, block_table, seq_lens), blocks, n, routing)


def rank_steps(kind: str, x_steps: torch.Tensor, blocks: torch.Tensor, state: dict, layer_idx: int, config: str,
               weights: dict, gather, kernels: str = "fused", prefetch: bool = False) -> tuple[torch.Tensor, dict]:
    """This rank's registry-form run: the unsplit weights and state in, sharded here; returns
    (prefix_steps[N,B,D], this rank's final state)."""
    from stock.layers import validate_state

    layer = prepare_rank(kind, weights, config, layer_idx, x_steps.dtype, gather, kernels, prefetch)
    cfg = get_config(config) if isinstance(config, str) else config
    mine = shard_state(kind, state, cfg, gather.T, gather.rank)
    blocks = blocks.contiguous().clone()
    if kind == "mla":
        validate_state(layer, x_steps[0], blocks, mine, x_steps.shape[0])
    return torch.stack([layer.step(x, blocks, *mine.values()) for x in x_steps]), mine


def describe(layer: RankLayer, batch: int) -> dict:
    """fused.layers.describe for a rank's step at `batch` tokens: its ops plus the all-reduce op, and
    the gathers (and above one token the MoE partials' concatenation) as glue."""
    info = FL.describe(layer)
    info["fused"] += [op for op in TP_OPS if op not in layer.unfused and (op != "l2_prefetch" or layer.prefetch)]
    info["glue"] += ["all-gather of the attention partials"] + (
        ["all-gather of the dense MLP partials"] if layer.kind == "dense" else
        ["cat of the MoE partials [y | shared] (the all-gather's send row)"] * (batch > SEND_ROW_IN_PLACE_MAX)
        + ["all-gather of the MoE partials"])
    return info
