"""The stock layer (stock/layers.py): certified against the reference like any candidate, its step free
of host synchronisation, a planted bug in it rejected; on a GPU its step captured in a CUDA graph
replays to the eager bits, and its launches per step are counted (verify/bench/launches.py)."""
from __future__ import annotations

import pytest
import torch

import stock.layers as stock
from references.layers import kda_layer_steps as ref_kda_layer_steps
from verify.bench.launches import GRAPH_METHOD, count_launches, summarize_node_types, summarize_profiler_events
from verify.judge.candidates import Candidate
from verify.model.case import Case
from verify.model.profile import Profile
from verify.model.verdict import FAIL, PASS
from verify.ops.layers import make_kda_layer_inputs, make_mla_layer_inputs
from verify.ops.registry import all_ops
from verify.run.runner import RunOptions, certify_op

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TINY = Profile("stock_tiny", 3, ("tiny",), 4, False, False, False, compile_heavy=False, strided_run=False,
               dist_sweep=False, knob_sweep=False, batch_sweep=False)
MAKERS = {"kda_layer": make_kda_layer_inputs, "mla_layer": make_mla_layer_inputs}
STATE = {"kda_layer": ("conv_state", "recurrent_state"), "mla_layer": ("cache", "block_table", "seq_lens")}


def _certify(op_name: str, label: str):
    return certify_op(all_ops()[op_name], Candidate(label), RunOptions(device="cpu", profile=TINY))


@pytest.mark.parametrize("op_name", ["kda_layer", "mla_layer"])
def test_stock_layer_certifies_at_tiny(op_name):
    v = _certify(op_name, f"stock.layers:{op_name}_steps")
    assert v.status == PASS, f"{op_name}: {v.reason}\n  repro: {v.repro}"
    assert v.cases_run - v.cases_vacuous >= 2


# ---------------------------------------------------------------------------------------------- planted bug
def _router_without_bias(layer, x):
    """The planted bug: experts selected by the unbiased scores s (the bias ignored), as an engine that
    loads K3's e_score_correction_bias but never applies it would."""
    s = torch.sigmoid(torch.nn.functional.linear(x.float(), layer.w["w_router_acc"]))
    ids = torch.topk(s, layer.cfg.top_k, dim=-1, sorted=True).indices
    sw = s.gather(1, ids)
    return ids, sw / (sw.sum(-1, keepdim=True) + stock.RENORM_EPS) * layer.cfg.routed_scale


_REAL_ROUTER = stock.router


def kda_layer_steps_router_without_bias(x_steps, blocks, conv_state, recurrent_state, layer_idx: int,
                                        config: str, **weights):
    """stock.layers.kda_layer_steps with the router's bias left out of the selection."""
    stock.router = _router_without_bias
    try:
        return stock.kda_layer_steps(x_steps, blocks, conv_state, recurrent_state, layer_idx, config, **weights)
    finally:
        stock.router = _REAL_ROUTER


def test_stock_layer_with_router_bias_ignored_is_rejected():
    v = _certify("kda_layer", f"{__file__}:kda_layer_steps_router_without_bias")
    assert v.status == FAIL, f"a router that ignores its bias was certified: {v.reason}"
    assert "compare:router_ids" in v.reason, v.reason


# ---------------------------------------------------------------------------------------------- no host sync
def _layer_and_state(op_name: str, config: str, batch: int, device, seed: int = 3):
    """A prepared stock layer and its state from the registry's inputs for one case, on `device`."""
    inputs = MAKERS[op_name](Case(op=op_name, seed=seed, batch=batch, config=config))
    t = {k: v.to(device) for k, v in inputs.tensors.items()}
    state = {n: t.pop(n) for n in STATE[op_name]}
    x_steps, blocks = t.pop("x_steps"), t.pop("blocks")
    layer = stock.prepare(op_name.removesuffix("_layer"), t, inputs.params["config"], inputs.params["layer_idx"],
                          x_steps.dtype)
    return layer, x_steps, blocks, state


