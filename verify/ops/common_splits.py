"""Input draws and rank-split helpers shared by the attn_res, moe, mxfp4 and gemm registry entries.

Every tensor draws from its own generator salted by its name, so a weight does not change with the
batch size and one tensor's distribution never shifts another's values. No OPS here.
"""
from __future__ import annotations

import zlib

import torch

from references.primitives import fold_ranks  # noqa: F401  (re-exported for the splits)
from verify.model.case import Case
from verify.model.opdef import OpInputs, RankShard, SplitRule
from verify.model.values import draw, generator

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}
FOLD_ORDER = "rank 0..T-1 left fold in fp32 (float64 for the oracle), rounded once to the working dtype"


RMS_EPS_DRAWS = (1e-6, 1e-4)          # RMSNorm eps draws besides the config's 1e-5 (attn_res, latent_norm_up)


def scalar_param(case: Case, name: str, default: float, others: tuple[float, ...]) -> float:
    """A scalar parameter of the op (an eps, a bound, a scale): the `name` knob, else drawn from the
    seed among the config's `default` and `others`, so a kernel that bakes the config's value in (or
    swaps two parameters that the config gives the same value) is wrong on the cases that draw
    another (found by probing: a swapped eps / norm_eps, a fixed lower_bound and an ignored
    routed_scale were certified while every case passed the config's values)."""
    v = case.knob(name)
    if v is None:
        opts = (default,) + tuple(o for o in others if o != default)
        v = opts[int(torch.randint(0, len(opts), (1,), generator=gen_for(case, "param:" + name)))]
    return float(v)


def working_dtype(case: Case) -> torch.dtype:
    try:
        return DTYPES[case.dtype]
    except KeyError:
        raise ValueError(f"dtype={case.dtype!r} is unknown; choose one of {sorted(DTYPES)}") from None


def gen_for(case: Case, name: str) -> torch.Generator:
    return generator(case.seed, zlib.crc32(name.encode()))


def activation(case: Case, name: str, shape, dtype: torch.dtype, *, scale: float = 1.0,
               dist: str | None = None) -> torch.Tensor:
    dist = case.dist if dist is None else dist
    if dist in ("near_ties", "order_sensitive"):     # built by the op itself; plain values elsewhere
        dist = "normal"
    return draw(gen_for(case, name), shape, dist, scale=scale, dtype=dtype, row_seed=case.seed)


def weight(case: Case, name: str, shape, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal weight with std fan_in^-1/2 (activations stay O(1)); drawn in fp32 (k3 weights are large)."""
    w = torch.randn(tuple(shape), generator=gen_for(case, name), dtype=torch.float32)
    return (w * fan_in ** -0.5).to(dtype)


def norm_weight(case: Case, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=gen_for(case, name), dtype=torch.float64)).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN == NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(torch.where(both_nan, True, (a == b) & (torch.signbit(a) == torch.signbit(b))).all())
    return bool(torch.equal(a, b))


def check_tp(T, what: str = "T") -> None:
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"{what}: {T!r} must be a positive int (tensor-parallel ranks)")


def check_divides(T: int, dim: int, arg: str) -> None:
    check_tp(T)
    if dim % T:
        raise ValueError(f"T: {T} does not divide {arg}={dim}; pick a T that divides it")


def replicated_split(order: str = "none: replicated, every rank computes the same result",
                     order_sensitive: bool = False) -> SplitRule:
    """Every rank gets a copy of all inputs; ranks must agree bitwise, the result is rank 0's."""

    def shard(inputs: OpInputs, T: int) -> list[RankShard]:
        check_tp(T)
        return [RankShard({k: v.clone() for k, v in inputs.tensors.items()}, dict(inputs.params))
                for _ in range(T)]

    def combine(per_rank: list[dict], inputs: OpInputs) -> dict:
        first = per_rank[0]
        for r, res in enumerate(per_rank[1:], start=1):
            for name, t in first.items():
                if not same_bits(t, res[name]):
                    raise ValueError(f"per_rank_results: rank {r} {name!r} differs from rank 0; a replicated "
                                     f"op must give identical bits on every rank")
        return dict(first)

    return SplitRule(kind="replicated", shard=shard, combine=combine, reduction_order=order,
                     order_sensitive=order_sensitive)


def sum_outputs_combine(names: tuple[str, ...]):
    """combine() for partial-sum splits: each named output is the fold of the per-rank partials."""

    def combine(per_rank: list[dict], inputs: OpInputs) -> dict:
        return {n: fold_ranks([res[n] for res in per_rank]) for n in names}

    return combine


def run_reference(op, inputs: OpInputs, fn=None) -> dict[str, torch.Tensor]:
    """Run op's reference (or fn) on a copy of inputs; return {output name: tensor, state name: after}."""
    from verify.ops.registry import import_callable
    fn = fn or import_callable(op.reference)
    tensors = {k: v.clone() for k, v in inputs.tensors.items()}
    result = fn(**tensors, **inputs.params)
    if len(op.outputs) == 1:
        result = (result,)
    named = dict(zip(op.outputs, result or ()))
    named.update({s: tensors[s] for s in op.state})
    return named


def run_split(op, inputs: OpInputs, T: int, split: SplitRule | None = None, fn=None) -> dict[str, torch.Tensor]:
    """Shard inputs over T simulated ranks, run the reference per rank, combine (one process)."""
    split = split or op.split
    per_rank = [run_reference(op, OpInputs(s.tensors, s.params), fn) for s in split.shard(inputs, T)]
    return split.combine(per_rank, inputs)


def split_mismatches(op, inputs: OpInputs, T: int, split: SplitRule | None = None,
                     rtol: float = 1e-12) -> list[str]:
    """Problems of shard + per-rank reference + combine against the unsplit run ([] = none).

    Meant for float64 inputs, where a split run differs only by reassociated sums: floats must agree
    to rtol of the output's largest magnitude, integers exactly."""
    unsplit, combined = run_reference(op, inputs), run_split(op, inputs, T, split)
    problems = [f"combine did not return {n!r}" for n in unsplit if n not in combined]   # outputs and state
    for name, want in unsplit.items():
        got = combined.get(name)
        if got is None:
            continue
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"{name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
        elif want.is_floating_point():
            fin = torch.isfinite(want)                  # NaN and infinities must sit in the same places
            special = (torch.isnan(want) != torch.isnan(got)) | (~fin & ~torch.isnan(want) & (got != want))
            if special.any():
                problems.append(f"{name}: {int(special.sum())} NaN / infinite elements differ from the unsplit run's")
            scale = float(want[fin].abs().max()) if fin.any() else 0.0
            err = float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0
            if not err <= rtol * scale:
                problems.append(f"{name}: max |split - unsplit| = {err:.3g} > {rtol:g} x {scale:.3g}")
        elif not torch.equal(got, want):
            problems.append(f"{name}: integer outputs differ")
    return problems
