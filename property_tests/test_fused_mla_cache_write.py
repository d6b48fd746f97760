"""fused/mla_cache_write.py: every variant compiles for sm_90a on a CPU-only machine; bitwise numerics
are checked on a CUDA device only (skipped here with the reason, never counted as passed)."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mla_cache_write_compiles_every_variant(dtype):
    from fused import mla_cache_write as fm
    for cfg in fm.all_configs():
        runtime.compile_for_cpu_check("mla_cache_write", dtype, 576, cfg)


# ---------------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@needs_gpu
def test_mla_cache_write_bitwise():
    from fused.mla_cache_write import mla_cache_write
    from references.mla import mla_cache_write as ref_cw
    cache = torch.randn(16, 64, 576, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(9, 576, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(16 * 64, device="cuda")[:9]
    slots[::2] = -1
    ref = cache.clone()
    ref_cw(latent, ref, slots)
    mla_cache_write(latent, cache, slots)
    assert torch.equal(ref.view(torch.int16), cache.view(torch.int16))