@pytest.mark.parametrize("op_name", ["kda_layer", "mla_layer"])
def test_step_runs_on_the_meta_device(op_name):
    """A meta tensor has no values: .item(), int()/bool() of a tensor, nonzero and any Python branch on
    a value raise on it, and a host-built tensor cannot enter its arithmetic. So a step that runs
    through on meta tensors reads no device value on the host: nothing to synchronise on. (A host-built
    index tensor does pass on meta; test_step_has_no_host_sync_on_gpu catches its copy on the GPU.)
    The value checks (validate_state) and the reference's step do read values and must raise here."""
    layer, x_steps, blocks, state = _layer_and_state(op_name, "tiny", 2, "meta")
    out = layer.step(x_steps[0], blocks, *state.values())
    assert out.device.type == "meta" and out.shape == x_steps[0].shape
    if op_name == "mla_layer":          # the page-room check reads seq_lens and block_table
        with pytest.raises((RuntimeError, NotImplementedError)):
            stock.validate_state(layer, x_steps[0], blocks, state, 1)


def test_reference_layer_fails_on_the_meta_device():
    """The control for the meta-device check: the reference layer reads values on the host."""
    inputs = make_kda_layer_inputs(Case(op="kda_layer", seed=3, batch=2, config="tiny"))
    t = {k: v.to("meta") for k, v in inputs.tensors.items()}
    with pytest.raises((RuntimeError, NotImplementedError)):
        ref_kda_layer_steps(**t, **inputs.params)


# ---------------------------------------------------------------------------------------------- launch counter
def test_summarize_node_types():
    kernels, other = summarize_node_types([0, 0, 2, 5, 1, 0, 10, 11, 99])
    assert kernels == 3
    assert other == {"mem_alloc": 1, "mem_free": 1, "memcpy": 1, "memset": 1, "type_99": 1}


def test_summarize_profiler_events():
    kernels, other = summarize_profiler_events(
        ["void at::native::vectorized_elementwise_kernel<4>", "Memcpy HtoD (Pageable -> Device)", "Memset (Device)",
         "ampere_bf16_s16816gemm", "Memcpy DtoD"])
    assert (kernels, other) == (2, {"memcpy": 2, "memset": 1})


def test_count_launches_needs_a_device_or_a_warmup():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="warmup"):
            count_launches(lambda: None, warmup=0)
    else:
        with pytest.raises(RuntimeError, match="CUDA device"):
            count_launches(lambda: None)


@needs_gpu
@pytest.mark.gpu
def test_count_launches_of_three_elementwise_kernels():
    x = torch.randn(1 << 16, device="cuda")
    got = count_launches(lambda: torch.exp(x * 2 + 1))
    assert (got.kernels, got.method) == (3, GRAPH_METHOD), got


@needs_gpu
@pytest.mark.gpu
def test_count_launches_falls_back_to_the_profiler_on_a_host_sync():
    x = torch.randn(1 << 16, device="cuda")
    got = count_launches(lambda: (x * 2).sum().item())
    assert got.method != GRAPH_METHOD and got.kernels == 2 and got.note, got


# ---------------------------------------------------------------------------------------------- GPU
@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op_name", ["kda_layer", "mla_layer"])
def test_step_has_no_host_sync_on_gpu(op_name):
    layer, x_steps, blocks, state = _layer_and_state(op_name, "small", 4, "cuda")
    layer.step(x_steps[0], blocks.clone(), *(s.clone() for s in state.values()))      # lazy init, autotune
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.step(x_steps[1], blocks, *state.values())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op_name", ["kda_layer", "mla_layer"])
def test_step_in_a_cuda_graph_replays_to_the_eager_bits(op_name):
    from property_tests.gpu_timing import assert_graph_replays_eager

    layer, x_steps, blocks, state = _layer_and_state(op_name, "small", 4, "cuda")
    stock.validate_state(layer, x_steps[0], blocks, state, x_steps.shape[0])
    prefix, _, _ = assert_graph_replays_eager(layer, x_steps, blocks, state)

    c_blocks, c_state = blocks.clone(), {n: s.clone() for n, s in state.items()}   # room for 2 warm-up steps
    count = count_launches(lambda: layer.step(prefix, c_blocks, *c_state.values()), warmup=2)
    print(f"\n{op_name} stock step, small B=4, fla={layer.use_fla}: {count.to_json()}")
    assert count.method == GRAPH_METHOD and count.kernels > 0, count


