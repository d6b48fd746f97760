"""pytest plugin (entry point `verify_kernels`): certify your own kernels inside your tests.

    def test_my_rmsnorm(vk_certify):
        vk_certify("attn_res_rmsnorm", "mypkg.kernels:attn_res_rmsnorm")

Adds hypothesis profiles (dev, ci: derandomized with no deadline, release), the `gpu` and
`multi_gpu` markers (skipped with the limit they hit, never counted as passed), and the options
--vk-profile / --vk-device.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("release", max_examples=200, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def pytest_addoption(parser):
    group = parser.getgroup("verify-kernels")
    group.addoption("--vk-profile", default=None, help="harness profile for vk_certify: quick | ci | release")
    group.addoption("--vk-device", default=None, help="device for vk_certify: cpu | cuda (default: cuda if present)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "multi_gpu(n): needs n CUDA devices (default 2)")
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = None
    for item in items:
        gpu, multi = item.get_closest_marker("gpu"), item.get_closest_marker("multi_gpu")
        if gpu is None and multi is None:
            continue
        n = _cuda_count() if n is None else n
        need = (multi.args[0] if multi and multi.args else 2) if multi else 1
        if n < need:
            why = "needs a CUDA device" if need == 1 else f"needs {need} CUDA devices, found {n}"
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def vk_certify(request):
    """Certify a candidate ('module:attr', a callable, 'compiled', 'fused') for one op; fail with the report."""
    from verify.judge.candidates import Candidate
    from verify.model.profile import get_profile
    from verify.run.runner import RunOptions, certify_op
    from verify.ops.registry import get_op
    from verify.model.verdict import FAIL, SKIP, XPASS

    def run(op_name: str, candidate, profile: str | None = None, device: str | None = None, **kw):
        import torch

        profile = profile or request.config.getoption("--vk-profile") or "quick"
        device = device or request.config.getoption("--vk-device") or ("cuda" if torch.cuda.is_available() else "cpu")
        op = get_op(op_name)
        cand = _CallableCandidate(candidate) if callable(candidate) else Candidate(candidate)
        v = certify_op(op, cand, RunOptions(device=device, profile=get_profile(profile), **kw))
        if v.status == SKIP:
            pytest.skip(f"{op_name}: {v.reason}")
        if v.status in (FAIL, XPASS):
            repro = v.repro
            if callable(candidate) and v.failure is not None and v.failure.case:
                from verify.repro import repro_text

                repro = repro_text(op_name, v.failure.case, candidate, v.repro)
            pytest.fail(f"{op_name} not certified: {v.reason}\n  repro: {repro}", pytrace=False)
        return v

    return run


class _CallableCandidate:
    def __init__(self, fn):
        from verify.judge.candidates import callable_label

        self.fn = fn
        self.label = callable_label(fn)[0]      # 'path/to/test_x.py:fn' where the module is not importable

    def resolve(self, op, device):
        return self.fn
