"""Guard self-tests on a toy op: each guard rejects its class of bug with the right reason,
and a correct candidate passes every guard."""
from __future__ import annotations

import pytest
import torch

from references.primitives import linear
from verify.model.case import Case
from verify.judge.pipeline import evaluate_case
from verify.model.opdef import OpDef, OpInputs
from verify.model.specs import parse_spec
from verify.model.values import draw, generator


def _inputs(case):
    g = generator(case.seed)
    dt = getattr(torch, case.dtype)
    return OpInputs({"x": draw(g, (case.batch, 40), case.dist, dtype=dt),
                     "w": draw(g, (24, 40), "normal", scale=40 ** -0.5, dtype=dt)})


TOY = OpDef("toy_linear", "primitives", "references.primitives:linear", _inputs, ("y",), "x[M,K] w[N,K] -> y[M,N]",
            batch_dims={"x": 0, "y": 0})
SPEC = parse_spec('op = "toy_linear"\nderivation = "fp32 accumulation over K=40 then one bf16 rounding: '
                  'another order stays within 1 ulp of the baseline"\n'
                  '[outputs.y]\nclass = "derived"\nk = 2.0\nfloor_ulps = 1.0\n', "toy")
CASE = Case("toy_linear", 7, 9)


def good(x, w):
    return linear(x, w)


def unwritten_tail(x, w):
    y = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)
    y[:-1] = linear(x[:-1], w)
    return y


def mutates_input(x, w):
    y = linear(x, w)
    x[0, 0] = 0.0
    return y


def aliases_input(x, w):
    return x[:, :24]


_calls = [0]


def nondeterministic(x, w):
    """Last bit depends on call parity, as an atomics-ordered reduction's might."""
    y = linear(x, w)
    _calls[0] += 1
    y.view(torch.int16)[0, 0] ^= _calls[0] % 2
    return y


def swapped_rows(x, w):
    return linear(x, w).flip(0) if x.shape[0] > 1 else linear(x, w)


def wrong_dtype(x, w):
    return linear(x, w).to(torch.float16)


class Sub(torch.Tensor):
    pass


def subclass(x, w):
    return linear(x, w).as_subclass(Sub)


def bf16_accumulate(x, w):
    acc = x[:, :1] * w[:, 0][None]
    for i in range(1, x.shape[1]):
        acc = acc + x[:, i:i + 1] * w[:, i][None]
    return acc


def position_dependent(x, w):
    y = linear(x, w)
    if x.shape[0] > 1:
        y[-1] = y[-1] * (1 + 2 ** -6)              # the last slot goes through a sloppy tail path
    return y


def writes_past_input(x, w):
    y = linear(x, w)
    x.as_strided((x.numel() + 1,), (1,), x.storage_offset())[-1] = 0.0   # one element past the end
    return y


def out_partial(x, w, out=None):
    out[:-1] = linear(x[:-1], w)                   # destination-passing, forgets the last row
    return out


def strided_wrong(x, w):
    if not x.is_contiguous():
        return linear(x.contiguous(), w) * 1.25
    return linear(x, w)


def strided_last_bit(x, w):
    y = linear(x, w)
    if not x.is_contiguous():
        y.view(torch.int16)[0, 0] ^= 1
    return y


def rounds_base_down(x, w):
    """Loads x from its address rounded down to 16 bytes (a TMA / vector-load base assumed aligned)."""
    back = (x.data_ptr() % 16) // x.element_size()
    return linear(x.as_strided(x.shape, x.stride(), x.storage_offset() - back), w)


def refuses_misaligned(x, w):
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    return linear(x, w)


def misaligned_unrelated_error(x, w):
    if x.data_ptr() % 16:
        raise RuntimeError("no kernel for this shape")
    return linear(x, w)


def misaligned_faults(x, w):
    if x.data_ptr() % 16:     # what torch reports for a kernel that faulted on the address
        raise RuntimeError("CUDA error: misaligned address")
    return linear(x, w)


