"""TP splits of skinny_gemm (column: concat; row: partial sums in the declared order), T in 1..16,
and a check that partial sums drawn to cancel really depend on the summation order."""
from __future__ import annotations

import pytest
import torch

from verify.model.case import Case
from verify.ops.common_splits import fold_ranks, run_reference, run_split, split_mismatches
from verify.ops.gemm import OPS, SKINNY_GEMM_COLUMN_SPLIT, SKINNY_GEMM_ROW_SPLIT

TP_VALUES = (1, 2, 4, 8, 16)
GEMM = OPS[0]



@pytest.mark.parametrize("T", TP_VALUES)
@pytest.mark.parametrize("split", [SKINNY_GEMM_COLUMN_SPLIT, SKINNY_GEMM_ROW_SPLIT], ids=["column", "row"])
def test_split_equals_unsplit_in_float64(T, split):
    for proj in ("o_proj", "latent_down"):
        inputs = GEMM.make_inputs(Case(GEMM.name, T, 3, "tiny", "float64", extra=(("proj", proj),), tp=T))
        assert split_mismatches(GEMM, inputs, T, split=split) == []


@pytest.mark.parametrize("T", TP_VALUES)
def test_column_split_is_bitwise_in_bf16(T):
    inputs = GEMM.make_inputs(Case(GEMM.name, T, 4, "tiny", "bfloat16", tp=T))
    assert torch.equal(run_split(GEMM, inputs, T)["y"], run_reference(GEMM, inputs)["y"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cancelling_partials_depend_on_the_order(dtype):
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(2, 16, generator=g) * 2.0 ** 24).to(dtype)
    parts = [big] + [torch.randn(2, 16, generator=g).to(dtype) for _ in range(3)]
    parts[2] = -big
    assert not torch.equal(fold_ranks(parts), fold_ranks(parts[::-1]))


@pytest.mark.parametrize("T", [3, 5, 0])
def test_rank_count_not_dividing_names_T(T):
    inputs = GEMM.make_inputs(Case(GEMM.name, 0, 2, "tiny", extra=(("proj", "o_proj"),)))
    for split in (SKINNY_GEMM_COLUMN_SPLIT, SKINNY_GEMM_ROW_SPLIT):
        with pytest.raises(ValueError, match="^T"):
            split.shard(inputs, T)
