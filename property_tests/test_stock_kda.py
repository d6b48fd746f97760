"""stock/kda.py: kda_decode through fla-core's one-token kernel, the peer design of the speculative-
decoding bench. On the CPU it refuses in one line (fla's Triton kernel needs CUDA); on a CUDA device
with fla-core (`@pytest.mark.gpu`) the harness judges it as a candidate of kda_decode, and the
spec-decode contract judges it as a one-token design."""
from __future__ import annotations

import pytest
import torch

from verify.model.case import Case
from verify.ops.registry import get_op

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_on_the_cpu_it_refuses_in_one_line():
    from stock.kda import fla_kda_decode

    inputs = get_op("kda_decode").make_inputs(Case("kda_decode", 0, 2, "tiny", "bfloat16", "normal"))
    with pytest.raises(ImportError, match="CUDA only") as e:
        fla_kda_decode(**inputs.tensors, **inputs.params)
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config,batch", [("small", 4), ("k3", 2)])
def test_fla_kda_decode_is_a_correct_candidate_of_kda_decode(config, batch):
    pytest.importorskip("fla", reason="needs fla-core")
    from property_tests.harness_case import judge_case

    for seed in range(2):
        v = judge_case(Case("kda_decode", seed, batch, config, "bfloat16", "normal"), "stock.kda:fla_kda_decode")
        assert v.status == "pass", f"{v.stage}: {v.reason}"


@pytest.mark.gpu
@needs_gpu
def test_fla_one_token_design_meets_the_spec_decode_contract():
    pytest.importorskip("fla", reason="needs fla-core")
    from verify.spec_decode.command import _factory
    from verify.spec_decode.contract import Drive, check_contract

    report = check_contract(_factory("one-token:stock.kda:fla_kda_decode", "cuda"),
                            Drive(config="small", batch=4, n_q=6, steps=16, seed=0, device="cuda"))
    assert report.ok, [str(v) for v in report.violations][:3]