def stomps_then_refuses(x, w):
    """Writes past x's end, then refuses the misaligned view: the write is found, no refusal counts."""
    if x.data_ptr() % 16:
        x.as_strided((1,), (1,), x.storage_offset() + x.numel()).fill_(7)
        raise ValueError("x must be 16-byte aligned")
    return linear(x, w)


_SHAPE_CALLS = [0]


def second_call_wrong_shape(x, w):
    """Right on its first call of a case, a short output on the next: the second run's own output-type
    failure, not a harness error from comparing a missing column."""
    _SHAPE_CALLS[0] += 1
    y = linear(x, w)
    return y if _SHAPE_CALLS[0] % 2 else y[:, :-1]


def out_base_rounded_down(x, w, out=None):
    """Stores y at out's address rounded down to 16 bytes (a vector store assuming an aligned out=)."""
    y = linear(x, w)
    if out is None:
        return y
    back = (out.data_ptr() % 16) // out.element_size()
    out.as_strided(out.shape, out.stride(), out.storage_offset() - back).copy_(y)
    return out


def refuses_misaligned_out(x, w, out=None):
    if out is not None and out.data_ptr() % 16:
        raise ValueError("out must be 16-byte aligned")
    y = linear(x, w)
    return y if out is None else out.copy_(y)


def raises(x, w):
    raise RuntimeError("kernel launch failed")


def wrong_shape(x, w):
    return linear(x, w)[:, :-1]


def sets_default_dtype(x, w):
    torch.set_default_dtype(torch.float64)
    return linear(x, w)


def another_thread_count(x, w):
    torch.set_num_threads(torch.get_num_threads() + 1)
    return linear(x, w)


def no_grad_left_on(x, w):
    torch.set_grad_enabled(False)
    return linear(x, w)


def flushes_then_raises(x, w):
    torch.set_flush_denormal(True)
    raise RuntimeError("kernel launch failed after setting FTZ")


@pytest.mark.parametrize("fn,stage,needle", [
    (unwritten_tail, "guard:outputs_written", "unwritten"),
    (sets_default_dtype, "guard:process_state", "torch.get_default_dtype(): torch.float32 -> torch.float64"),
    (another_thread_count, "guard:process_state", "torch.get_num_threads()"),
    (no_grad_left_on, "guard:process_state", "torch.is_grad_enabled(): True -> False"),
    (flushes_then_raises, "candidate", "after setting FTZ"),
    (mutates_input, "guard:inputs_unchanged", "inputs modified in place: x"),
    (aliases_input, "guard:no_aliasing", "aliases input x"),
    (nondeterministic, "invariance:deterministic", "differ bitwise"),     # a last bit: right values
    (swapped_rows, "compare:y", "rows exceed"),
    (wrong_dtype, "guard:output_type", "dtype"),
    (subclass, "guard:output_type", "exactly torch.Tensor"),
    (bf16_accumulate, "compare:y", "rows exceed"),
    (position_dependent, "compare:y", "rows exceed"),
    (strided_wrong, "guard:strided_inputs", "differ bitwise"),
    (rounds_base_down, "guard:misaligned_inputs", "1 element past an aligned base: outputs differ bitwise"),
    (misaligned_unrelated_error, "guard:misaligned_inputs", "raised RuntimeError: no kernel for this shape"),
    (misaligned_faults, "guard:misaligned_inputs", "the kernel faulted"),
    (stomps_then_refuses, "guard:canaries", "1 element past an aligned base: writes outside the tensors: x"),
    (second_call_wrong_shape, "guard:output_type", "second run: "),
    (out_base_rounded_down, "guard:canaries", "out= buffers 1 element past an aligned base: writes outside"),
    (writes_past_input, "guard:canaries", "writes outside the tensors: x"),
    (out_partial, "guard:outputs_written", "unwritten"),
    (raises, "candidate", "RuntimeError: kernel launch failed"),
    (wrong_shape, "guard:output_type", "shape"),
])
def test_guard_rejects(fn, stage, needle):
    from verify.judge.process_state import process_state

    before = process_state("cpu")
    v = evaluate_case(TOY, CASE, fn, fn.__name__, spec=SPEC)
    assert v.status == "fail", v
    assert v.stage == stage, (v.stage, v.reason)
    assert needle in v.reason, v.reason
    assert process_state("cpu") == before, "a candidate's change of process-wide settings outlived its call"


