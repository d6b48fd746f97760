"""stock/flashinfer_mla: mla_decode_attn through FlashInfer's Hopper MLA module (fa3), loaded through
tvm_ffi. On the CPU: FlashInfer's causal tile-bound refusal restated and checked against its rule's
cases, the module's limits refused in one line, the CPU or a missing module as ImportError. On an
sm_90a device with the modules built (`@pytest.mark.gpu`): the harness judges the refusing candidate at
k3, and at a shape FlashInfer refuses the native kernel drops the key its wrapper says it drops."""
from __future__ import annotations

import pytest
import torch

from verify.model.case import Case
from verify.ops.registry import get_op

OP = get_op("mla_decode_attn")


def _inputs(config: str, batch: int = 2, extra=()):
    return OP.make_inputs(Case("mla_decode_attn", 0, batch, config, "bfloat16", "normal", extra=extra))


@pytest.mark.parametrize("q_len,kv_len,heads,refused", [
    (2, 65, 96, True),        # 192 rows in 128-row tiles: the first ends in token 1, whose last key 64 starts a tile
    (2, 66, 96, False),
    (1, 65, 96, False),       # 96 rows: one tile
    (6, 65, 12, False),       # 72 rows: one 128-row tile (a T = 8 rank never splits a token)
    (4, 65, 16, False),       # 64 % 16 == 0: tiles end between tokens
    (8, 135, 96, True),       # tiles end in tokens 1, 2, 5, 6: token 1's last key is 128
    (8, 136, 96, False),
])
def test_tile_bound_rule(q_len, kv_len, heads, refused):
    from stock.flashinfer_mla import tile_bound_problem

    problem = tile_bound_problem([q_len], [kv_len], heads)
    assert (problem is not None) == refused, problem


