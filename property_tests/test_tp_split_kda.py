"""KDA tensor-parallel forms: shard + per-rank run + combine == the unsplit op, in float64.

kda_in_proj and kda_decode go through their registry SplitRule (what the harness uses);
kda_attention_step (not a registered op) through references.kda_tp directly.
"""
from __future__ import annotations

import functools

import pytest
import torch

from references.config import get_config
from references.kda import kda_attention_step, kda_decode, kda_in_proj
from references.kda_tp import combine_kda_attention_step, shard_kda_attention_step
from verify.model.case import Case
from verify.model.opdef import OpInputs
from verify.ops.kda import KDA_DECODE, KDA_IN_PROJ, make_kda_attention_step_inputs
from verify.ops.registry import get_op

TPS = (1, 2, 4, 8, 16)
CONFIGS = ("tiny", "small")
TIGHT = dict(rtol=1e-12, atol=1e-12)


def _float64(inputs: OpInputs) -> OpInputs:
    """The oracle's view of the inputs: every floating tensor upcast to float64 (exact)."""
    return OpInputs({n: t.to(torch.float64) if t.is_floating_point() else t for n, t in inputs.tensors.items()},
                    dict(inputs.params))


@functools.lru_cache(maxsize=None)
def _inputs64(op_name: str, config: str, batch: int) -> OpInputs:
    """Built once per (op, config) and shared by every T: nothing below writes these tensors."""
    make = {"kda_in_proj": KDA_IN_PROJ.make_inputs, "kda_decode": KDA_DECODE.make_inputs,
            "kda_attention_step": make_kda_attention_step_inputs}[op_name]
    return _float64(make(Case(op_name, 11, batch, config, "float32")))


def _run(fn, outputs: tuple[str, ...], state: tuple[str, ...], tensors: dict, params: dict,
         copy: bool = True) -> dict:
    """Call fn (on fresh copies unless copy=False); return its outputs and its state after the call."""
    t = {n: v.clone() for n, v in tensors.items()} if copy else dict(tensors)
    got = fn(**t, **params)
    got = got if isinstance(got, tuple) else (got,)
    return {**dict(zip(outputs, got)), **{n: t[n] for n in state}}


def _check(split: dict, unsplit: dict, bitwise: tuple[str, ...] = ()):
    assert split.keys() == unsplit.keys()
    for name, want in unsplit.items():
        assert split[name].shape == want.shape, name
        if name in bitwise:
            assert torch.equal(split[name], want), f"{name}: a copy must be bitwise"
        else:
            torch.testing.assert_close(split[name], want, **TIGHT, msg=lambda m: f"{name}: {m}")


def _registered_split(op, inputs: OpInputs, T: int, bitwise=()):
    fn = op.reference.split(":")[1]
    ref = {"kda_in_proj": kda_in_proj, "kda_decode": kda_decode}[fn]
    unsplit = _run(ref, op.outputs, op.state, inputs.tensors, inputs.params)
    before = {n: inputs.tensors[n].clone() for n in op.state}
    shards = op.split.shard(inputs, T)
    assert len(shards) == T
    # Run on the shards themselves: their state must be copies, never views of the unsplit state.
    per_rank = [_run(ref, op.outputs, op.state, s.tensors, s.params, copy=False) for s in shards]
    _check(op.split.combine(per_rank, inputs), unsplit, bitwise)
    assert all(torch.equal(inputs.tensors[n], v) for n, v in before.items()), "a rank wrote the unsplit state"


def test_registered_ops_use_the_kda_references():
    assert get_op("kda_decode") is KDA_DECODE and get_op("kda_in_proj") is KDA_IN_PROJ
    assert KDA_DECODE.state == ("conv_state", "state") and KDA_DECODE.fused == "fused.kda_decode:kda_decode"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("T", TPS)
def test_kda_in_proj_split(config, T):
    inputs = _inputs64("kda_in_proj", config, 3)
    _registered_split(KDA_IN_PROJ, inputs, T)


@pytest.mark.parametrize("config", CONFIGS + ("k3",))
@pytest.mark.parametrize("T", TPS)
def test_kda_decode_split(config, T):
    batch = 1 if config == "k3" else 3
    inputs = _inputs64("kda_decode", config, batch)
    _registered_split(KDA_DECODE, inputs, T, bitwise=("conv_state",))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("T", TPS)
def test_kda_attention_step_split(config, T):
    """o_proj is row-parallel: partial sums folded rank-ascending; equal to unsplit up to fp64 rounding."""
    inputs = _inputs64("kda_attention_step", config, 3)
    state = ("conv_state", "state")
    unsplit = _run(kda_attention_step, ("out",), state, inputs.tensors, inputs.params)
    per_rank = [_run(kda_attention_step, ("out",), state, t, p)
                for t, p in shard_kda_attention_step(inputs.tensors, inputs.params, T)]
    _check(combine_kda_attention_step(per_rank), unsplit, bitwise=("conv_state",))


def test_attention_step_single_rank_is_bitwise_in_working_dtype():
    """T = 1 must not change the arithmetic: the fold of one partial is that partial."""
    inputs = make_kda_attention_step_inputs(Case("kda_attention_step", 14, 2, "tiny", "bfloat16"))
    state = ("conv_state", "state")
    unsplit = _run(kda_attention_step, ("out",), state, inputs.tensors, inputs.params)
    (t, p), = shard_kda_attention_step(inputs.tensors, inputs.params, 1)
    split = combine_kda_attention_step([_run(kda_attention_step, ("out",), state, t, p)])
    for name in unsplit:
        assert torch.equal(split[name], unsplit[name]), name


@pytest.mark.parametrize("T", (3, 5, 32))
def test_split_rejects_t_not_dividing_heads(T):
    inputs = KDA_DECODE.make_inputs(Case("kda_decode", 1, 1, "tiny", "float32"))
    with pytest.raises(ValueError, match="^T:"):
        KDA_DECODE.split.shard(inputs, T)


def test_heads_divide_every_tp_degree():
    for name in ("tiny", "small", "k3"):
        assert all(get_config(name).n_heads % T == 0 for T in TPS), name


def test_split_baseline_error_ignores_nonfinite_elements():
    """A split case's row baseline error comes from the row's finite elements: a row with a NaN head
    kept its other heads' error (a NaN max became a zero error, and the reference itself failed the
    nonfinite kda_decode case below at T = 4 by 1.9x)."""
    import torch

    from verify.judge.candidates import reference_fn
    from verify.model.case import Case
    from verify.judge.pipeline import evaluate_case
    from verify.ops.registry import get_op
    from verify.judge.split import _row_err
    a = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 2.0, 2.5]])
    o = torch.tensor([[1.5, 2.0, 3.0], [float("inf"), 2.25, float("nan")]], dtype=torch.float64)
    assert _row_err(a, o).tolist() == [0.5, 0.25]
    op = get_op("kda_decode")
    v = evaluate_case(op, Case("kda_decode", 4818, 2, "tiny", "bfloat16", "nonfinite", 4), reference_fn(op),
                      "reference", "cpu")
    assert v.status == "pass", v.reason