@pytest.mark.parametrize("fn,stage", [(strided_last_bit, "invariance:strided_inputs"),      # right values, other bits
                                      (position_dependent, "compare:y")])
def test_kernels_are_held_to_bitwise_claims(fn, stage):
    """Kernels promise identical bits for strided views and other batch positions; a last-bit change
    there fails them, while the CPU-BLAS stand-ins (reference, compiled) get the tolerance there."""
    v = evaluate_case(TOY, CASE, fn, "fused", spec=SPEC)
    assert v.status == "fail" and v.stage == stage, (v.stage, v.reason)
    if fn is strided_last_bit:
        assert evaluate_case(TOY, CASE, fn, "user.module:fn", spec=SPEC).status == "fail"
        assert evaluate_case(TOY, CASE, fn, "compiled", spec=SPEC).status == "pass"


def test_a_bitwise_guard_names_the_elements_that_differ():
    """A guard comparing two runs bit for bit reports, like a compare failure, how many elements
    differ and which, with both values; the terminal report prints them."""
    import io

    from rich.console import Console

    from verify.record.reporters.terminal import print_case

    v = evaluate_case(TOY, CASE, strided_last_bit, "fused", spec=SPEC)
    check = next(c for c in v.checks if c.name == "guard:strided_inputs")
    assert not check.ok and "y: 1 of 216 elements differ" in check.detail, check.detail
    y = linear(**TOY.make_inputs(CASE).tensors)
    first = float(y[0, 0])
    y.view(torch.int16)[0, 0] ^= 1
    assert check.worst == (((0, 0), float(y[0, 0]), first, None),)
    out = io.StringIO()
    print_case(Console(file=out, width=200), v)
    assert f"((0, 0), {float(y[0, 0])!r}, {first!r})" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("seed", range(20))
def test_correct_candidate_passes_every_guard(seed):
    v = evaluate_case(TOY, Case("toy_linear", seed, 1 + seed % 7), good, "good", spec=SPEC)
    assert v.status == "pass", v.reason
    names = {c.name for c in v.checks}
    assert {"guard:output_type", "guard:no_aliasing", "guard:inputs_unchanged", "guard:canaries",
            "guard:outputs_written", "guard:deterministic", "guard:strided_inputs", "guard:process_state",
            "guard:misaligned_inputs", "compare:y"} <= names


def test_place_offset_misaligns_the_base_and_keeps_the_canaries():
    """offset=1: contiguous, one element past a 16-byte boundary; a write just before it is seen."""
    from verify.judge.placement import place

    for dt in (torch.bfloat16, torch.float32, torch.uint8, torch.int64):
        value = torch.arange(12).reshape(3, 4).to(dt)
        g = place("t", value, "cpu", offset=1)
        assert g.view.is_contiguous() and torch.equal(g.view, value)
        assert g.view.data_ptr() % 16 == g.view.element_size(), dt
        assert place("t", value, "cpu").view.data_ptr() % 16 == 0, dt
        g.buf[g.view.storage_offset() - 1] = 7
        assert g.outside_changed() == 1, dt


def test_a_refusal_of_misaligned_inputs_passes_and_is_recorded():
    v = evaluate_case(TOY, CASE, refuses_misaligned, "user.module:fn", spec=SPEC)
    assert v.status == "pass", v.reason
    check = next(c for c in v.checks if c.name == "guard:misaligned_inputs")
    assert check.ok and check.detail.startswith("the candidate refused misaligned inputs: ValueError: x must be "
                                                "16-byte aligned"), check.detail


def test_a_refusal_of_misaligned_out_buffers_passes_and_is_recorded():
    v = evaluate_case(TOY, CASE, refuses_misaligned_out, "user.module:fn", spec=SPEC)
    assert v.status == "pass", (v.stage, v.reason)
    runs = [c for c in v.checks if c.name == "guard:misaligned_inputs"]
    assert len(runs) == 2 and all(c.ok for c in runs), runs
    assert runs[0].detail.endswith("bitwise identical"), runs[0].detail
    assert runs[1].detail.startswith("the candidate refused misaligned out= buffers: ValueError: out must be"), runs[1].detail


