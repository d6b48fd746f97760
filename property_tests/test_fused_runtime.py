"""fused/runtime.py: importing the kernels package loads no CuTe DSL, and every fused kernel registers
its custom op under the project's namespace."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")


def test_runtime_import_is_lazy():
    import subprocess
    import sys
    code = "import sys, fused, fused.runtime; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_custom_ops_register_under_project_namespace():
    from fused import mla_cache_write, mxfp4_dequant, router_topk, skinny_gemm
    for mod in (skinny_gemm, mxfp4_dequant, mla_cache_write, router_topk):
        mod._custom_op()
    for name in ("skinny_gemm", "mxfp4_dequant", "mla_cache_write", "router_topk"):
        assert hasattr(torch.ops.verify_kernels, name)
