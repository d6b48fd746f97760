"""Which shapes `bench` times, and one rank's inputs for each.

A shape is (op, T, B, knobs): the K3 config, bf16, the op's input builder's case at batch B with
the knobs of one of the op's `bench_knobs` sets, split by the op's registry split rule, rank 0's
shard. Building K3 weights takes seconds on a CPU, so the unsplit inputs are built once per (op,
knobs) at the largest batch and a smaller batch takes the first B rows along the op's batch dims:
the same shapes and dtypes as the builder's own case at B (the weights, drawn per name, are its
own; activations differ in value only).

A paged attention op (its inputs hold q_abs, cache, block_table and seq_lens) also takes the bench knob
context=N (`bench --knobs`): its builder's case without it, then every sequence given N cached slots
in pages of its own (with_context). The registry's builders cap a case's context at a few pages (the
float64 oracle's cost); the speed of long-context decode needs the lengths a server sees.

A layer op (kda_layer, mla_layer) at K3 on a CUDA device is built with its weights drawn there
(stock.weights.make_layer_weights_on: the registry's names, shapes, dtypes and scales, another random
stream; the registry's CPU builder quantises 896 MXFP4 experts for minutes); its activations and
state are the registry builder's own, moved to the device. Its inputs stay on the device.

moe_experts_mxfp4 at K3 holds K3_CPU_EXPERTS experts in the registry's draw (the certification's
oracle cost), so a batch's tokens crowd onto few experts (B = 64: 1,024 pairs over 32 experts). With
the knob n_experts above that (`bench --knobs moe_experts_mxfp4:n_experts=896`, K3's count) on a CUDA
device, its experts are drawn there (stock.weights) and each token's top-k ids are k distinct of all
of them, as the registry draws them: the routing a K3 rank sees (device_expert_inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

SEED = 0
CONFIG = "k3"
DTYPE = "bfloat16"


@dataclass(frozen=True)
class Shape:
    op: str
    tp: int
    batch: int
    knobs: tuple = ()            # sorted (key, value) pairs

    @property
    def label(self) -> str:
        return " ".join([f"T={self.tp}", f"B={self.batch}"] + [f"{k}={v}" for k, v in self.knobs])

    def to_dict(self) -> dict:
        return {"op": self.op, "tp": self.tp, "batch": self.batch, "knobs": dict(self.knobs)}


# Ops with no harness split whose registry form has a tp form of its own (params["tp"], one rank's
# inputs): family -> the registry module whose rank_inputs(inputs, T) gives rank 0's inputs (and
# RANK_BATCH_DIMS the batch dims of the tensors it adds). A whole layer all-reduces mid-step, so a
# rank's row is one rank's step with its peers' partials given (verify.ops.layers.rank_inputs).
RANK_FORMS = {"layers": "verify.ops.layers"}
RANK_TPS = (2, 4, 8, 16)


def op_tps(op, tps: list[int]) -> tuple[list[int], list[str]]:
    """The T values of `tps` the op's split allows (T = 1 always; one T for a replicated op, whose
    rank holds the whole op at every T), and a note per one left out."""
    allowed = {1} | set(op.split.tp_values if op.split is not None else RANK_TPS if op.family in RANK_FORMS else ())
    keep = [t for t in tps if t in allowed]
    notes = [f"T={t}: not in {op.name}'s split ({sorted(allowed)})" for t in tps if t not in allowed]
    if op.split is not None and op.split.kind == "replicated" and len(keep) > 1:
        notes.append(f"T={','.join(map(str, keep[1:]))}: {op.name} is replicated, one rank's shape is T={keep[0]}'s")
        keep = keep[:1]
    return keep, notes


def coverage_order(values: list[int]) -> list[int]:
    """The values reordered so that any prefix spans their range: ends first, then midpoints
    (1,2,4,8,16,32,64 -> 1,64,8,2,16,4,32): a time budget that cuts an op keeps a spread of batches."""
    vals = sorted(set(values))
    if len(vals) <= 2:
        return vals
    out, spans = [vals[0], vals[-1]], [(0, len(vals) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                out.append(vals[mid])
                nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return out


def shapes_for(op, tps: list[int], batches: list[int]) -> tuple[list[Shape], list[str]]:
    """Every shape of one op, B in coverage order, then T, then the knob sets."""
    keep, notes = op_tps(op, tps)
    batch_list = sorted(set(op.bench_batches or batches))
    if not op.bench_batches:
        over = [b for b in batch_list if b > op.max_batch]
        if over:       # timed all the same: a serving batch, certified through the batch-invariance guard
            notes.append(f"B={','.join(map(str, over))}: over the batches {op.name}'s certification draws "
                         f"(<= {op.max_batch}; larger ones are covered by its batch-invariance guard)")
    shapes = [Shape(op.name, t, b, tuple(sorted(knobs.items())))
              for b in coverage_order(batch_list) for t in keep for knobs in op.bench_knobs]
    return shapes, notes


def case_for(op, shape: Shape, batch: int | None = None):
    from verify.model.case import Case

    return Case(op.name, SEED, batch or shape.batch, CONFIG, DTYPE, "normal", shape.tp, shape.knobs)


DEVICE_BUILT_FAMILIES = ("layers",)


PAGED = ("q_abs", "cache", "block_table", "seq_lens")


KNOB_READS = (r'knob\(\s*"(\w+)"', r'scalar_param\(\s*case\s*,\s*"(\w+)"')


def builder_knobs(op) -> set[str]:
    """The knob names the op's input builder reads: `case.knob("name")` and `scalar_param(case, "name", ..)`
    in its registry module and the verify.ops helpers it imports, and the names of its declared knob sets."""
    import re

    from verify.record.certificate import REGISTRY_PACKAGES, _registry_file, closure_files

    names = {k for sets in (op.knob_sweep, op.bench_knobs) for knobs in sets for k in knobs}
    for text in closure_files(_registry_file(op), packages=REGISTRY_PACKAGES).values():
        for pattern in KNOB_READS:
            names.update(re.findall(pattern, text.decode()))
    return names


def knob_error(op, knobs: dict) -> str | None:
    """Why `knobs` cannot be a bench knob set of `op` (None: it can): context=N (the bench's own knob,
    with_context; the registry's context values such as 'long' are its builder's) off a paged attention
    op or below one slot, or a name its builder does not read (a typo would time the default shape
    under the knob's label)."""
    declared = {line.split("[")[0].split(":")[0].strip() for line in op.signature.splitlines()}
    paged = set(PAGED) <= declared
    context = knobs.get("context")
    if isinstance(context, int):
        if not paged:
            return f"context=N is a paged attention op's knob; {op.name} has no {', '.join(PAGED)}"
        if context < 1:
            return f"context={context}: needs 1 or more slots"
    known = builder_knobs(op) | ({"context"} if paged else set())
    unknown = sorted(set(knobs) - known)
    if unknown:
        return f"{op.name}'s inputs read no knob {', '.join(map(repr, unknown))} (they read: {', '.join(sorted(known))})"
    return None


def with_context(inputs, context: int, device: str = "cpu", seed: int = SEED):
    """inputs with every sequence holding `context` slots: its own ceil(context / page) pages of a new
    cache (the builder's cache dtype, drawn at its cache's scale on `device`), block_table over them in
    order, seq_lens = context."""
    import torch

    from verify.model.opdef import OpInputs

    t = dict(inputs.tensors)
    base, B = t["cache"], t["seq_lens"].shape[0]
    if context < t["q_abs"].shape[1]:
        raise ValueError(f"context={context}: shorter than the {t['q_abs'].shape[1]} query tokens per sequence")
    page = base.shape[1]
    pages = -(-context // page)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(B * pages, page, base.shape[2], generator=gen, device=device, dtype=torch.float32)
    t["cache"] = cache.mul_(float(base.float().std())).to(base.dtype)
    t["block_table"] = torch.arange(B * pages, dtype=t["block_table"].dtype).view(B, pages).to(device)
    t["seq_lens"] = torch.full((B,), context, dtype=t["seq_lens"].dtype, device=device)
    return OpInputs(t, dict(inputs.params))


def build_inputs(op, case, device: str = "cpu"):
    """The op's inputs for `case`: its registry builder's, except a layer op at K3 on a CUDA device,
    whose weights are drawn on the device, and a numeric context knob (see the module doc)."""
    import dataclasses

    context = case.knob("context")
    if isinstance(context, int):
        base = op.make_inputs(dataclasses.replace(case, extra=tuple(kv for kv in case.extra if kv[0] != "context")))
        return with_context(base, context, device)
    if not device_built(op, case, device):
        return op.make_inputs(case)
    if op.family in DEVICE_BUILT_FAMILIES:
        return device_layer_inputs(op, case, device)
    return device_expert_inputs(op, case, device)


DEVICE_EXPERT_OPS = ("moe_experts_mxfp4",)


def whole_k3(op, case) -> bool:
    """A case whose weights are K3's whole per-layer set (GBs): a layer op at K3, and the routed
    experts at K3 with more experts than the registry's CPU draw holds (knob n_experts)."""
    if case.config != "k3":
        return False
    if op.family in DEVICE_BUILT_FAMILIES:
        return True
    from verify.ops.moe import K3_CPU_EXPERTS

    n = case.knob("n_experts")
    return op.name in DEVICE_EXPERT_OPS and isinstance(n, int) and n > K3_CPU_EXPERTS


def device_built(op, case, device) -> bool:
    """Whether build_inputs draws the case's weights on the device: a whole_k3 case on CUDA."""
    return str(device).startswith("cuda") and whole_k3(op, case)


def device_expert_inputs(op, case, device: str = "cuda"):
    """The routed experts' inputs with knob n_experts = E experts drawn on `device` (stock.weights:
    normal rows quantised to MXFP4 there). z, the routing weights, the padding slots and the params are
    the registry builder's, from its case at k experts; each token's ids are k distinct of the E
    (uniform, as the registry draws them), -1 where that case pads."""
    import dataclasses

    import torch

    from stock.weights import _Draw, _gen
    from verify.model.opdef import OpInputs
    from verify.ops.moe import expert_dims

    E = int(case.knob("n_experts"))
    _, L, I, k = expert_dims(case)
    if E < k:
        raise ValueError(f"n_experts={E}: fewer experts than the top-{k} each token chooses")
    small = dataclasses.replace(case, extra=tuple((n, k if n == "n_experts" else v) for n, v in case.extra))
    built = op.make_inputs(small)
    base = built.tensors
    B = base["ids"].shape[0]
    ids = torch.argsort(torch.rand((B, E), generator=_gen(case.seed, "ids", "cpu")), dim=1)[:, :k].contiguous()
    ids[base["ids"] < 0] = -1
    d = _Draw(case.seed, device)
    w13_p, w13_s = d.experts("w13", E, 2 * I, L)
    w2_p, w2_s = d.experts("w2", E, L, I)
    tensors = {"z": base["z"], "ids": ids.to(base["ids"].dtype), "weights": base["weights"],
               "w13_packed": w13_p, "w13_scale": w13_s, "w2_packed": w2_p, "w2_scale": w2_s}
    return OpInputs({n: t.to(device) for n, t in tensors.items()}, dict(built.params))


def device_layer_inputs(op, case, device: str = "cuda"):
    """A layer case's inputs with the weights of stock.weights.make_layer_weights_on (drawn on `device`)
    and the activations and state of the op's own builder (moved there)."""
    import torch

    from references.config import get_config
    from stock.weights import make_layer_weights_on
    from verify.model.opdef import OpInputs

    kind = op.name.split("_")[0]
    weights = make_layer_weights_on(kind, get_config(case.config), case.seed, getattr(torch, case.dtype), device=device)
    base = op.make_inputs(case, weights=weights)
    return OpInputs({n: t.to(device) for n, t in base.tensors.items()}, dict(base.params))


def take_batch(op, inputs, batch: int):
    """The first `batch` rows of every tensor the op declares a batch dim for, and of its rank form's
    (RANK_FORMS), as contiguous copies."""
    from verify.model.opdef import OpInputs

    import importlib

    dims = dict(op.batch_dims)
    if op.family in RANK_FORMS:
        dims.update(importlib.import_module(RANK_FORMS[op.family]).RANK_BATCH_DIMS)
    t = {}
    for name, x in inputs.tensors.items():
        dim = dims.get(name)
        t[name] = x.narrow(dim, 0, batch).contiguous() if dim is not None and x.shape[dim] > batch else x
    return OpInputs(t, dict(inputs.params))


def rank_inputs(op, unsplit, tp: int):
    """Rank 0's shard of the unsplit inputs under the op's split rule, or its family's tp form
    (RANK_FORMS); the inputs themselves at T = 1."""
    from verify.model.opdef import OpInputs
    from verify.ops.registry import import_callable

    if tp == 1:
        return unsplit
    if op.split is None and op.family in RANK_FORMS:
        return import_callable(f"{RANK_FORMS[op.family]}:rank_inputs")(unsplit, tp)
    shard = op.split.shard(unsplit, tp)[0]
    return OpInputs(dict(shard.tensors), dict(shard.params))


class InputCache:
    """Unsplit inputs per (op, knobs), built once at the largest batch a run asks of them (on the CPU,
    a K3 layer's on the device: build_inputs), and rank 0's shard of them per T, both kept for the
    run (its rounds come back to every op; the K3 inputs of the six fused ops hold about 1 GB). A K3
    layer's are about 16 GB, with its rank forms and the entries' own memory more than half an 80 GB
    card: the inputs of one whole_k3 op (a K3 layer, the routed experts at K3's 896 experts, 14.8 GB)
    are kept at a time, dropped when another's are built (rebuilt on the device in
    seconds when a later round comes back to it)."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._built: dict[tuple, tuple[int, object]] = {}
        self._ranked: dict[tuple, object] = {}
        self._whole: dict[tuple, bool] = {}

    def inputs(self, op, shape: Shape, largest: int):
        key = (op.name, shape.knobs)
        if key not in self._built or self._built[key][0] < shape.batch:
            case = case_for(op, shape, largest)
            whole = whole_k3(op, case)
            if whole:
                self._drop_whole()
            self._built[key] = (largest, build_inputs(op, case, self.device))
            self._whole[key] = whole
            self._ranked = {k: v for k, v in self._ranked.items() if k[:2] != key}
        rkey = (*key, shape.tp)
        if rkey not in self._ranked:
            self._ranked[rkey] = rank_inputs(op, self._built[key][1], shape.tp)
        return take_batch(op, self._ranked[rkey], shape.batch)

    def _drop_whole(self) -> None:
        """Before a whole_k3 op's inputs are built: those of every whole_k3 op (its own old build among
        them) and their rank forms, with the allocator's cache on CUDA."""
        gone = [k for k, whole in self._whole.items() if whole]
        if not gone:
            return
        for k in gone:
            del self._built[k], self._whole[k]
        self._ranked = {k: v for k, v in self._ranked.items() if k[:2] in self._built}
        if str(self.device).startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def held(self) -> list[tuple]:
        """The (op, knobs) keys whose unsplit inputs are kept now."""
        return list(self._built)
