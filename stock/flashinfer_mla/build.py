"""Builds FlashInfer's Hopper MLA paged-attention module (the fa3 backend of BatchMLAPagedAttentionWrapper:
batch_mla_sm90_{plan,run,binding}.cu, 512 latent + 64 rope, int32 indices) for bf16 and fp16 with
FlashInfer's own JIT generator, and copies each .so into OUT for stock/flashinfer_mla. nvcc only, no GPU:

    FLASHINFER_CUDA_ARCH_LIST=9.0a python stock/flashinfer_mla/build.py OUT

Needs flashinfer-python (and its JIT dependencies: ninja, apache-tvm-ffi, jinja2) and CUDA_HOME's nvcc;
the .so loads on the GPU machine through tvm_ffi alone (the CuTe DSL bundle carries it), without the
flashinfer package. OUT/VERSION records the FlashInfer version and commit it was built from.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float16")


def main(out: Path) -> None:
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    import torch
    import flashinfer
    from flashinfer.jit.attention.modules import gen_batch_mla_module

    out.mkdir(parents=True, exist_ok=True)
    for name in DTYPES:
        dt = getattr(torch, name)
        spec = gen_batch_mla_module("fa3", dt, dt, dt, torch.int32, 512, 64, False)
        spec.build(verbose=False)
        shutil.copy(spec.jit_library_path, out / f"batch_mla_sm90_{name}.so")
        print(f"built {out / f'batch_mla_sm90_{name}.so'} ({spec.name})")
    try:
        from flashinfer._build_meta import __git_commit__ as commit
    except ImportError:
        commit = "unknown"
    (out / "VERSION").write_text(f"{flashinfer.__version__} {commit}\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: FLASHINFER_CUDA_ARCH_LIST=9.0a python stock/flashinfer_mla/build.py OUT")
    main(Path(sys.argv[1]))
