"""TP split of mxfp4_dequant: rows over ranks (uneven ranges allowed), concatenated: bitwise."""
from __future__ import annotations

import pytest

from verify.model.case import Case
from verify.ops.common_splits import run_reference, run_split, same_bits
from verify.ops.mxfp4 import OPS

TP_VALUES = (1, 2, 4, 8, 16)
DEQUANT = OPS[0]


@pytest.mark.parametrize("T", TP_VALUES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_row_split_is_bitwise(T, dtype, rows):
    inputs = DEQUANT.make_inputs(Case(DEQUANT.name, T, rows, "tiny", dtype, "wide_range", tp=T))
    assert same_bits(run_split(DEQUANT, inputs, T)["w"], run_reference(DEQUANT, inputs)["w"])


def test_bad_rank_count_names_T():
    with pytest.raises(ValueError, match="^T"):
        DEQUANT.split.shard(DEQUANT.make_inputs(Case(DEQUANT.name, 0, 2, "tiny")), 0)
