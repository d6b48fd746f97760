"""kda_cache_step, the input-cache rollback design's verify + accept as a registry op
(references.kda_spec_cache.kda_cache_step, verify.ops.kda_spec, fused.kda_verify_cache.kda_cache_step).
CPU: the op is the design stepped (KdaInputCache's verify then accept, bit for bit); its cases reach
write-backs, windows 1 and 25 and untouched stale slots; bad arguments are one-line errors; the split
by heads loses nothing; the fused op's own code (working copies, argument order, the fill copy) gives
the reference's bits with the kernel emulated (property_tests.kda_cache_emulation). GPU (`gpu`-marked,
skipped here, never counted as passed): the fused op certified at tiny and small, every variant, and
its bits are the fused design's (KdaInputCacheFused) stepped the same way."""
from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before any cutlass import

import pytest
import torch

from references.kda_spec_cache import KdaInputCache, cache_views, kda_cache_step
from verify.model.case import Case
from verify.ops.registry import get_op

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = "kda_cache_step"
TOKEN = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
LAYER = ("conv_w", "A_log", "dt_bias", "o_norm_w")
STATE = ("cache", "fill", "base_conv", "base_state")


def _inputs(seed=3, batch=4, config="tiny", dtype="bfloat16", **knobs):
    return get_op(OP).make_inputs(Case(OP, seed, batch, config, dtype, "normal", 1, tuple(sorted(knobs.items()))))


def _copy(inputs):
    return {k: v.clone() for k, v in inputs.tensors.items()}


def _through_the_design(t: dict, params: dict):
    """The step by hand: KdaInputCache loaded with the case's base, fill and cache, verify, accept."""
    C = t["q_raw"].shape[-1]
    d = KdaInputCache(params["window"])
    d.begin(conv_state=t["base_conv"], state=t["base_state"], **{k: t[k] for k in LAYER},
            lower_bound=params["lower_bound"], l2_eps=params["l2_eps"], norm_eps=params["norm_eps"],
            n_q=t["q_raw"].shape[1])
    d.fill = t["fill"].long()
    d.cache = {n: v.clone() for n, v in cache_views(t["cache"], C).items()}
    y = d.verify(**{k: t[k] for k in TOKEN}, n_tokens=t["n_tokens"])
    d.accept(t["accepted"])
    return y, d


@pytest.mark.parametrize("seed,knobs", [(3, {}), (4, {"window": 1, "draft": 8}), (5, {"window": 25, "draft": 8}),
                                        (6, {"window": 6, "draft": 6}), (7, {"window": 3, "draft": 2})])
def test_the_op_is_the_design_stepped_bit_for_bit(seed, knobs):
    inputs = _inputs(seed, batch=5, **knobs)
    t = _copy(inputs)
    y = kda_cache_step(**t, **inputs.params)
    y_d, d = _through_the_design(_copy(inputs), inputs.params)
    assert torch.equal(y, y_d)
    assert torch.equal(t["fill"].long(), d.fill)
    assert torch.equal(t["base_conv"], d.base_conv) and torch.equal(t["base_state"], d.base_state)
    for name, v in cache_views(t["cache"], t["q_raw"].shape[-1]).items():
        assert torch.equal(v, d.cache[name]), name


def test_cases_reach_writebacks_edges_and_stale_slots():
    """Sequence 0 writes back (fill window - 1, its whole draft accepted), sequence 1 keeps an empty
    cache; windows 1 and 25 are the knob sweep's; slots the step does not store keep their tokens."""
    op = get_op(OP)
    assert {"window": 1, "draft": 8} in op.knob_sweep and {"window": 25, "draft": 8} in op.knob_sweep
    for seed in range(6):
        inputs = _inputs(seed, batch=4)
        t, p = _copy(inputs), inputs.params
        fill0, window = t["fill"].clone(), p["window"]
        assert int(fill0[0]) == window - 1 and int(t["accepted"][0]) == int(t["n_tokens"][0]) and int(fill0[1]) == 0
        before = t["cache"].clone()
        kda_cache_step(**t, **p)
        assert int(t["fill"][0]) == 0 and not torch.equal(t["base_state"][0], inputs.tensors["base_state"][0])
        assert int(t["fill"][1]) == int(t["accepted"][1])
        S = t["cache"].shape[1]
        for b in range(4):
            stored = torch.zeros(S, dtype=torch.bool)
            stored[int(fill0[b]):int(fill0[b]) + int(t["n_tokens"][b])] = True
            assert torch.equal(t["cache"][b, ~stored], before[b, ~stored]), b
            assert not torch.equal(t["cache"][b, stored], before[b, stored]), b
    inputs = _inputs(1, batch=2, window=25, draft=8)
    assert inputs.tensors["cache"].shape[1] == 32
    with pytest.raises(ValueError, match="window=26.*<= 32"):
        _inputs(1, batch=2, window=26, draft=8)


@pytest.mark.parametrize("change,match", [
    (lambda t: t["fill"].fill_(99), r"fill: sequence 0 holds 99 cached tokens; expected 0\.\."),
    (lambda t: t["accepted"].copy_(t["n_tokens"] + 1), r"accepted: sequence 0 accepts"),
    (lambda t: t.__setitem__("cache", t["cache"][:, 1:]), r"cache"),
    (lambda t: t.__setitem__("fill", t["fill"].long()), r"fill"),
])
def test_bad_arguments_are_one_line_errors(change, match):
    inputs = _inputs(2, batch=3)
    t = _copy(inputs)
    change(t)
    with pytest.raises((ValueError, TypeError), match=match) as e:
        kda_cache_step(**t, **inputs.params)
    assert "\n" not in str(e.value)


