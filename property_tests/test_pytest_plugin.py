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


NOT_IMPORTABLE = '''
from references.mxfp4 import mxfp4_dequant


def swapped(packed, scale, out_dtype="bfloat16"):
    return mxfp4_dequant(((packed & 0xF) << 4) | (packed >> 4), scale, out_dtype)


def test_top_level_in_a_test_file(vk_certify):
    vk_certify("mxfp4_dequant", swapped)


def test_local_function(vk_certify):
    def local(packed, scale, out_dtype="bfloat16"):
        return swapped(packed, scale, out_dtype)
    vk_certify("mxfp4_dequant", local)
'''


def test_a_repro_line_can_be_pasted(pytester):
    """A kernel defined in a test file (not importable by module name from a shell) gets a repro command
    naming its file; a local function or lambda, which no command can name, gets the case and the
    Python call that reruns it. Each printed repro is then run, and reproduces the failure."""
    import re
    import subprocess
    import sys

    pytester.makepyfile(test_repro_lines=NOT_IMPORTABLE)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--vk-profile", "quick")
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    command = re.search(r"repro: (verify-kernels repro .*)", text).group(1)
    assert "test_repro_lines.py:swapped" in command and "<" not in command, command
    got = subprocess.run(command.replace("verify-kernels", f"{sys.executable} -m verify.cli", 1), shell=True,
                         capture_output=True, text=True, cwd="/", timeout=300)
    assert got.returncode == 1 and "compare:w" in got.stdout, got.stdout + got.stderr
    assert "cannot be named on a command line" in text and "test_local_function.<locals>.local" in text
    call = re.search(r"from verify\.repro import repro; repro\((.*), <the mxfp4_dequant function>\)", text)
    from verify.repro import repro
    from verify.model.verdict import FAIL
    from references.mxfp4 import mxfp4_dequant

    def local(packed, scale, out_dtype="bfloat16"):
        return mxfp4_dequant(((packed & 0xF) << 4) | (packed >> 4), scale, out_dtype)
    import ast
    assert repro(ast.literal_eval(call.group(1)), local, "cpu").status == FAIL