def test_tile_bound_rule_against_a_brute_force_statement():
    """Every (q_len, kv_len, heads) of a grid: refused exactly when some query tile ends mid-token at a
    token whose last visible key is a multiple of 64."""
    from stock.flashinfer_mla import tile_bound_problem

    for heads in (6, 12, 16, 96):
        for q_len in range(1, 9):
            tile = 64 * (2 if q_len * heads > 64 else 1)
            for kv_len in range(q_len, 200):
                ends = range(tile, q_len * heads, tile)
                bad = any(e % heads and (kv_len - q_len + e // heads) % 64 == 0 for e in ends)
                assert (tile_bound_problem([q_len], [kv_len], heads) is not None) == bad, (heads, q_len, kv_len)


def test_limits_and_places_are_one_line_errors(monkeypatch, tmp_path):
    import stock.flashinfer_mla as fi

    small = _inputs("small")
    with pytest.raises(ValueError, match="512 latent") as e:
        fi.flashinfer_mla_decode_attn(**small.tensors, **small.params)
    assert "\n" not in str(e.value)
    k3 = _inputs("k3", batch=1)
    with pytest.raises(ImportError, match="CUDA sm_90a only") as e:
        fi.flashinfer_mla_peer(k3.tensors, k3.params)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("VERIFY_FLASHINFER_MLA_DIR", str(tmp_path))
    fi._module.cache_clear()
    try:
        with pytest.raises(ImportError, match="build.py") as e:
            fi._module("bfloat16")
        assert "\n" not in str(e.value)
    finally:
        fi._module.cache_clear()


def _have_modules() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    import stock.flashinfer_mla as fi

    return (fi.library_dir() / "batch_mla_sm90_bfloat16.so").is_file()


needs_modules = pytest.mark.skipif(not _have_modules(), reason="needs an sm_90a device and FlashInfer's MLA module")


@pytest.mark.gpu
@needs_modules
@pytest.mark.parametrize("batch,tp,extra", [(1, 1, (("q_per_seq", 1),)), (4, 8, (("q_per_seq", 6),)), (8, 16, ()),
                                            (2, 1, (("context", "long"),))])
def test_flashinfer_is_judged_by_the_harness_at_k3(batch, tp, extra):
    from property_tests.harness_case import judge_case

    for seed in range(2):
        v = judge_case(Case("mla_decode_attn", seed, batch, "k3", "bfloat16", "normal", tp, extra),
                       "stock.flashinfer_mla:flashinfer_mla_decode_attn")
        if v.status == "fail" and "FlashInfer refuses" in v.reason:           # its own wrapper's refusal
            continue
        if tp > 1:                     # a rank split's cases judge each rank's call, with no graph capture
            assert v.status == "pass", f"seed {seed}: {v.stage}: {v.reason}"
            continue
        # FlashInfer plans on the host, so a call cannot be captured whole: that guard, and it alone, fails
        failing = [(c.name, c.detail) for c in v.failing()]
        assert [n for n, _ in failing] == ["guard:cuda_graph"], f"seed {seed}: {failing}"
        assert "plans on the host" in failing[0][1], failing
        assert any(c.name.startswith("compare:") and c.ok for c in v.checks), [c.name for c in v.checks]


@pytest.mark.gpu
@needs_modules
def test_the_harness_rejects_the_native_kernel_at_k3():
    """The unsplit K3 op (96 heads) with 2..8 draft tokens over the registry's page-boundary lengths: the
    tile-bound omission FlashInfer's wrapper guards against shows in the harness's own cases."""
    from property_tests.harness_case import judge_case

    verdicts = [judge_case(Case("mla_decode_attn", seed, 8, "k3", "bfloat16", "normal", 1, (("q_per_seq", q),)),
                           "stock.flashinfer_mla:flashinfer_mla_native") for seed in range(4) for q in (2, 8)]
    assert any(v.status == "fail" and v.stage.startswith("compare") for v in verdicts), \
        [(v.status, v.stage) for v in verdicts]


@pytest.mark.gpu
@needs_modules
def test_where_flashinfer_refuses_the_native_kernel_drops_that_key():
    """96 heads (T = 1), 2 draft tokens, 65 slots: the wrapper refuses; the native kernel's token 1, split
    by the first 128-row tile, misses key 64 (its last) in some heads; token 0's rows are right."""
    from references.mla import mla_decode_attn
    from stock.flashinfer_mla import flashinfer_mla_decode_attn, flashinfer_mla_native

    k3 = _inputs("k3", batch=2, extra=(("q_per_seq", 2),))
    t = {k: v.cuda() for k, v in k3.tensors.items()}
    t["seq_lens"] = torch.full_like(t["seq_lens"], 65)
    pages = -(-65 // t["cache"].shape[1])
    t["block_table"] = torch.arange(2 * pages, dtype=t["block_table"].dtype, device="cuda").view(2, pages)
    with pytest.raises(ValueError, match="FlashInfer refuses"):
        flashinfer_mla_decode_attn(**t, **k3.params)
    ref = mla_decode_attn(**t, **k3.params).float()
    got = flashinfer_mla_native(**t, **k3.params).float()
    err = ((got - ref).abs().amax(dim=(0, 3)) / ref.abs().amax()).cpu()        # [token, head]
    assert float(err[0].max()) < 1e-2 and float(err[1].max()) > 1e-2, err


class _FakeModule:
    """FlashInfer's plan and run entry points as a recorder, on any device."""

    def __init__(self):
        self.plans, self.runs = [], []

    def plan(self, *args):
        """As the native plan: metadata staged in the pinned buffer (args[2]), its byte count returned."""
        self.plans.append(args)
        args[2][:16] = torch.arange(16, dtype=torch.uint8)
        return ("plan-info", 16)

    def run(self, *args):
        self.runs.append(args)


def test_the_wrapper_passes_flashinfers_plan_and_run_their_arguments(monkeypatch):
    """One plan in prepare (CSR offsets of the draft tokens and of each sequence's pages, the page list,
    the lengths, causal), one run per launch with the q and cache halves as views and 18 arguments."""
    import types

    import stock.flashinfer_mla as fi

    pytest.importorskip("tvm_ffi")
    fake = _FakeModule()
    monkeypatch.setattr(fi, "_module", lambda name: fake)
    monkeypatch.setattr(fi, "require_sm90a", lambda t, who: None)
    monkeypatch.setattr(fi.torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    k3 = _inputs("k3", batch=3, extra=(("q_per_seq", 4),))
    t = dict(k3.tensors)
    t["seq_lens"] = torch.tensor([70, 4, 129], dtype=t["seq_lens"].dtype)
    run = fi.flashinfer_mla_peer(t, k3.params)
    run()
    run()
    (plan,) = fake.plans
    assert len(fake.runs) == 2 and all(len(r) == 18 for r in fake.runs)
    qo, kv_ptr, kv_len = plan[3], plan[4], plan[5]
    assert qo.tolist() == [0, 4, 8, 12] and kv_len.tolist() == [70, 4, 129]
    assert kv_ptr.tolist() == [0, 2, 3, 6] and plan[6:] == (t["q_abs"].shape[2], 512, True)
    args = fake.runs[0]
    assert args[1][:16].tolist() == list(range(16))          # the staged metadata copied to the device buffer
    table = t["block_table"]
    assert args[7].tolist() == table[0, :2].tolist() + table[1, :1].tolist() + table[2, :3].tolist()
    q_nope, q_pe, ckv, kpe = args[3:7]
    assert q_nope.shape[-1] == 512 and q_pe.shape[-1] == 64 and ckv.shape[-1] == 512 and kpe.shape[-1] == 64
    assert q_pe.data_ptr() - q_nope.data_ptr() == 512 * q_nope.element_size()      # views of q_abs's rows
    assert args[10:] == (fi.MASK_CAUSAL, t["q_abs"].shape[2], 64, float(k3.params["scale"]), True, 1.0, 1.0, None)


def test_a_plan_inside_graph_capture_is_one_clear_error(monkeypatch):
    """FlashInfer plans on the host from the lengths; inside a CUDA-graph capture the candidate says so in
    one line before any host read (the harness reports it at guard:cuda_graph)."""
    import stock.flashinfer_mla as fi

    monkeypatch.setattr(fi, "capturing", lambda: True)
    monkeypatch.setattr(fi, "_check_decode_inputs", lambda *a: pytest.fail("a host read under capture"))
    k3 = _inputs("k3", batch=2)
    with pytest.raises(RuntimeError, match="plans on the host from seq_lens"):
        fi.flashinfer_mla_decode_attn(**k3.tensors, **k3.params)


@pytest.mark.skipif(not (__import__("stock.flashinfer_mla", fromlist=["x"]).library_dir()
                         / "batch_mla_sm90_bfloat16.so").is_file(),
                    reason="FlashInfer's MLA modules are not built here (stock/flashinfer_mla/build.py)")
def test_the_built_modules_load_through_tvm_ffi_without_the_flashinfer_package():
    import stock.flashinfer_mla as fi

    pytest.importorskip("tvm_ffi")
    fi._module.cache_clear()
    try:
        for name in ("bfloat16", "float16"):
            m = fi._module(name)
            assert callable(m.plan) and callable(m.run)
    finally:
        fi._module.cache_clear()