def test_the_split_by_heads_loses_nothing():
    """Rank shards of the inputs combined back (as results) give the unsplit tensors; ranks that
    disagree on fill combine to -1."""
    op = get_op(OP)
    inputs = _inputs(8, batch=3)
    for T in (2, 4):
        shards = op.split.shard(inputs, T)
        as_results = [{**{n: s.tensors[n] for n in STATE}, "y": s.tensors["q_raw"]} for s in shards]
        out = op.split.combine(as_results, inputs)
        for n in STATE:
            assert torch.equal(out[n], inputs.tensors[n]), (T, n)
        assert torch.equal(out["y"], inputs.tensors["q_raw"])
        as_results[1]["fill"] = as_results[1]["fill"] + 1
        assert bool((op.split.combine(as_results, inputs)["fill"] == -1).all())


def test_the_fused_op_gives_the_reference_bits_with_the_kernel_emulated(monkeypatch):
    """fused.kda_verify_cache.kda_cache_step's own code on the CPU (the kernel replaced by its torch
    model): strided and misaligned state buffers go through working copies and come back."""
    import fused.kda_verify_cache as F
    from fused import runtime
    from property_tests.kda_cache_emulation import Kernel

    monkeypatch.setattr(F, "_kernel", Kernel)
    monkeypatch.setattr(runtime, "require_cuda", lambda name, t: None)
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    for seed, knobs in ((3, {}), (4, {"window": 1, "draft": 8}), (6, {"window": 6, "draft": 6})):
        inputs = _inputs(seed, batch=5, **knobs)
        ref, fus = _copy(inputs), _copy(inputs)
        y_ref = kda_cache_step(**ref, **inputs.params)
        fus["base_state"] = torch.empty_like(fus["base_state"]).transpose(-1, -2).copy_(fus["base_state"])
        y = F.kda_cache_step(**fus, **inputs.params)
        assert not fus["base_state"].is_contiguous()
        assert torch.equal(y, y_ref)
        for n in STATE:
            assert torch.equal(fus[n], ref[n]), (seed, n)


def test_the_fused_op_rejects_what_its_kernel_cannot_take():
    import fused.kda_verify_cache as F
    inputs = _inputs(2, batch=2)
    with pytest.raises(ValueError, match="CUDA tensor"):
        F.kda_cache_step(**_copy(inputs), **inputs.params)
    big = _inputs(2, batch=2, window=25, draft=8)
    t = _copy(big)
    t["cache"] = torch.cat([t["cache"], t["cache"][:, :1]], 1)
    with pytest.raises(ValueError, match="cache slots"):
        F.kda_cache_step(**t, **{**big.params, "window": 26})


# ------------------------------------------------------------------------------------------ GPU

@needs_cuda
@pytest.mark.gpu
def test_the_fused_op_certifies_on_gpu():
    from verify.judge.candidates import Candidate
    from verify.model.profile import Profile
    from verify.model.verdict import PASS
    from verify.run.runner import RunOptions, certify_op

    profile = Profile("kda_cache_step_gpu", 8, ("tiny", "small"), 8, True, False, True)
    v = certify_op(get_op(OP), Candidate("fused"), RunOptions(device="cuda", profile=profile))
    print(f"\nkda_cache_step fused: {v.status} {v.cases_run} cases, worst {v.worst_ratio}")
    assert v.status == PASS, f"{v.reason}\n  repro: {v.repro}"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("config,knobs", [("small", {}), ("small", {"window": 1, "draft": 8}),
                                          ("k3", {"window": 6, "draft": 6})])
def test_the_fused_op_is_the_fused_design_stepped_on_gpu(config, knobs):
    """The op's two launches on the caller's buffers give what KdaInputCacheFused gives stepped from the
    same base, fill and cache: y, fill, the base and the cache, bit for bit."""
    import fused.kda_verify_cache as F

    inputs = _inputs(11, batch=4, config=config, **knobs)
    t = {k: v.cuda() for k, v in _copy(inputs).items()}
    p = inputs.params
    d = F.KdaInputCacheFused(p["window"])
    d.begin(conv_state=t["base_conv"], state=t["base_state"], **{k: t[k] for k in LAYER},
            lower_bound=p["lower_bound"], l2_eps=p["l2_eps"], norm_eps=p["norm_eps"], n_q=t["q_raw"].shape[1])
    d.cache_buf.copy_(t["cache"])
    d.fill.copy_(t["fill"])
    y_d = d.verify(**{k: t[k] for k in TOKEN}, n_tokens=t["n_tokens"])
    d.accept(t["accepted"])
    y = F.kda_cache_step(**t, **p)
    torch.cuda.synchronize()
    assert torch.equal(y, y_d)
    assert torch.equal(t["fill"], d.fill) and torch.equal(t["cache"], d.cache_buf)
    assert torch.equal(t["base_conv"], d.base_conv) and torch.equal(t["base_state"], d.base_state)
