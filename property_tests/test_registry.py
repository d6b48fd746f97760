"""The four places of every op stay in step, and every registry entry honours the OpDef contract."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.model.case import Case
from verify.ops.registry import UnknownOpError, all_ops, get_op, import_callable
from verify.model.specs import SPEC_DIR, load_spec

ROOT = Path(__file__).resolve().parent.parent
# shared/OPS.md, "Op pairs": every row must be registered.
INVENTORY = (
    "attn_res_rmsnorm", "allreduce_attn_res_rmsnorm", "kda_in_proj", "kda_decode", "mla_qkv_a", "mla_q_absorb",
    "mla_cache_write", "mla_decode_attn", "mla_out_gate", "skinny_gemm", "router_topk", "moe_experts_mxfp4",
    "latent_norm_up", "shared_experts", "mxfp4_dequant", "l2_prefetch", "kda_layer", "mla_layer",
)
OPS = sorted(all_ops())
# runtime: the kernels' shared launch helpers; layers: the fused layer step, a composition of the
# kernels judged as a candidate of kda_layer and mla_layer (fused.layers:layer_steps, test_fused_layers;
# layers_tp: its T-rank form, test_fused_layers_tp)
NOT_KERNELS = {"runtime", "grid_sync", "__init__", "layers", "layers_tp"}


def test_inventory_is_registered():
    missing = [n for n in INVENTORY if n not in all_ops()]
    assert not missing, f"ops of shared/OPS.md without a registry entry: {missing}"


def test_every_spec_has_an_op_and_every_op_a_spec():
    specs = {p.stem for p in SPEC_DIR.glob("*.toml")}
    assert specs - set(OPS) == set(), f"specs without a registry entry: {sorted(specs - set(OPS))}"
    assert set(OPS) - specs == set(), f"ops without a spec: {sorted(set(OPS) - specs)}"


# Kernels in fused/ whose op's registry entry does not name them yet: wiring `fused=` edits the family's
# registry module, which stales that family's certified ops, so it lands with the release run that
# certifies the new kernel and re-certifies the family.
AWAITING_RELEASE: set[str] = {"l2_prefetch"}


def test_every_fused_kernel_has_a_reference():
    for path in sorted((ROOT / "fused").glob("*.py")):
        if path.stem in NOT_KERNELS or path.stem.startswith("_"):
            continue
        parent = next((n for n in all_ops() if path.stem.startswith(n + "_") and all_ops()[n].fused), None)
        if parent is not None:
            continue                 # a variant family of op `parent` (e.g. skinny_gemm_mma)
        op = all_ops().get(path.stem)
        assert op is not None, f"fused/{path.name} has no registry entry named {path.stem!r}"
        if path.stem in AWAITING_RELEASE:   # judged by import path; wired together with its certificate
            assert op.fused is None and callable(import_callable(f"fused.{path.stem}:{path.stem}")), path.stem
            continue
        assert op.fused == f"fused.{path.stem}:{path.stem}", f"{path.stem}: OpDef.fused is {op.fused!r}"


@pytest.mark.parametrize("name", OPS)
def test_entry_contract(name):
    op = get_op(name)
    spec = load_spec(name)
    assert spec.op == name
    for out in op.outputs + op.state:
        spec.output(out)  # raises naming the missing table
    extra = set(spec.outputs) - set(op.outputs + op.state)
    assert not extra, f"{name}: spec tables for unknown outputs {sorted(extra)}"
    assert callable(import_callable(op.reference))
    assert op.reference.split(":")[0].startswith("references."), "references live in references/"
    if op.fused:
        mod = op.fused.split(":")[0]
        assert importlib.util.find_spec(mod) is not None, f"{name}: fused module {mod} not found"
    if op.split is not None:
        assert op.split.reduction_order, f"{name}: split rule must declare its reduction order"
        if op.split.order_sensitive:
            assert spec.claims.reduction_order, f"{name}: order-sensitive split needs claims.reduction_order"
    for k in op.batch_dims:
        assert k in op.outputs or k in op.state or k in _input_names(op), f"{name}: batch_dims names unknown {k!r}"


def _input_names(op) -> set[str]:
    """The tensors of a default case and of each knob-sweep case (a knob may add inputs: a layer's tp
    form takes its peers' partials)."""
    names = set()
    for knobs in ({},) + tuple(op.knob_sweep or ()):
        case = Case(op.name, 0, 2, op.configs[0], op.dtypes[0], op.dists[0], extra=tuple(sorted(knobs.items())))
        names |= set(op.make_inputs(case).tensors)
    return names


@pytest.mark.parametrize("name", OPS)
def test_inputs_rebuilt_bit_for_bit(name):
    op = get_op(name)
    case = Case(name, 1234, min(3, op.max_batch), op.configs[0], op.dtypes[0], op.dists[-1])
    a, b = op.make_inputs(case), op.make_inputs(Case.from_json(case.to_json()))
    assert a.tensors.keys() == b.tensors.keys() and a.params == b.params
    for k in a.tensors:
        x, y = a.tensors[k], b.tensors[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                           y.view(torch.uint8) if y.is_floating_point() else y), f"{name}: input {k} differs"


@settings(max_examples=50)
@given(st.builds(Case, op=st.sampled_from(OPS), seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 64),
                 config=st.sampled_from(["tiny", "small", "k3"]), dtype=st.sampled_from(["bfloat16", "float16"]),
                 dist=st.text(min_size=1, max_size=8), tp=st.sampled_from([1, 2, 4, 8, 16]),
                 extra=st.lists(st.tuples(st.text(max_size=5), st.integers()), max_size=2).map(tuple)))
def test_case_record_round_trips(case):
    assert Case.from_json(case.to_json()) == case


def test_unknown_op_names_near_matches():
    with pytest.raises(UnknownOpError, match="did you mean skinny_gemm"):
        get_op("skiny_gemm")


def test_import_callable_errors_are_one_line():
    for bad, msg in [("nope", "not of the form"), ("no_such_mod_xyz:f", "cannot import module"),
                     ("verify.ops.registry:nothing", "has no attribute"), ("verify.ops.registry:__doc__", "not callable")]:
        with pytest.raises(ImportError, match=msg) as e:
            import_callable(bad)
        assert "\n" not in str(e.value)


def test_the_op_index_is_the_registry():
    """`list` and `describe` read verify/ops/index.json (no torch import); it must say what the registry
    says. After changing an op entry: python -m verify.ops.index"""
    from verify.ops import index as op_index

    assert op_index.load() == json.loads(json.dumps(op_index.build())), \
        "verify/ops/index.json is stale: regenerate it with `python -m verify.ops.index`"