# ---------------------------------------------------------------------------------------------- device weights
def test_device_quantizer_matches_the_reference_quantizer():
    from references.mxfp4 import quantize_mxfp4_ocp
    from stock.weights import quantize_mxfp4_ocp_on

    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 128, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (24, 1), generator=g))
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])     # E2M1 midpoints: ties to even
    w[2, 8] = 6.0
    w[3, 3] = float("nan")
    for got, want in zip(quantize_mxfp4_ocp_on(w), quantize_mxfp4_ocp(w)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["kda", "mla", "dense"])
def test_device_weights_have_the_reference_names_shapes_and_dtypes(kind):
    from references.config import TINY as TINY_CFG
    from references.weights import make_layer_weights
    from stock.weights import make_layer_weights_on

    want = make_layer_weights(kind, TINY_CFG, 1).tensors
    got = make_layer_weights_on(kind, TINY_CFG, 1, device="cpu").tensors
    assert sorted(got) == sorted(want)
    for n in want:
        assert (got[n].shape, got[n].dtype) == (want[n].shape, want[n].dtype), n
    again = make_layer_weights_on(kind, TINY_CFG, 1, device="cpu").tensors
    assert all(torch.equal(again[n], got[n]) for n in got)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_k3_stock_step_graph_and_launches(kind):
    """K3 shapes on the device: weights from stock.weights, the step captured and replayed, its launches
    per step counted for B = 1, 8, 64 (printed for the layer table)."""
    import time

    from references.config import K3
    from references.layers import DEFAULT_LAYER, new_layer_state
    from stock.weights import make_layer_weights_on

    t0 = time.perf_counter()
    w = make_layer_weights_on(kind, K3, 0, device="cuda")
    torch.cuda.synchronize()
    print(f"\nK3 {kind} weights on the device in {time.perf_counter() - t0:.1f} s")
    layer = stock.prepare(kind, w.tensors, K3, DEFAULT_LAYER[kind], torch.bfloat16)
    for B in (1, 8, 64):
        st = new_layer_state(kind, K3, B, max_tokens=256)
        state = {n: getattr(st, n).cuda() for n in STATE[f"{kind}_layer"]}
        blocks = torch.randn(B, 8, K3.hidden, device="cuda").to(torch.bfloat16)
        prefix = torch.randn(B, K3.hidden, device="cuda").to(torch.bfloat16)
        stock.validate_state(layer, prefix, blocks, state, 3)
        count = count_launches(lambda: layer.step(prefix, blocks, *state.values()), warmup=2)
        print(f"K3 {kind} stock step B={B} fla={layer.use_fla} flashmla={layer.use_flashmla}: {count.to_json()}")
        assert count.method == GRAPH_METHOD and count.kernels > 0, count


@pytest.mark.parametrize("op_name", ["kda_layer", "mla_layer"])
def test_one_step_launch_is_the_first_registry_step(op_name):
    """The peer-shaped launch (bench) computes step 1 of the certified registry form, and repeats it."""
    inputs = MAKERS[op_name](Case(op=op_name, seed=4, batch=2, config="tiny"))
    fresh = {k: v.clone() for k, v in inputs.tensors.items()}
    launch = getattr(stock, f"{op_name}_step_peer")(inputs.tensors, dict(inputs.params))
    first = launch()
    assert torch.equal(first, getattr(stock, f"{op_name}_steps")(**fresh, **inputs.params)[0][0])
    if op_name == "mla_layer":          # seq_lens put back: the same slot, the same result
        assert torch.equal(launch(), first)


