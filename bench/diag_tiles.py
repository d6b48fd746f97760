"""Do skinny_gemm's tiled defaults (WGMMA_TILES) give their plain twins' bits on the harness's own
inputs? For the skinny_gemm cases whose worst ratio rose in the session-12 re-certification, and
a sweep of fresh cases: every tiled variant of the case's bucket against its plain twin, bitwise; on a
difference, where (rows within the tile, tokens) and by how many ulps.

    python3 bench/diag_tiles.py --out $OUT      # diag_tiles.log
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fused import skinny_gemm as sg  # noqa: E402
from fused import skinny_gemm_wgmma as wg  # noqa: E402
from verify.model.case import Case  # noqa: E402
from verify.ops.registry import get_op  # noqa: E402

CASES = [(42, 824708, "float16", "normal"), (1, 824708, "float16", "normal"), (54, 384246, "float16", "heavy_tailed"),
         (37, 821934, "float16", "zero_rows"), (62, 62, "float16", "outliers"), (13, 31118, "float16", "normal"),
         (52, 52, "bfloat16", "heavy_tailed"), (35, 0, "bfloat16", "heavy_tailed"), (50, 10000000, "bfloat16", "zero_rows")]
LINES = []


def log(m):
    print(m, flush=True)
    LINES.append(m)


def check(case):
    op = get_op("skinny_gemm")
    inp = op.make_inputs(case)
    x, w = (inp.tensors[k].cuda() for k in ("x", "w"))
    N, K = w.shape
    bad = 0
    for v in sg.variants({"x": x, "w": w}, {}):
        if not isinstance(v, wg.SkinnyGemmWgmmaConfig) or (v.bk == wg.BK and not v.step):
            continue
        plain = dataclasses.replace(v, bk=wg.BK, step=0, stages=wg.stages_for(v.rows, v.m_pad, v.occupancy))
        for name, xx, ww in (("as drawn", x, w), ("contiguous", x.contiguous(), w.contiguous())):
            a = sg.skinny_gemm(xx, ww, variant=v)
            b = sg.skinny_gemm(xx, ww, variant=plain)
            a2 = sg.skinny_gemm(xx, ww, variant=v)
            torch.cuda.synchronize()
            same = torch.equal(a.view(torch.int16), b.view(torch.int16))
            det = torch.equal(a.view(torch.int16), a2.view(torch.int16))
            msg = f"{case.short()} N={N} K={K} {v.name} vs {plain.name} [{name}, x {tuple(xx.stride())} w {tuple(ww.stride())}]: same={same} det={det}"
            if not same:
                bad += 1
                d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
                idx = d.nonzero()
                cols = idx[:, 1]
                step = v.step or v.rows
                log(msg + f" differing {idx.shape[0]} of {d.numel()}, max {d.max().item()} ulp; tokens "
                    f"{sorted(set(idx[:, 0].tolist()))[:10]}; col % step {sorted(set((cols % step).tolist()))[:16]}; "
                    f"cols {cols[:8].tolist()}")
            else:
                log(msg)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    bad = 0
    for B, seed, dt, dist in CASES:
        bad += check(Case("skinny_gemm", seed, B, "k3", dt, dist))
    for s in range(24):                                       # fresh: every projection, both dtypes
        bad += check(Case("skinny_gemm", 1000 + s, 1 + (s * 7) % 64, "k3", ("bfloat16", "float16")[(s // 4) % 2]))
    log(f"DONE {bad} differing launches")
    with open(os.path.join(args.out, "diag_tiles.log"), "w") as f:
        f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
