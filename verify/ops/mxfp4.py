"""Registry entry for mxfp4_dequant (references/mxfp4.py) and the MXFP4 weight draws the MoE entries use.

The case dtype is the OUTPUT dtype of the dequant (inputs are uint8). Rows = case.batch (each output
row is independent, so batch invariance means the same packed row gives the same bits anywhere).
"""
from __future__ import annotations

import math

import torch

from references.config import get_config
from references.mxfp4 import GROUP, pack_fp4, quantize_mxfp4_ct, quantize_mxfp4_ocp
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, RankShard, SplitRule
from verify.ops.common_splits import DTYPES, check_tp, gen_for
from verify.model.values import GENERIC_DISTS, draw

E2M1_CODE_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)   # rms of uniformly drawn codes
QUANTIZE_MAX_ELEMS = 1 << 22      # above this, draw codes directly (quantising fp64 draws costs GBs at k3)


def random_codes_weight(g: torch.Generator, shape_oi, fan_in: int, jitter: int = 1):
    """Uniform E2M1 codes with scales chosen so the dequantised std is ~ fan_in^-1/2."""
    O, I = shape_oi
    codes = torch.randint(0, 16, (O, I), generator=g, dtype=torch.uint8)
    base = 127 + round(math.log2(1.0 / (math.sqrt(fan_in) * E2M1_CODE_RMS)))
    scale = base + torch.randint(-jitter, jitter + 1, (O, I // GROUP), generator=g)
    return pack_fp4(codes), scale.clamp(0, 254).to(torch.uint8)


def mxfp4_weight(case: Case, name: str, shape_oi, fan_in: int, dist: str = "normal"):
    """(packed, scale) of an [O, I] MXFP4 weight for `dist`.

    mxfp4_grid: codes drawn directly (values exactly on the grid, structural bugs show as gross errors);
    wide_range: codes drawn directly with scale bytes uniform over 0..255 (extremes and 0xFF = NaN);
    otherwise: fp64 values of the distribution quantised, with the torchao (OCP) or the
    compressed-tensors rule picked by the seed (knob 'rule' = 'ocp' | 'ct' overrides).
    """
    g = gen_for(case, name)
    O, I = shape_oi
    if dist == "mxfp4_grid" or O * I > QUANTIZE_MAX_ELEMS:
        return random_codes_weight(g, shape_oi, fan_in)
    if dist == "wide_range":
        packed, _ = random_codes_weight(g, shape_oi, fan_in)
        return packed, torch.randint(0, 256, (O, I // GROUP), generator=g, dtype=torch.uint8)
    w = draw(g, (O, I), dist if dist in GENERIC_DISTS else "normal", scale=fan_in ** -0.5, dtype=torch.float64)
    rule = case.knob("rule", "ocp" if case.seed % 2 == 0 else "ct")
    return (quantize_mxfp4_ocp if rule == "ocp" else quantize_mxfp4_ct)(w)


def in_dim(case: Case) -> int:
    """The input dim I: the config's latent (w1/w3's, 3584 at k3), knob 'in_dim' (an int), or
    'off_tile' (explicit knob-sweep cases): the smallest odd multiple of the 32-wide group at or above
    the latent (64 -> 96, 3584 -> 3616), which no 64-, 128- or 256-column tile divides."""
    I = case.knob("in_dim", get_config(case.config).latent)
    if I == "off_tile":
        q = -(-get_config(case.config).latent // GROUP)
        return GROUP * (q if q % 2 else q + 1)
    return int(I)


def exhaustive_codes(case: Case, rows: int):
    """(packed, scale) of `rows` rows of 256 groups that pair every E8M0 scale byte (0..255, 0xFF = NaN)
    with every E2M1 code (each group holds the 16 codes twice), in a per-row random order: 4096 values
    per row, every one the format has. The drawn dists reach the range's edges in some dtypes only by
    chance (a dequant into fp16 that flushed subnormals or saturated at 65504 was certified at ci)."""
    g = gen_for(case, "exhaustive")
    order = torch.rand(rows, 256, GROUP, generator=g).argsort(-1)        # each group's own shuffle
    codes = torch.arange(16).repeat(GROUP // 16)[order].reshape(rows, 256 * GROUP).to(torch.uint8)
    scale = torch.stack([torch.randperm(256, generator=g) for _ in range(rows)]).to(torch.uint8)
    return pack_fp4(codes), scale


def make_mxfp4_dequant_inputs(case: Case) -> OpInputs:
    if case.knob("codes") == "exhaustive":
        packed, scale = exhaustive_codes(case, case.batch)
        return OpInputs({"packed": packed, "scale": scale}, {"out_dtype": case.dtype})
    I = in_dim(case)
    packed, scale = mxfp4_weight(case, "w", (case.batch, I), I, case.dist)
    return OpInputs({"packed": packed, "scale": scale}, {"out_dtype": case.dtype})


def mxfp4_dequant_bytes(inputs: OpInputs) -> int:
    """packed (two codes a byte) and scale (a byte per 32-wide group) read, w [O, I] written."""
    O, half = inputs.tensors["packed"].shape
    I = 2 * half
    out = torch.empty((), dtype=DTYPES[inputs.params["out_dtype"]]).element_size()
    return O * half + O * (I // 32) + O * I * out


def row_ranges(n: int, T: int) -> list[tuple[int, int]]:
    check_tp(T)
    per = -(-n // T)
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(T)]


def _shard_rows(inputs: OpInputs, T: int) -> list[RankShard]:
    O = inputs.tensors["packed"].shape[0]
    return [RankShard({k: v[lo:hi].clone() for k, v in inputs.tensors.items()}, dict(inputs.params))
            for lo, hi in row_ranges(O, T)]


def _concat_rows(per_rank: list[dict], inputs: OpInputs) -> dict:
    return {"w": torch.cat([res["w"] for res in per_rank], dim=0)}


OPS = [
    OpDef(
        name="mxfp4_dequant", family="mxfp4", reference="references.mxfp4:mxfp4_dequant",
        make_inputs=make_mxfp4_dequant_inputs, outputs=("w",),
        signature=("packed[O,I/2] uint8 (low nibble = even column), scale[O,I/32] uint8 (E8M0, 0xFF = NaN), "
                   "out_dtype: str -> w[O,I] out_dtype"),
        batch_dims={"packed": 0, "scale": 0, "w": 0},
        split=SplitRule(kind="column", shard=_shard_rows, combine=_concat_rows,
                        reduction_order="none: output rows split over ranks (ceil ranges), concatenated"),
        fused="fused.mxfp4_dequant:mxfp4_dequant",
        # bench: a 7168-row weight (split by rows over T): its batch is weight rows, not decode tokens
        moved_bytes=mxfp4_dequant_bytes, bench_batches=(7168,),
        dists=GENERIC_DISTS + ("mxfp4_grid",), knob_sweep=({"in_dim": "off_tile"}, {"codes": "exhaustive"}),
        notes="dtypes are the output dtype (inputs are uint8). O = case.batch rows, I = config latent "
              "(knob 'in_dim'; 'off_tile': an odd multiple of the 32-wide group, in every run; knob codes='exhaustive', "
              "in every run and every output dtype: I = 8192, every scale byte with every code). wide_range "
              "draws every scale byte 0..255, so NaN and overflow are covered.",
    ),
]