@needs_gpu
@pytest.mark.gpu
def test_step_launch_graph_is_counted_without_a_second_capture():
    inputs = make_kda_layer_inputs(Case(op="kda_layer", seed=4, batch=4, config="small"))
    tensors = {k: v.cuda() for k, v in inputs.tensors.items()}
    launch = stock.step_launch("kda", tensors, dict(inputs.params), graph=True)
    kept = count_launches(launch)
    layer, x_steps, blocks, state = _layer_and_state("kda_layer", "small", 4, "cuda", seed=4)
    captured = count_launches(lambda: layer.step(x_steps[0], blocks, *state.values()))
    assert kept.method == captured.method == GRAPH_METHOD
    assert kept.kernels == captured.kernels, (kept, captured)


def test_mla_steps_past_the_block_table_are_refused_before_any_write():
    inputs = make_mla_layer_inputs(Case(op="mla_layer", seed=2, batch=2, config="tiny"))
    t = dict(inputs.tensors)
    t["block_table"] = t["block_table"].clone()
    t["block_table"][1] = -1                            # sequence 1 owns no page
    cache = t["cache"].clone()
    with pytest.raises(ValueError, match=r"state.block_table: sequence 1 .*page -1"):
        stock.mla_layer_steps(**t, **inputs.params)
    assert torch.equal(t["cache"], cache)


def test_flashmla_is_not_taken_off_its_device_or_shapes():
    from references.config import get_config

    assert not stock.flashmla_available("cpu", get_config("k3"), torch.bfloat16)
    assert not stock.flashmla_available("cuda", get_config("small"), torch.bfloat16)    # kv_lora 64, page 16
    assert not stock.flashmla_available("cuda", get_config("k3"), torch.float32)


@needs_gpu
@pytest.mark.gpu
def test_k3_stock_mla_step_through_flashmla_matches_its_torch_attention():
    """Where FlashMLA runs, the stock MLA step decodes through it: three steps of B = 8 over ragged lengths,
    each on the same hidden rows (a chained output would carry the first step's rounding into the next
    cache write), give the torch attention's cache and lengths bit for bit and its outputs within bf16
    rounding (the two attentions round P and sum in other orders)."""
    from references.config import K3
    from references.layers import DEFAULT_LAYER, new_layer_state
    from stock.weights import make_layer_weights_on

    if not stock.flashmla_available("cuda", K3, torch.bfloat16):
        pytest.skip("FlashMLA's library is not built or the device is not sm_90")
    w = make_layer_weights_on("mla", K3, 0, device="cuda").tensors
    layers = [stock.prepare("mla", w, K3, DEFAULT_LAYER["mla"], torch.bfloat16, use_flashmla=f) for f in (True, False)]
    assert layers[0].use_flashmla and not layers[1].use_flashmla
    st = new_layer_state("mla", K3, 8, max_tokens=512)
    base = {n: getattr(st, n).cuda() for n in STATE["mla_layer"]}
    base["seq_lens"].copy_(torch.tensor([0, 1, 63, 64, 65, 200, 300, 7], dtype=base["seq_lens"].dtype))
    base["cache"].copy_(torch.randn(base["cache"].shape, device="cuda").mul_(0.5))
    blocks = torch.randn(8, 8, K3.hidden, device="cuda").to(torch.bfloat16)
    prefix = torch.randn(8, K3.hidden, device="cuda").to(torch.bfloat16)
    outs, states = [], []
    for layer in layers:
        state = {n: t.clone() for n, t in base.items()}
        stock.validate_state(layer, prefix, blocks, state, 3)
        for _ in range(3):
            p = layer.step(prefix, blocks.clone(), *state.values())
        outs.append(p.float())
        states.append(state)
    assert torch.equal(states[0]["seq_lens"], states[1]["seq_lens"])
    assert torch.equal(states[0]["cache"], states[1]["cache"])
    rel = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
    assert rel < 2e-2, rel
