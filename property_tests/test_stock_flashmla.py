"""stock/flashmla: mla_decode_attn through FlashMLA's Hopper kernel, a third-party candidate and the
bench peer of #34. On the CPU: FlashMLA's own limits (576 / 512 / page 64, bf16 or fp16) refused in one
line before any launch, and the CPU or a missing library refused as ImportError. On an sm_90a device
with the library built (`@pytest.mark.gpu`): the harness judges it at k3 (ragged lengths, 1..8 causal
query tokens, page-boundary and past-2^16 lengths), and the peer's launch gives the candidate's bits."""
from __future__ import annotations

import pytest
import torch

from verify.model.case import Case
from verify.ops.registry import get_op

OP = get_op("mla_decode_attn")


def _inputs(config: str, seed: int = 0, batch: int = 2, dtype: str = "bfloat16", extra=()):
    return OP.make_inputs(Case("mla_decode_attn", seed, batch, config, dtype, "normal", extra=extra))


def test_flashmla_limits_are_one_line_value_errors():
    from stock.flashmla import flashmla_decode_attn, flashmla_peer

    small = _inputs("small")                           # kv_lora_rank 64, page 16: not FlashMLA's shapes
    with pytest.raises(ValueError, match="576-wide keys") as e:
        flashmla_decode_attn(**small.tensors, **small.params)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="576-wide keys"):
        flashmla_peer(small.tensors, small.params)
    fp32 = dict(small.tensors, q_abs=small.tensors["q_abs"].float(), cache=small.tensors["cache"].float())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        flashmla_decode_attn(**fp32, **small.params)


def test_k3_inputs_on_the_cpu_are_refused_as_not_runnable_here():
    from stock.flashmla import flashmla_decode_attn

    k3 = _inputs("k3", batch=1)
    with pytest.raises(ImportError, match="CUDA sm_90a only") as e:
        flashmla_decode_attn(**k3.tensors, **k3.params)
    assert "\n" not in str(e.value)


def test_a_missing_library_names_how_to_build_it(monkeypatch, tmp_path):
    import stock.flashmla as fm

    monkeypatch.setenv("VERIFY_FLASHMLA_LIB", str(tmp_path / "absent.so"))
    fm._lib.cache_clear()
    try:
        with pytest.raises(ImportError, match="build.sh") as e:
            fm._lib()
        assert "\n" not in str(e.value)
    finally:
        fm._lib.cache_clear()


def test_the_draft_longer_than_a_sequence_is_the_references_error():
    from stock.flashmla import flashmla_decode_attn

    k3 = _inputs("k3", batch=2, extra=(("q_per_seq", 4),))
    t = dict(k3.tensors)
    t["seq_lens"] = t["seq_lens"].clone()
    t["seq_lens"][1] = 3
    with pytest.raises(ValueError, match="cover the 4 query tokens"):
        flashmla_decode_attn(**t, **k3.params)


def _have_flashmla() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    import stock.flashmla as fm

    return fm.library_path().is_file()


needs_flashmla = pytest.mark.skipif(not _have_flashmla(), reason="needs an sm_90a device and the FlashMLA library")


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("batch,extra", [(1, (("q_per_seq", 1),)), (4, (("q_per_seq", 6),)), (8, ()),
                                         (2, (("context", "long"),))])
def test_flashmla_is_judged_by_the_harness_at_k3(batch, extra):
    from property_tests.harness_case import judge_case

    for seed in range(2):
        v = judge_case(Case("mla_decode_attn", seed, batch, "k3", "bfloat16", "normal", extra=extra),
                       "stock.flashmla:flashmla_decode_attn")
        assert v.status == "pass", f"seed {seed}: {v.stage}: {v.reason}"


@pytest.mark.gpu
@needs_flashmla
def test_the_peer_launch_gives_the_candidates_bits():
    from stock.flashmla import flashmla_decode_attn, flashmla_peer

    k3 = _inputs("k3", batch=4, extra=(("q_per_seq", 6),))
    t = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in k3.tensors.items()}
    launch = flashmla_peer(t, k3.params)
    first = launch().clone()
    assert torch.equal(launch(), first)
    assert torch.equal(flashmla_decode_attn(**t, **k3.params), first)


class _FakeLib:
    """FlashMLA's C entry points as a recorder: what the wrapper passes, on any device."""

    def __init__(self):
        self.calls = []

    def fmla_sched_meta_ints(self):
        return 8

    def fmla_dense_decode(self, *args):
        self.calls.append(args)
        return 0


