"""The pytest plugin, as a downstream project uses it: vk_certify passes a correct kernel, fails a
buggy one with the report and a repro line, and gpu-marked tests are skipped with their reason."""
from __future__ import annotations

pytest_plugins = ["pytester"]

DOWNSTREAM = '''
import pytest
import torch

from references.mxfp4 import mxfp4_dequant


def my_dequant(packed, scale, out_dtype="bfloat16"):
    return mxfp4_dequant(packed, scale, out_dtype)


def my_dequant_swapped(packed, scale, out_dtype="bfloat16"):
    swapped = ((packed & 0xF) << 4) | (packed >> 4)
    return mxfp4_dequant(swapped, scale, out_dtype)


def test_good_kernel(vk_certify):
    v = vk_certify("mxfp4_dequant", my_dequant)
    assert v.cases_passed >= 4


def test_buggy_kernel(vk_certify):
    vk_certify("mxfp4_dequant", my_dequant_swapped)


def test_by_import_path(vk_certify):
    vk_certify("mxfp4_dequant", "references.mxfp4:mxfp4_dequant")


@pytest.mark.gpu
def test_needs_gpu():
    assert torch.cuda.is_available()
'''


def test_plugin_certifies_rejects_and_skips(pytester):
    pytester.makepyfile(test_downstream=DOWNSTREAM)
    result = pytester.runpytest_subprocess("-q", "-rs", "-p", "no:cacheprovider", "--vk-profile", "quick")
    result.assert_outcomes(passed=2, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*mxfp4_dequant not certified: compare:w*", "*repro: verify-kernels repro*",
                                 "*needs a CUDA device*"])
