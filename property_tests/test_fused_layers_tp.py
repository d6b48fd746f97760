"""The fused layer step split over T real ranks (fused/layers_tp.py), one process per rank: with the
reference kernels inside, every rank's output steps and the joined state are references.layers_tp's
simulated T-rank layer bit for bit (gloo on CPUs); a fold in another order is rejected by that
comparison. On two GPUs (NCCL) the fused kernels run inside, with and without the L2 prefetch during
the attention gather (the same bits); on one GPU the rank's own step is timed at K3 per-rank shapes
(T = 8, 16) with its gathers standing in, with and without the prefetch, beside the stock step."""
from __future__ import annotations

import pytest
import torch

from property_tests.ranks import spawn_ranks

KINDS = {"kda": ("conv_state", "recurrent_state"), "mla": ("cache", "block_table", "seq_lens"),
         "dense": ("conv_state", "recurrent_state")}
LAYER = {"kda": 12, "mla": 15, "dense": 0}   # 12 pushes a block; 15 is an MLA layer with 2 blocks; 0 the dense one


def _inputs(kind: str, config: str = "tiny", batch: int = 3, steps: int = 3, seed: int = 5):
    from verify.model.case import Case
    from verify.ops.layers import make_kda_layer_inputs, make_mla_layer_inputs

    make = make_mla_layer_inputs if kind == "mla" else make_kda_layer_inputs
    inputs = make(Case(op="mla_layer" if kind == "mla" else "kda_layer", seed=seed, batch=batch, config=config,
                       extra=(("layer_idx", LAYER[kind]), ("steps", steps))))
    t = dict(inputs.tensors)
    state = {n: t.pop(n) for n in KINDS[kind]}
    return t.pop("x_steps"), t.pop("blocks"), state, t, inputs.params


def _rank_worker(rank: int, T: int, device: str, kind: str, kernels: str, fold: str, prefetch: bool = False,
                 batch: int = 3):
    import fused.layers_tp as TP

    x_steps, blocks, state, weights, params = _inputs(kind, batch=batch)
    move = lambda d: {k: v.to(device) for k, v in d.items()}
    gather = TP.ProcessGroupGather()
    if fold == "wd_allreduce":       # the planted bug: a working-dtype all-reduce (NCCL's bf16 sum)
        gather = _WdAllReduce(gather)
    out, mine = TP.rank_steps(kind, x_steps.to(device), blocks.to(device), move(state), params["layer_idx"],
                              params["config"], move(weights), gather, kernels, prefetch)
    return out.cpu(), {n: t.cpu() for n, t in mine.items()}


class _WdAllReduce:
    """A gather whose slot 0 holds the partials summed in the working dtype (each add rounded, as an
    all-reduce of bf16 buffers sums them) and the other slots zeros: the fold then gives that sum."""

    def __init__(self, real):
        self.real, self.T, self.rank = real, real.T, real.rank

    def __call__(self, t):
        parts = self.real(t)
        total = parts[0].clone()
        for r in range(1, self.T):
            total = total + parts[r]
        out = torch.zeros_like(parts)
        out[0] = total
        return out


def _run_ranks(kind: str, T: int, backend: str = "gloo", kernels: str = "reference", fold: str = "declared",
               prefetch: bool = False, batch: int = 3):
    """[(rank, output steps, rank state)] in rank order."""
    return [(r, *payload) for r, payload in enumerate(spawn_ranks(_rank_worker, T, backend, kind, kernels, fold,
                                                                   prefetch, batch))]


def _reference(kind: str, T: int, batch: int = 3):
    from references.config import get_config
    from references.layers import LayerState, decode_steps
    from references.weights import LayerWeights

    x_steps, blocks, state, weights, params = _inputs(kind, batch=batch)
    w = LayerWeights(kind, get_config(params["config"]), x_steps.dtype, weights)
    st = LayerState(prefix=torch.zeros_like(x_steps[0]), blocks=blocks.clone(), **state)
    return decode_steps(kind, w, st, x_steps, params["layer_idx"], tp=T), {n: getattr(st, n) for n in KINDS[kind]}


