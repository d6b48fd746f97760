"""fused/mxfp4_dequant.py: every variant compiles for sm_90a on a CPU-only machine and the bulk-store
variant stores through one bulk copy; bitwise numerics are checked on a CUDA device only (skipped
here with the reason, never counted as passed)."""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_mxfp4_dequant_compiles_every_variant(out_dtype):
    from fused import mxfp4_dequant as fm
    cfgs = fm.all_configs(out_dtype)
    assert fm.default_config(out_dtype) in cfgs and any(c.bulk for c in cfgs) == (out_dtype == "bfloat16")
    for cfg in cfgs:
        runtime.compile_for_cpu_check("mxfp4_dequant", out_dtype, cfg)


def test_mxfp4_dequant_bulk_variant_stores_through_one_bulk_copy(ptx_of):
    """The bf16 default writes its output span with one bulk async copy from shared memory after a
    proxy fence, and no st.global; it waits for the copy's reads before exiting."""
    ptx = ptx_of("from fused import mxfp4_dequant as fm; fm._compile('bfloat16', fm.default_config('bfloat16'))")
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 1
    assert "fence.proxy.async.shared::cta" in ptx and re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
    assert "st.global" not in ptx and ptx.count("st.shared.v4.b32") == 4 and ".local" not in ptx


def test_mxfp4_dequant_bulk_variant_refuses_other_dtypes():
    from fused import mxfp4_dequant as fm
    with pytest.raises(ValueError, match="bf16 only"):
        fm.Mxfp4Dequant(fm.Mxfp4DequantConfig(256, 4, bulk=True), "float16")


# ---------------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@needs_gpu
def test_mxfp4_dequant_bitwise():
    """Every variant and output dtype, every code, the extreme scale bytes (0: subnormal scale,
    254: overflow to inf, 255: NaN), a row count that leaves a partial CTA, and an offset input."""
    from fused.mxfp4_dequant import all_configs, mxfp4_dequant
    from references.mxfp4 import mxfp4_dequant as ref_dq
    packed = torch.randint(0, 256, (67, 512), dtype=torch.uint8)
    scale = torch.randint(0, 255, (67, 32), dtype=torch.uint8)
    scale[:8, :8] = torch.tensor([0, 1, 2, 126, 127, 253, 254, 255], dtype=torch.uint8)
    base = torch.zeros(67 * 512 + 5, dtype=torch.uint8)
    base[5:] = packed.reshape(-1)
    offset = base[5:].view(67, 512)                  # not 16-byte aligned
    for dt in ("bfloat16", "float16", "float32"):
        ref = ref_dq(packed, scale, dt)
        nan = ref.isnan()
        for cfg in all_configs(dt):
            for pk in (packed.cuda(), offset.cuda()):
                got = mxfp4_dequant(pk, scale.cuda(), dt, variant=cfg).cpu()
                assert torch.equal(got.isnan(), nan), (dt, cfg)
                assert torch.equal(got[~nan], ref[~nan]), (dt, cfg)
                assert torch.equal(got[~nan].signbit(), ref[~nan].signbit()), (dt, cfg)
        assert torch.equal(mxfp4_dequant(packed.cuda(), scale.cuda(), dt).cpu().nan_to_num(),
                           ref.nan_to_num())
