"""`verify-kernels bench --spec-decode DESIGNS`: the command around verify.spec_decode.timing (the
bench's arguments, usage errors and device check; the table and the record written to --out). The CLI
routes `bench` here when --spec-decode is given."""
from __future__ import annotations

import sys

from verify.bench.command import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError, _has_cuda, _ints, torch_settings


def cmd_bench_spec_decode(args) -> int:
    """--spec-decode: time the designs (verify.spec_decode.timing), print and write the table
    (spec_decode.md) and the record (spec_decode.json, with the environment and the command) to --out."""
    import json
    from pathlib import Path

    try:
        names = [n.strip() for n in args.spec_decode.split(",") if n.strip()]
        if not names:
            raise UsageError(f"--spec-decode {args.spec_decode!r}: names no design")
        if not 1 <= args.n_q <= 8:
            raise UsageError(f"--n-q {args.n_q}: must be in 1..8")
        tps, batches = _ints("--tp", args.tp), _ints("--batch", args.batch)
        from verify.spec_decode.command import _factory
        for n in names:
            try:
                _factory(n, "cpu")
            except ValueError as e:
                raise UsageError(str(e).replace("--design", "--spec-decode", 1)) from None
    except UsageError as e:
        print(f"verify-kernels bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not _has_cuda():
        return EXIT_USAGE
    from verify.record.certificate import environment
    from verify.spec_decode import timing

    out = Path(args.out) if args.out else Path("verify-out") / "bench"
    out.mkdir(parents=True, exist_ok=True)
    torch_settings()
    record = {"by": "verify-kernels bench --spec-decode", "argv": list(getattr(args, "argv", None) or sys.argv[1:]),
              "environment": environment("cuda"), "n_q": args.n_q, "designs": names, "rows": [], "refused": {}}

    def save(rows):
        record["rows"] = [r.__dict__ for r in rows]
        (out / "spec_decode.json").write_text(json.dumps(record, indent=1))
        (out / "spec_decode.md").write_text(timing.table(rows, [n for n in names if n not in record["refused"]],
                                                           args.n_q) + "\n")

    done = []

    def on_row(row):
        done.append(row)
        print(f"T={row.T} B={row.B}: " + ", ".join(f"{k} {v['median_us']:.1f} us" for k, v in row.timings.items())
              + "".join(f"; {k} not timed: {v}" for k, v in row.refused.items()), flush=True)
        save(done)

    refused = record["refused"] = timing.gate(names, args.n_q, seed=0)
    rows = timing.time_designs([n for n in names if n not in refused], tps, batches, args.n_q, seed=0, on_row=on_row)
    save(rows)
    for n, why in refused.items():
        print(f"refused {n}: {why}")
    print(timing.table(rows, [n for n in names if n not in refused], args.n_q))
    print(f"written: {out / 'spec_decode.json'}, {out / 'spec_decode.md'}")
    return EXIT_FAIL if refused or any(r.refused for r in rows) else EXIT_OK
