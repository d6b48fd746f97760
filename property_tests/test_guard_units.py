"""Each later guard alone, on the case context: the reference passes it, the planted bug of its class
fails it, and its verdict is the same in a fresh context as after other work in the process."""
from __future__ import annotations

import pytest

from verify.judge.context import CaseContext
from verify.judge.guards import (LATER_GUARDS, batch_position, determinism, gpu, inference_mode, outputs, refresh,
                                 serving, serving_calls, views)
from verify.model.case import Case
from verify.ops.registry import get_op, import_callable

P = "property_tests.planted"

# guard unit -> (op, planted candidate of the class it guards against, case)
UNITS = {
    "determinism.second_run": (determinism.second_run, "mla_decode_attn", f"{P}.mla:mla_decode_attn_last_bit_race",
                               Case("mla_decode_attn", 5, 3, "tiny", "bfloat16", "normal")),
    "batch_position.check": (batch_position.check, "mla_out_gate", f"{P}.mla:mla_out_gate_row_parity_path",
                             Case("mla_out_gate", 5, 4, "tiny", "bfloat16", "normal")),
    "refresh.refreshed_inputs": (refresh.refreshed_inputs, "skinny_gemm", f"{P}.gemm:skinny_gemm_stale_weight_cache",
                                 Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
    "serving.partial_refresh": (serving.partial_refresh, "mxfp4_dequant", f"{P}.serving:mxfp4_dequant_fingerprint_memo",
                                Case("mxfp4_dequant", 5, 4, "tiny", "bfloat16", "normal")),
    "serving.state_chain": (serving.state_chain, "attn_res_rmsnorm", f"{P}.serving:attn_res_rmsnorm_stale_prefix_shadow",
                            Case("attn_res_rmsnorm", 5, 3, "tiny", "bfloat16", "normal")),
    "refresh.warmed_up": (refresh.warmed_up, "skinny_gemm", f"{P}.process:skinny_gemm_graph_after_warmup",
                          Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
    "views.strided_inputs": (views.strided_inputs, "skinny_gemm", f"{P}.gemm:skinny_gemm_assumes_contiguous",
                             Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
    "views.misaligned_inputs": (views.misaligned_inputs, "skinny_gemm", f"{P}.gemm:skinny_gemm_rounds_x_base_down",
                                Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
    "serving.call_forms": (serving.call_forms, "skinny_gemm", f"{P}.serving:skinny_gemm_owned_x_fast_path",
                           Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
    "serving_calls.grown_inputs": (serving_calls.grown_inputs, "mla_decode_attn",
                                   f"{P}.serving:mla_decode_attn_plan_per_seq_lens",
                                   Case("mla_decode_attn", 5, 3, "tiny", "bfloat16", "normal")),
    "serving_calls.host_threads": (serving_calls.host_threads, "skinny_gemm",
                                   "property_tests.test_guard_units:gemm_wrong_while_another_call_runs",
                                   Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
    "inference_mode.check": (inference_mode.check, "skinny_gemm", f"{P}.gemm:skinny_gemm_serving_path_drops_k_tail",
                             Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal")),
}


_IN_FLIGHT = [0]


def gemm_wrong_while_another_call_runs(x, w):
    """Right alone; wrong whenever another call is in flight (one workspace for every caller), and
    each call lasts long enough (2 ms) for two host threads started together to overlap."""
    import time

    from references.gemm import skinny_gemm

    _IN_FLIGHT[0] += 1
    try:
        time.sleep(0.002)
        y = skinny_gemm(x, w)
        return y * 2 if _IN_FLIGHT[0] > 1 else y
    finally:
        _IN_FLIGHT[0] -= 1


def _ctx(op_name: str, case: Case, candidate: str) -> CaseContext:
    op = get_op(op_name)
    fn = import_callable(candidate if ":" in candidate else op.reference)
    ctx = CaseContext.first_launch(op, case, fn, candidate, "cpu", strict=candidate != "reference", strided_run=True,
                                   warmup=True)
    assert not ctx.first_call.error and all(c.ok for c in ctx.first_call.checks), ctx.first_call
    return ctx


def test_every_later_guard_has_a_unit_test():
    named = {f"{g.__module__.rsplit('.', 1)[-1]}.{g.__name__}" for g in LATER_GUARDS}
    assert named - {"gpu.check", "outputs.outputs_kept_so_far"} == set(UNITS)


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_the_reference_passes_the_guard(unit):
    guard, op_name, _, case = UNITS[unit]
    checks = guard(_ctx(op_name, case, "reference"))
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_the_planted_bug_of_its_class_fails_the_guard_alone(unit):
    guard, op_name, planted, case = UNITS[unit]
    first = [c for c in guard(_ctx(op_name, case, planted)) if not c.ok]
    assert first, f"{planted} passed {unit}"
    again = [c for c in guard(_ctx(op_name, case, planted)) if not c.ok]   # a fresh context, later in the process
    assert [(c.name, c.ok) for c in again] == [(c.name, c.ok) for c in first]


def test_outputs_kept_names_a_ring_of_output_buffers():
    ctx = _ctx("attn_res_rmsnorm", Case("attn_res_rmsnorm", 5, 3, "tiny", "bfloat16", "normal"),
               f"{P}.attn_res:attn_res_rmsnorm_output_ring")
    assert outputs.outputs_kept_so_far(ctx) == []
    for _ in range(3):            # six later calls, half of them on other values: a ring of three wraps
        refresh.refreshed_inputs(ctx)
    held = outputs.outputs_kept_so_far(ctx)
    assert held and not held[0].ok and "changed during" in held[0].detail


def test_gpu_guards_do_not_apply_on_a_cpu():
    ctx = _ctx("skinny_gemm", Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal"), "reference")
    assert gpu.check(ctx) == []


def test_warmed_up_runs_only_on_the_cases_the_plan_marks():
    ctx = _ctx("skinny_gemm", Case("skinny_gemm", 5, 3, "tiny", "bfloat16", "normal"),
               f"{P}.process:skinny_gemm_graph_after_warmup")
    ctx.warmup = False
    assert refresh.warmed_up(ctx) == []