def test_the_quick_profile_skips_the_misaligned_run():
    from verify.model.profile import get_profile

    assert not get_profile("quick").strided_run
    v = evaluate_case(TOY, CASE, rounds_base_down, "fused", spec=SPEC, strided_run=False)
    assert v.status == "pass" and not any(c.name == "guard:misaligned_inputs" for c in v.checks), v.reason


def test_misaligned_state_is_judged_on_a_state_op():
    """mla_cache_write updates its cache in place: at a misaligned cache the reference passes, and a
    candidate that writes through the cache's base rounded down to 16 bytes is rejected (its rows
    land one element early: the cache, judged bitwise, differs from the first run's)."""
    from references.mla import mla_cache_write
    from verify.ops.registry import get_op

    def rounds_cache_down(latent, cache, slot_mapping):
        back = (cache.data_ptr() % 16) // cache.element_size()
        mla_cache_write(latent, cache.as_strided(cache.shape, cache.stride(), cache.storage_offset() - back),
                        slot_mapping)

    op = get_op("mla_cache_write")
    case = Case("mla_cache_write", 3, 4, "tiny", "bfloat16", "normal", 1)
    ok = evaluate_case(op, case, mla_cache_write, "mymod:ref", "cpu")
    assert ok.status == "pass", ok.reason
    assert next(c for c in ok.checks if c.name == "guard:misaligned_inputs").detail.endswith("bitwise identical")
    bad = evaluate_case(op, case, rounds_cache_down, "mymod:rounds", "cpu")
    assert bad.status == "fail", bad.reason
    assert bad.stage == "guard:misaligned_inputs", (bad.stage, bad.reason)
    assert "1 element past an aligned base: outputs differ bitwise" in bad.reason and "cache" in bad.reason


def test_refreshed_inputs_keep_shapes_and_params_and_change_values():
    """Every registered op gets other values with this case's shapes: another seed's, or (ops whose
    shapes follow the seed, like the paged MLA ones) its own float inputs rescaled, indices kept."""
    from verify.judge.context import refreshed_inputs
    from verify.ops.registry import all_ops

    for name, op in all_ops().items():
        case = Case(name, 3, min(5, op.max_batch), op.configs[0], op.dtypes[0], op.dists[0], 1)
        first = op.make_inputs(case)
        found = refreshed_inputs(op, case, first)
        assert found is not None, name
        seed, other = found
        assert other.params == first.params, name
        for k, v in first.tensors.items():
            assert other.tensors[k].shape == v.shape and other.tensors[k].dtype == v.dtype, (name, k)
            if seed is None and not v.is_floating_point():
                assert torch.equal(other.tensors[k], v), (name, k)
        assert any(not torch.equal(other.tensors[k], v) for k, v in first.tensors.items()), name


def test_refreshed_inputs_catch_a_stale_cache_on_a_paged_op():
    """A memo of the output keyed by the cache tensor object, on an op whose shapes follow the seed
    (the rescaled-values path): rejected by the refreshed-inputs guard, and the reference passes it."""
    from references.mla import mla_decode_attn
    from verify.ops.registry import get_op

    memo = {}

    def stale(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank):
        hit = memo.get(id(cache))
        if hit is None or hit[0] is not cache:
            hit = (cache, mla_decode_attn(q_abs, cache, block_table, seq_lens, scale, kv_lora_rank))
            memo[id(cache)] = hit
        return hit[1].clone()

    op = get_op("mla_decode_attn")
    case = Case("mla_decode_attn", 5, 3, "tiny", "bfloat16", "normal", 1)
    v = evaluate_case(op, case, stale, "mymod:stale", "cpu")
    assert v.status == "fail" and v.stage == "guard:refreshed_inputs", (v.stage, v.reason)
    assert "rescaled" in v.reason and "fresh buffers pass" in v.reason
    ok = evaluate_case(op, case, mla_decode_attn, "mymod:ref", "cpu")
    assert ok.status == "pass", ok.reason