@pytest.mark.parametrize("kind,T,prefetch,batch", [("kda", 2, False, 3), ("mla", 2, True, 3), ("kda", 4, False, 3),
                                                   ("dense", 2, False, 3), ("kda", 2, False, 1), ("mla", 4, False, 1)])
def test_ranks_over_gloo_are_the_simulated_tp_layer_bit_for_bit(kind, T, prefetch, batch):
    """At one token the MoE partials go into the all-gather's send row in place; above it, concatenated."""
    from fused.layers_tp import join_state

    want, want_state = _reference(kind, T, batch)
    results = _run_ranks(kind, T, prefetch=prefetch, batch=batch)
    for rank, out, _ in results:
        assert torch.equal(out, want), f"rank {rank}: outputs differ from references.layers_tp at T={T}"
    joined = join_state(kind, [r[2] for r in results])
    for n in KINDS[kind]:
        assert torch.equal(joined[n], want_state[n]), n


def test_partials_summed_in_the_working_dtype_are_caught():
    """The control: an all-reduce that sums the bf16 partials in bf16 (not the declared fp32 fold)
    changes the layer's bits, and the comparison above sees it."""
    want, _ = _reference("kda", 4)
    results = _run_ranks("kda", 4, fold="wd_allreduce")
    assert not torch.equal(results[0][1], want)


def test_copies_gather_stands_in_for_the_ranks():
    from fused.layers_tp import CopiesGather

    g = CopiesGather(4, 1)
    t = torch.arange(6.0).view(2, 3)
    got = g(t)
    assert got.shape == (4, 2, 3) and all(torch.equal(got[r], t) for r in range(4))


# ---------------------------------------------------------------------------------------------- GPUs
@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_fused_ranks_over_nccl_on_two_gpus(kind):
    """The fused kernels on 2 GPUs: every rank's outputs the same bits, within the bf16 layer's
    error of the simulated T = 2 reference layer (the op certificates bound each kernel)."""
    want, _ = _reference(kind, 2)
    results = _run_ranks(kind, 2, backend="nccl", kernels="fused")
    assert torch.equal(results[0][1], results[1][1]), "the ranks' replicated outputs differ"
    prefetched = _run_ranks(kind, 2, backend="nccl", kernels="fused", prefetch=True)
    assert torch.equal(prefetched[0][1], results[0][1]), "the L2 prefetch changed the layer's outputs"
    err = ((results[0][1].double() - want.double()).norm() / want.double().norm()).item()
    print(f"\n{kind} fused T=2 over NCCL: relative distance to the reference layer {err:.2e}")
    assert torch.isfinite(results[0][1]).all()


def _k3_timed_rank_worker(rank: int, T: int, device: str, kind: str, out_dir: str):
    """Rank `rank` of T over NCCL at K3: the fused step, with and without the L2 prefetch, at B = 1 and 8;
    each step timed eagerly and, where NCCL's collectives capture, as a CUDA-graph replay; one step
    profiled: its kernels counted and its stream overlap written to out_dir (verify/bench/overlap.py)."""
    import os

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import fused.layers_tp as TP
    from property_tests.gpu_timing import graph_us
    from references.config import K3
    from references.layers import new_layer_state
    from stock.weights import make_layer_weights_on
    from verify.bench.overlap import format_summary, summarize
    from verify.bench.profile import profiled_intervals

    rows = []
    w = make_layer_weights_on(kind, K3, 0, device=device).tensors          # the same draw on every rank
    for prefetch in (False, True):
        layer = TP.prepare_rank(kind, w, K3, LAYER[kind], torch.bfloat16, TP.ProcessGroupGather(),
                                prefetch=prefetch)
        for B in (1, 8):
            st = new_layer_state(kind, K3, B, max_tokens=512)
            g = torch.Generator(device=device).manual_seed(B)
            blocks = torch.randn(B, 8, K3.hidden, device=device, generator=g).to(torch.bfloat16)
            prefix = torch.randn(B, K3.hidden, device=device, generator=g).to(torch.bfloat16)
            state = TP.shard_state(kind, {n: getattr(st, n).to(device) for n in KINDS[kind]}, K3, T, rank)
            step = lambda: layer.step(prefix, blocks, *state.values())
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                step()
            end.record()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            work = profiled_intervals(prof)
            row = {"prefetch": prefetch, "B": B, "eager_us": start.elapsed_time(end) / 20 * 1e3,
                   "launches": sum(iv.category == "kernel" for iv in work)}
            if out_dir:
                name = f"k3_{kind}_T{T}_B{B}{'_prefetch' if prefetch else ''}_rank{rank}.overlap.txt"
                with open(os.path.join(out_dir, name), "w") as f:
                    f.write(format_summary(summarize(work)))
            dist.barrier()
            try:
                row["graph"] = f"{graph_us(step):.1f} us"
            except Exception as e:            # NCCL collectives that do not capture: say so, keep eager
                row["graph"] = f"not captured: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            torch.cuda.synchronize()
            dist.barrier()
            rows.append(row)
    return rows


