"""Where a certification run's time goes: merge the per-case cProfile dumps a run wrote with
VERIFY_CPROFILE_DIR=DIR (verify/judge/pipeline.py) and print the top functions by cumulative and own time.

    VERIFY_CPROFILE_DIR=/tmp/prof verify-kernels run --ops attn_res_rmsnorm --candidate fused \\
        --device cuda --profile release --examples 30 --no-isolate
    python3 tools/profile_summary.py /tmp/prof [--top 40] [--match k3]
"""
import argparse
import io
import pstats
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--match", default="", help="only dumps whose file name contains this")
    args = ap.parse_args()
    files = sorted(p for p in Path(args.dir).glob("*.pstats") if args.match in p.name)
    if not files:
        raise SystemExit(f"{args.dir}: no *.pstats files{' matching ' + args.match if args.match else ''}")
    stats = pstats.Stats(str(files[0]), stream=io.StringIO())
    for f in files[1:]:
        stats.add(str(f))
    print(f"{len(files)} cases, {stats.total_tt:.1f} s in all")
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        stats.stream = buf
        stats.sort_stats(key).print_stats(args.top)
        print(f"== by {key}\n{buf.getvalue()}")


if __name__ == "__main__":
    main()
