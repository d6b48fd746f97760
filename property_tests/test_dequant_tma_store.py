"""The bench-only bulk-store launch of mxfp4_dequant (bench/dequant_tma_store.py): every config
compiles for sm_90a on a CPU-only machine and its PTX writes the output only through
cp.async.bulk stores from shared memory; on a CUDA device its output is bit for bit the default
kernel's (a partial last CTA included)."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from bench import dequant_tma_store as dts  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIGS = dts.all_configs()


def test_every_config_compiles():
    for cfg in CONFIGS:
        assert dts._compile(cfg) is not None, cfg.name


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_ptx_stores_through_bulk_copies(ptx_of, cfg):
    ptx = ptx_of(f"from bench import dequant_tma_store as d; d._compile(d.{cfg!r})")
    body = ptx[ptx.index(".entry"):]
    assert body.count("cp.async.bulk.global.shared::cta.bulk_group") == cfg.chunks
    assert "st.global" not in body                       # the output goes out by bulk stores only
    assert body.count("st.shared.v4.b32") == cfg.units * cfg.chunks
    assert "fence.proxy.async.shared::cta" in body
    assert body.count("cp.async.bulk.wait_group.read") == 1 + max(0, cfg.chunks - cfg.stages)
    assert ("createpolicy.fractional.L2::evict_first" in body) == cfg.evict_first
    assert (".L2::cache_hint" in body) == cfg.evict_first
    assert ".local" not in ptx                           # no register spills


def test_rejects_bad_stages():
    with pytest.raises(ValueError, match="stages"):
        dts.Mxfp4DequantBulkStore(dts.BulkStoreConfig(stages=3))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [21, 67, 7168])
def test_bitwise_equal_to_default_kernel(rows):
    """Random codes, every scale byte (0, 254, 255 included); 21 and 67 rows of 1024 end in a short
    chunk (at 21 rows the third of four, after a buffer reuse)."""
    from fused.mxfp4_dequant import mxfp4_dequant
    packed = torch.randint(0, 256, (rows, 512), dtype=torch.uint8, device="cuda")
    scale = torch.randint(0, 256, (rows, 32), dtype=torch.uint8, device="cuda")
    scale[:8, :8] = torch.tensor([0, 1, 2, 126, 127, 253, 254, 255], dtype=torch.uint8)
    want = mxfp4_dequant(packed, scale, "bfloat16").view(torch.int16)
    for cfg in CONFIGS:
        got = torch.full((rows, 1024), -1, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        dts.launch(packed, scale, got, cfg)
        assert torch.equal(got.view(torch.int16), want), cfg.name
