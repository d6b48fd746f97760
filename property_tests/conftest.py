"""Suite-wide settings. Hypothesis profiles and the gpu/multi_gpu markers come from the project's
own pytest plugin (verify/pytest_plugin.py), loaded through its entry point."""
from __future__ import annotations

import pytest
import torch


@pytest.hookimpl(optionalhook=True)      # pytest-xdist's hook; the GPU image runs pytest without it
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU core on a machine without a CUDA device (each worker runs one
    intra-op thread, below); in-process where a GPU is visible, whose tests time kernels and share the card."""
    import os

    return 0 if torch.cuda.is_available() else len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True, scope="session")
def single_cpu_thread():
    """The suite's tensors are small: one intra-op thread is faster than two on a 2-core machine and
    does not collapse when the machine is loaded (a tiny matmul measured 25 ms at 2 threads under
    load against 9 us at 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _dump_of(tmp_path, keep: str, pattern: str):
    """run(code): the artifacts matching `pattern` that running `code` (which compiles a kernel)
    dumps with CUTE_DSL_`keep`=1, compiled in a fresh process for sm_90a so the dump is not a cache hit."""
    import os
    import subprocess
    import sys

    def run(code: str) -> str:
        for old in tmp_path.glob(pattern):
            old.unlink()
        env = dict(os.environ, CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_ARCH="sm_90a",
                   CUTE_DSL_DISABLE_FILE_CACHING="1", **{f"CUTE_DSL_{keep}": "1"})
        subprocess.run([sys.executable, "-c", code], check=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return "".join(p.read_text() for p in tmp_path.glob(pattern))

    return run


@pytest.fixture
def ptx_of(tmp_path):
    """ptx_of(code): the PTX that running `code` (which compiles a kernel) dumps."""
    return _dump_of(tmp_path, "KEEP_PTX", "*.ptx")


@pytest.fixture
def ir_of(tmp_path):
    """ir_of(code): the host MLIR that running `code` dumps (launch attributes such as a cooperative
    launch live there, not in the PTX)."""
    return _dump_of(tmp_path, "KEEP_IR", "*.mlir")


@pytest.fixture
def ptxas_regs(tmp_path):
    """ptxas_regs(ptx) -> (registers per thread, spill store bytes) of the PTX's entry, assembled for
    sm_90a by the CUDA toolkit's ptxas (the CPU machine has one; skipped, not passed, where it is missing)."""
    import re
    import shutil
    import subprocess

    exe = shutil.which("ptxas")
    if exe is None:
        pytest.skip("needs ptxas (CUDA toolkit) to read register counts")

    def run(ptx: str) -> tuple[int, int]:
        src = tmp_path / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([exe, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
        regs = re.findall(r"Used (\d+) registers", out)
        spills = re.findall(r"(\d+) bytes spill stores", out)
        assert len(regs) == 1, f"expected one kernel in the PTX, ptxas said: {out}"
        return int(regs[0]), int(spills[0]) if spills else 0

    return run


@pytest.fixture
def ctas_per_sm():
    """ctas_per_sm(regs, warps): CTAs an sm_90 SM holds by registers. Each of its 4 sub-partitions has
    16 K registers for the warps dealt to it, and a warp's registers come in units of 256 (8 per
    thread): Nsight Compute's "Block Limit Registers" gives 1 block at 134 registers x 7 warps, where
    the SM's 64 K alone would fit 2."""
    def run(regs: int, warps: int) -> int:
        per_warp = -(-regs // 8) * 8 * 32
        c = 0
        while -(-(c + 1) * warps // 4) * per_warp <= 16384:
            c += 1
        return c

    return run