@pytest.mark.multi_gpu(2)
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_k3_steps_over_nccl_on_two_gpus_timed(kind):
    """T = 2 at K3 with the real all-gathers: us per step (eager and CUDA-graph replays), launches, and
    each rank's stream overlap (shared experts beside the routed experts, the L2 prefetch beside the
    gather) under $OUT when set; printed for the layer table."""
    import os

    out_dir = os.environ.get("OUT", "")
    ranks = spawn_ranks(_k3_timed_rank_worker, 2, "nccl", kind, out_dir)
    for rank, rows in enumerate(ranks):
        for row in rows:
            print(f"\nK3 {kind} T=2 rank {rank} B={row['B']} prefetch={row['prefetch']}: {row['launches']} launches, "
                  f"eager {row['eager_us']:.1f} us, graph {row['graph']}")
    assert all(len(rows) == 4 for rows in ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,T,config", [("kda", 2, "tiny"), ("mla", 4, "tiny"), ("kda", 8, "small"),
                                           ("mla", 2, "small")])
def test_the_send_row_written_in_place_gives_the_concatenation_bits(monkeypatch, kind, T, config):
    """At one token the fused routed and shared experts write their partials into the halves of the MoE
    all-gather's send row (out=): the rank's output steps and state are those of the same fused step
    with the partials concatenated, bit for bit."""
    import fused.layers_tp as TP

    x_steps, blocks, state, weights, params = _inputs(kind, config=config, batch=1)
    move = lambda d: {k: v.cuda() for k, v in d.items()}
    runs = {}
    for in_place in (1, 0):
        monkeypatch.setattr(TP, "SEND_ROW_IN_PLACE_MAX", in_place)
        runs[in_place] = TP.rank_steps(kind, x_steps.cuda(), blocks.cuda(), move(state), params["layer_idx"],
                                       params["config"], move(weights), TP.CopiesGather(T), "fused")
    (out1, st1), (out0, st0) = runs[1], runs[0]
    assert torch.isfinite(out1).all()
    assert torch.equal(out1, out0), "the send row written in place changed the rank's outputs"
    for n in st1:
        assert torch.equal(st1[n], st0[n]), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_k3_rank_step_on_one_gpu(kind):
    """One rank's step at K3 per-rank shapes (T = 8, 16; B = 1, 8, 64) beside the stock layer's step on
    the same shards (stock.layers with the rank's head count: its partials used as they are, no
    all-reduce): each captured in a CUDA graph, launches counted, timed over replays (printed for the
    layer table). Neither time holds the all-gathers / all-reduces (one GPU)."""
    import fused.layers_tp as TP
    import stock.layers as stock
    from property_tests.gpu_timing import graph_us
    from references.config import K3
    from references.layers import new_layer_state
    from stock.weights import make_layer_weights_on
    from verify.bench.launches import count_launches

    w = make_layer_weights_on(kind, K3, 0, device="cuda").tensors
    all_reduce_launches = {}
    for T in (8, 16):
        # one set of the rank's shards for the three layers (the MoE weights padded and cut once: three
        # copies of them do not fit an 80 GB card beside the unsplit weights)
        rank_cfg = TP.rank_config(K3, T)
        shards = TP.shard_weights(kind, w, K3, torch.bfloat16, T, 0)
        layer = TP.prepare_shards(kind, dict(shards), rank_cfg, LAYER[kind], torch.bfloat16, TP.CopiesGather(T))
        prefetching = TP.prepare_shards(kind, dict(shards), rank_cfg, LAYER[kind], torch.bfloat16, TP.CopiesGather(T),
                                        prefetch=True)
        stock_layer = stock.prepare(kind, dict(shards), rank_cfg, LAYER[kind], torch.bfloat16)
        for B in (1, 8, 64):
            st = new_layer_state(kind, K3, B, max_tokens=512)
            g = torch.Generator(device="cuda").manual_seed(B)
            blocks = torch.randn(B, 8, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
            prefix = torch.randn(B, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
            row = {}
            for name, lay in (("fused", layer), ("fused+prefetch", prefetching), ("stock", stock_layer)):
                state = TP.shard_state(kind, {n: getattr(st, n).cuda() for n in KINDS[kind]}, K3, T, 0)
                bl = blocks.clone()
                out = lay.step(prefix, bl.clone(), *state.values())
                assert torch.isfinite(out).all(), (name, T, B)
                count = count_launches(lambda: lay.step(prefix, bl, *state.values()), warmup=1)
                row[name] = (count.kernels, graph_us(lambda: lay.step(prefix, bl, *state.values())))
            print(f"\nK3 {kind} rank step T={T} B={B}: fused {row['fused'][0]} launches {row['fused'][1]:.1f} us | "
                  f"with the L2 prefetch {row['fused+prefetch'][0]} launches {row['fused+prefetch'][1]:.1f} us | "
                  f"stock {row['stock'][0]} launches {row['stock'][1]:.1f} us | fused unfused {sorted(layer.unfused)}")
        all_reduce_launches[T] = _all_reduce_launches(layer, T)
        del layer, prefetching, stock_layer, shards
        torch.cuda.empty_cache()
    # the rank's all-reduces take the same launches whatever T (allreduce_attn_res_rmsnorm one, the MoE
    # tail two: one fold of the gathered row, then allreduce_latent_norm_up's kernel), so a rank's launch
    # count does not grow with the number of ranks. (The step's own count also moves with the other
    # kernels' per-shape variants, so the step counts above are printed, not compared across T.)
    assert all_reduce_launches[8] == all_reduce_launches[16] == (1, 2), all_reduce_launches


def _all_reduce_launches(layer, T: int, B: int = 8) -> tuple[int, int]:
    """(launches of the attention all-reduce, of the MoE tail) of a rank layer on T gathered partials,
    each counted from its own CUDA graph."""
    from references.layers import attn_res_layout
    from verify.bench.launches import count_launches

    cfg, w, eps = layer.cfg, layer.w, layer.cfg.rms_eps
    L, D = cfg.latent, cfg.hidden
    g = torch.Generator(device="cuda").manual_seed(T)
    draw = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    prefix, blocks, deltas, parts = draw(B, D), draw(B, 8, D), draw(T, B, D), draw(T, B, L + D)
    n_blocks, push = attn_res_layout(layer.layer_idx, cfg.attn_res_block)
    attn = count_launches(lambda: layer.call("allreduce_attn_res_rmsnorm", prefix, deltas, blocks, w["mlp_res_norm_w"],
                                             w["mlp_res_proj_w"], w["post_norm_w"], n_blocks + int(push), -1, eps,
                                             eps), warmup=1)
    tail = count_launches(lambda: layer.call("allreduce_latent_norm_up", prefix, parts[..., :L], parts[..., L:],
                                             w["latent_norm_w"], w["w_latent_up"], eps), warmup=1)
    return attn.kernels, tail.kernels
