"""Whether two certificates judged the same thing alike: per op its source hashes and, per candidate,
the verdict and every case record, timings left out. What a merge of shards must give against the
same plan judged in one process.

    python -m verify.record.compare A.json B.json      # exit 0 when equal, else 1 with the differences
"""
from __future__ import annotations

import sys

from verify.record import certificate


def judged_view(cert: dict) -> dict:
    out = {}
    for op, e in cert["ops"].items():
        verdicts = {c: {k: v for k, v in d.items() if k != "seconds"} for c, d in e["verdicts"].items()}
        cases = {c: [{k: v for k, v in r.items() if k != "seconds"} for r in rs] for c, rs in e["cases"].items()}
        out[op] = (e["sources"], verdicts, cases)
    return out


def differences(a: dict, b: dict) -> list[str]:
    va, vb = judged_view(a), judged_view(b)
    out = [f"{op}: only in {'the first' if op in va else 'the second'}" for op in sorted(set(va) ^ set(vb))]
    for op in sorted(set(va) & set(vb)):
        for what, x, y in zip(("sources", "verdicts", "cases"), va[op], vb[op]):
            if x != y:
                out.append(f"{op}: {what} differ")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m verify.record.compare A.json B.json", file=sys.stderr)
        return 2
    a, b = (certificate.load(p) for p in argv)
    diffs = differences(a, b)
    n = sum(len(rs) for e in a["ops"].values() for rs in e["cases"].values())
    print("\n".join(diffs) if diffs else f"equal: {len(a['ops'])} ops, {n} case records, verdicts and sources")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
