"""The contract every op entry follows. One OpDef per op of shared/OPS.md; see docs/ARCHITECTURE.md."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from verify.model.case import Case
from verify.model.values import EDGE_DISTS, GENERIC_DISTS


@dataclass(frozen=True)
class OpInputs:
    """Inputs of one case: tensors (CPU, working dtype where floating) and static params (JSON-able)."""
    tensors: dict[str, torch.Tensor]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RankShard:
    tensors: dict[str, torch.Tensor]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SplitRule:
    """How an op shards over T ranks and how per-rank results combine into the unsplit result.

    shard(inputs, T) -> list of T RankShard, one per rank, rank order.
    combine(per_rank_results, inputs) -> results shaped like the unsplit op's, where
      per_rank_results[r] is a dict name -> tensor holding rank r's outputs AND its state after the call.
    reduction_order: the declared order of any sum across ranks (e.g. "rank 0..T-1 left fold in fp32").
    """
    kind: str                                   # column | row | heads | replicated | partial_sum | experts | scores_gather
    shard: Callable[[OpInputs, int], list[RankShard]]
    combine: Callable[[list[dict[str, torch.Tensor]], OpInputs], dict[str, torch.Tensor]]
    reduction_order: str = "none"
    tp_values: tuple[int, ...] = (1, 2, 4, 8, 16)
    order_sensitive: bool = False               # True if combine sums floats (inputs drawn so order matters)


@dataclass(frozen=True)
class Peer:
    """Another library's implementation that `verify-kernels bench` times beside the op's candidates.

    prepare: "module:attr" of a function (tensors, params) -> a zero-argument launch; whatever it
    needs (its own layouts, imports) is done there, untimed. It raises ImportError when its library
    is not installed (the peer is then reported as unavailable). part: what it covers when it is not
    the whole op ("logits GEMM only"); every declared peer counts in the speed rule."""
    name: str
    prepare: str
    part: str = ""


@dataclass(frozen=True)
class OpDef:
    name: str
    family: str                                 # references module holding the reference
    reference: str                              # "references.family:function"
    make_inputs: Callable[[Case], OpInputs]     # rebuilds every input bit-for-bit from the case
    outputs: tuple[str, ...]                    # names of the returned tensors, in order
    signature: str                              # one readable line per argument: shapes and dtypes
    state: tuple[str, ...] = ()                 # inputs updated in place; judged like outputs
    batch_dims: dict[str, int] = field(default_factory=dict)  # input/output/state name -> batch dim
    row_ndims: dict[str, int] = field(default_factory=dict)   # output -> trailing dims forming one judged row (1)
    split: SplitRule | None = None
    fused: str | None = None                    # "fused.module:function" of our CuTe DSL candidate
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    configs: tuple[str, ...] = ("tiny", "small", "k3")
    dists: tuple[str, ...] = GENERIC_DISTS + EDGE_DISTS   # ops without a defined result for NaN inputs declare their own
    max_batch: int = 64
    tie_scores: Callable[[OpInputs], torch.Tensor] | None = None   # fp64 selection scores, tie-aware ops
    reweigh: Callable[[OpInputs, torch.Tensor], dict[str, torch.Tensor]] | None = None  # ids -> reference outputs for them
    # (fp64 inputs, candidate outputs) -> fp64 running-error magnitude per output element (the |terms|
    # its sums add up): a derived floor's scale where larger than the row's max |oracle| (cancelling
    # rows err by ulps of their terms); gets the candidate's outputs for ops judged on its ids
    magnitudes: Callable[[OpInputs, dict], dict[str, torch.Tensor]] | None = None
    # knob sets the draw never reaches by itself, each run as explicit cases in every profile (cases.
    # knob_sweep_cases), e.g. skinny_gemm's off-tile projection: {"proj": "off_tile"}
    knob_sweep: tuple[dict, ...] = ()
    # how `run --distributed` runs the op over real ranks: None (no collective of its own: only a split
    # whose combine sums runs there), "split" (shard, run per rank, gather, combine), or a form of
    # verify/run/distributed.py's FORMS ("gathered_partials", "gathered_scores")
    collective: str | None = None
    # inputs -> the integer tensors an engine grows in place between steps (seq_lens, block tables), or
    # None: guard:grown_inputs calls again after writing them into the same tensors
    grow_inputs: Callable[[OpInputs], dict[str, torch.Tensor] | None] | None = None
    # bench: bytes the op must read and write for these inputs (its floor is a copy of them; checked
    # against the real tensors in property_tests/test_bench.py), the peers it is timed against, the
    # knob sets each timed shape is run with, and case batches replacing the run's --batch list
    # (an op whose batch is not decode tokens, e.g. mxfp4_dequant's weight rows)
    moved_bytes: Callable[[OpInputs], int] | None = None
    peers: tuple[Peer, ...] = ()
    bench_knobs: tuple[dict, ...] = ({},)
    bench_batches: tuple[int, ...] = ()
    compile_heavy: bool = False                 # torch.compile of the reference takes minutes on a CPU
    cpu_ok: bool = True                         # reference practical on CPU at the k3 config
    notes: str = ""
