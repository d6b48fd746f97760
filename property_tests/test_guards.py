"""Guard self-tests on a toy op: each guard rejects its class of bug with the right reason,
and a correct candidate passes every guard."""
from __future__ import annotations

import pytest
import torch

from references.primitives import linear
from verify.case import Case
from verify.evaluate import evaluate_case
from verify.opdef import OpDef, OpInputs
from verify.specs import parse_spec
from verify.values import draw, generator


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
    (nondeterministic, "guard:deterministic", "differ bitwise"),
    (swapped_rows, "compare:y", "rows exceed"),
    (wrong_dtype, "guard:output_type", "dtype"),
    (subclass, "guard:output_type", "exactly torch.Tensor"),
    (bf16_accumulate, "compare:y", "rows exceed"),
    (position_dependent, "compare:y", "rows exceed"),
    (strided_wrong, "guard:strided_inputs", "differ bitwise"),
    (writes_past_input, "guard:canaries", "writes outside the tensors: x"),
    (out_partial, "guard:outputs_written", "unwritten"),
    (raises, "candidate", "RuntimeError: kernel launch failed"),
    (wrong_shape, "guard:output_type", "shape"),
])
def test_guard_rejects(fn, stage, needle):
    from verify.process_state import process_state

    before = process_state("cpu")
    v = evaluate_case(TOY, CASE, fn, fn.__name__, spec=SPEC)
    assert v.status == "fail", v
    assert v.stage == stage, (v.stage, v.reason)
    assert needle in v.reason, v.reason
    assert process_state("cpu") == before, "a candidate's change of process-wide settings outlived its call"


@pytest.mark.parametrize("fn,stage", [(strided_last_bit, "guard:strided_inputs"),
                                      (position_dependent, "compare:y")])
def test_kernels_are_held_to_bitwise_claims(fn, stage):
    """Kernels promise identical bits for strided views and other batch positions; a last-bit change
    there fails them, while the CPU-BLAS stand-ins (reference, compiled) get the tolerance there."""
    v = evaluate_case(TOY, CASE, fn, "fused", spec=SPEC)
    assert v.status == "fail" and v.stage == stage, (v.stage, v.reason)
    if fn is strided_last_bit:
        assert evaluate_case(TOY, CASE, fn, "user.module:fn", spec=SPEC).status == "fail"
        assert evaluate_case(TOY, CASE, fn, "compiled", spec=SPEC).status == "pass"


@pytest.mark.parametrize("seed", range(20))
def test_correct_candidate_passes_every_guard(seed):
    v = evaluate_case(TOY, Case("toy_linear", seed, 1 + seed % 7), good, "good", spec=SPEC)
    assert v.status == "pass", v.reason
    names = {c.name for c in v.checks}
    assert {"guard:output_type", "guard:no_aliasing", "guard:inputs_unchanged", "guard:canaries",
            "guard:outputs_written", "guard:deterministic", "guard:strided_inputs", "guard:process_state",
            "compare:y"} <= names


def test_refreshed_inputs_keep_shapes_and_params_and_change_values():
    """Every registered op gets other values with this case's shapes: another seed's, or (ops whose
    shapes follow the seed, like the paged MLA ones) its own float inputs rescaled, indices kept."""
    from verify.evaluate import refreshed_inputs
    from verify.registry import all_ops

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
    from verify.registry import get_op

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
