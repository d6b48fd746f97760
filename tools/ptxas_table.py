"""Registers per thread and spill bytes of fused kernels' launch variants, on the CPU machine: each
variant is compiled for sm_90a in a fresh process with its PTX dumped, and the CUDA toolkit's ptxas -v
reads it. What the H200 would run (the driver JITs the same PTX with the same ptxas rules), without
device time: a variant whose registers do not fit the CTAs per SM its dispatcher assumes, or that
spills, shows here first (a row-chunked kda kernel at 194 registers did).

    python3 tools/ptxas_table.py [kda] [attn] [--jobs 2]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def regs(code: str) -> tuple[int, int] | str:
    """(registers, spill-store bytes) of the one kernel `code` compiles, or the error."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, CUTE_DSL_DUMP_DIR=d, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP_PTX="1",
                   CUTE_DSL_DISABLE_FILE_CACHING="1")
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
        ptx = [f for f in os.listdir(d) if f.endswith(".ptx")]
        if r.returncode or len(ptx) != 1:
            return (r.stderr.strip().splitlines() or ["no PTX dumped"])[-1]
        out = subprocess.run([shutil.which("ptxas") or "ptxas", "-arch=sm_90a", "-v", os.path.join(d, ptx[0]),
                              "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
        used, spill = re.findall(r"Used (\d+) registers", out), re.findall(r"(\d+) bytes spill stores", out)
        return (int(used[0]), int(spill[0]) if spill else 0) if used else out.strip()


def ctas_per_sm(regs: int, warps: int) -> int:
    """CTAs of `warps` warps an sm_90 SM holds by registers: registers go to a warp in units of 256,
    and each of the 4 sub-partitions has 16 K for the warps dealt to it (Nsight Compute's "Block Limit
    Registers": 1 CTA at 134 registers x 7 warps, where the SM's 64 K alone would fit 2)."""
    per_warp = -(-regs // 8) * 8 * 32
    c = 0
    while -(-(c + 1) * warps // 4) * per_warp <= 16384 and c < 32:
        c += 1
    return c


def kda_rows():
    from fused import kda_decode as m
    for cfg in m.KdaConfig.all_configs() + m.KdaConfig.trial_configs():
        yield ("kda_decode", cfg.name, "bf16 Dh=128", 32 * cfg.num_warps,
               f"from fused import kda_decode as m; m._compile('bfloat16', 128, 4, m.{cfg!r})")   # dataclass repr


def attn_rows():
    from fused import attn_res_rmsnorm as m
    for cfg in m.AttnResConfig.all_configs(7168):
        for nb in (0, 5, 8):
            yield ("attn_res_rmsnorm", f"t{cfg.num_threads}c{cfg.cluster_n}", f"bf16 D=7168 nb={nb}", cfg.num_threads,
                   f"from fused import attn_res_rmsnorm as m; m._compile('bfloat16', 7168, {nb}, "
                   f"m.AttnResConfig({cfg.num_threads}, {cfg.cluster_n}))")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*", default=["kda", "attn"])
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    sys.path.insert(0, ROOT)
    rows = [r for op in a.ops for r in {"kda": kda_rows, "attn": attn_rows}[op]()]
    with ThreadPoolExecutor(a.jobs) as ex:
        got = list(ex.map(lambda r: regs(r[4]), rows))
    print(f"{'op':<18} {'launch':<14} {'static':<22} {'regs':>5} {'spill B':>8} {'CTAs/SM by regs':>16}")
    for (op, name, static, threads, _), g in zip(rows, got):
        if isinstance(g, str):
            print(f"{op:<18} {name:<14} {static:<22} error: {g[:80]}")
            continue
        print(f"{op:<18} {name:<14} {static:<22} {g[0]:>5} {g[1]:>8} {ctas_per_sm(g[0], -(-threads // 32)):>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
