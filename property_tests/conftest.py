"""Suite-wide settings. Hypothesis profiles and the gpu/multi_gpu markers come from the project's
own pytest plugin (verify/pytest_plugin.py), loaded through its entry point."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def single_cpu_thread():
    """The suite's tensors are small: one intra-op thread is faster than two on a 2-core machine and
    does not collapse when the machine is loaded (a tiny matmul measured 25 ms at 2 threads under
    load against 9 us at 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
