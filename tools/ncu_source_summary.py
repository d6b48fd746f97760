"""Warp-stall samples of `ncu --page source --print-source sass --csv` of a `verify-kernels bench
--profile-kernels ncu` report, grouped per kernel by SASS opcode: which instructions the warps wait
at, and for what.

    ncu --import OUT/profile/bench.ncu-rep --page source --print-source sass --csv > source.csv
    python3 tools/ncu_source_summary.py source.csv [--top 12] [--kernel SUBSTR]
"""
from __future__ import annotations

import argparse
import csv
import io
import re
from collections import Counter, defaultdict


def kernels(path: str):
    """(kernel name, rows) per kernel section of the csv (each section starts with a "Kernel Name" line)."""
    text = open(path, encoding="utf-8", errors="replace").read()
    parts = re.split(r'^"Kernel Name","([^"]*)",?\s*$', text, flags=re.M)
    for i in range(1, len(parts) - 1, 2):
        rows = list(csv.DictReader(io.StringIO(parts[i + 1].strip())))
        yield parts[i], rows


def num(x) -> float:
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def summarise(name: str, rows: list[dict], top: int) -> str:
    by_op, reasons = Counter(), defaultdict(Counter)
    stall_cols = [c for c in (rows[0].keys() if rows else ()) if c.startswith("stall_") and "Not Issued" not in c]
    for r in rows:
        op = (r.get("Source") or "").split()
        op = next((t for t in op if not t.startswith("@")), "?").split(".")[0]
        s = num(r.get("Warp Stall Sampling (All Samples)"))
        by_op[op] += s
        for c in stall_cols:
            reasons[op][c[6:]] += num(r.get(c))
    total = sum(by_op.values()) or 1.0
    out = [f"{name[:110]}  ({int(total)} samples)"]
    for op, s in by_op.most_common(top):
        why = ", ".join(f"{k} {v / total:.0%}" for k, v in reasons[op].most_common(3) if v)
        out.append(f"  {op:<10} {s / total:6.1%}   {why}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--kernel", default="")
    a = ap.parse_args()
    for i, (name, rows) in enumerate(kernels(a.csv)):
        if a.kernel in name:
            print(f"[{i}] " + summarise(name, rows, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