def test_the_wrapper_passes_flashmlas_operands_and_schedules_once_per_peer(monkeypatch):
    """The peer plans (scheduler on) once in prepare and launches without it; the candidate schedules on
    every call; both pass K3's sizes, the cache's page strides and one stream, with no host read."""
    import types

    import stock.flashmla as fm

    fake = _FakeLib()
    monkeypatch.setattr(fm, "_lib", lambda: fake)
    monkeypatch.setattr(fm, "require_sm90a", lambda t, who: None)
    monkeypatch.setattr(fm, "num_sm_parts", lambda device, n_q, H: 7)
    monkeypatch.setattr(fm.torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234))
    k3 = _inputs("k3", batch=3, extra=(("q_per_seq", 6),))
    run = fm.flashmla_peer(k3.tensors, k3.params)
    out = run()
    assert out.shape == (3, 6, k3.tensors["q_abs"].shape[2], 512)
    (first, second) = fake.calls
    B, n_q, H = 3, 6, k3.tensors["q_abs"].shape[2]
    cache = k3.tensors["cache"]
    from pathlib import Path

    shim = (Path(fm.__file__).parent / "shim.cu").read_text()
    c_params = shim.split("int fmla_dense_decode(")[1].split(")")[0].count(",") + 1
    for call in fake.calls:
        assert len(call) == c_params                           # one Python argument per C parameter
        assert call[:8] == (0, B, n_q, H, 576, 512, 64, cache.shape[0])
        assert call[8:10] == (cache.stride(0), cache.stride(1)) and call[-1] == 1234
        assert call[21] == 7                                   # num_sm_parts: the plan's
    assert first[-2] == 1 and second[-2] == 0                  # the schedule in prepare only
    fm.flashmla_decode_attn(**k3.tensors, **k3.params)
    assert fake.calls[-1][-2] == 1


def test_under_graph_capture_the_candidate_reads_nothing_from_the_host(monkeypatch):
    """Capture forbids host reads (the H200 run's guard:cuda_graph failed on them): while capturing, the
    length and page checks are left out and the launch schedules on the device; outside, both run."""
    import types

    import stock.flashmla as fm

    fake, host_reads = _FakeLib(), []
    monkeypatch.setattr(fm, "_lib", lambda: fake)
    monkeypatch.setattr(fm, "require_sm90a", lambda t, who: None)
    monkeypatch.setattr(fm, "num_sm_parts", lambda device, n_q, H: 7)
    monkeypatch.setattr(fm.torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1))
    monkeypatch.setattr(fm, "_check_decode_inputs", lambda *a: host_reads.append("lengths"))
    monkeypatch.setattr(fm, "check_pages", lambda *a: host_reads.append("pages"))
    k3 = _inputs("k3", batch=2, extra=(("q_per_seq", 2),))
    for capture, want in ((True, []), (False, ["lengths", "pages"])):
        monkeypatch.setattr(fm, "capturing", lambda c=capture: c)
        host_reads.clear()
        fm.flashmla_decode_attn(**k3.tensors, **k3.params)
        assert host_reads == want and fake.calls[-1][-2] == 1


def test_page_ids_outside_the_cache_are_refused_before_a_hopper_kernel_reads_them():
    from stock.sm90 import check_pages

    cache = torch.zeros(4, 64, 8)
    table = torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32)
    check_pages(cache, table, torch.tensor([128, 65]))                       # every needed page exists
    with pytest.raises(ValueError, match=r"page id -1 at \[0, 2\]"):
        check_pages(cache, table, torch.tensor([129, 65]))
    with pytest.raises(ValueError, match="page id 9"):
        check_pages(cache, torch.tensor([[0, 9, -1], [2, 3, -1]], dtype=torch.int32), torch.tensor([65, 1]))
    with pytest.raises(ValueError, match="needs 4 pages; its block_table row has 3"):
        check_pages(cache, table, torch.tensor([1, 200]))


@pytest.mark.skipif(not __import__("stock.flashmla", fromlist=["x"]).library_path().is_file(),
                    reason="FlashMLA's library is not built here (stock/flashmla/build.sh)")
def test_the_built_library_loads_without_a_gpu_and_refuses_off_limit_shapes_in_its_return_code():
    """Where the library is built (the CPU machine that builds it): it loads with no driver (cudart is
    static), its schedule record is FlashMLA's 8 ints, and the shim returns -1 for a shape FlashMLA
    would assert on, before any CUDA call."""
    import stock.flashmla as fm

    lib = fm._lib()
    assert lib.fmla_sched_meta_ints() == 8
    args = [0, 1, 1, 16, 100, 512, 64, 1, 0, 0, 1.0, 1, None, None, None, None, None, 0, None, None, None, 1,
            None, None, 0, None]
    assert lib.fmla_dense_decode(*args) == -1                  # 100-wide keys
    args[4], args[6] = 576, 32
    assert lib.fmla_dense_decode(*args) == -1                  # pages of 32
