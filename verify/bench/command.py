"""`verify-kernels bench`: the arguments and the command. Nothing heavy is imported at module level
(the CLI builds its parser from `add_args` on every start).

Exit status: 0 every asked candidate certified and timed at every shape; 1 a candidate refused (no
passing verdict), one that failed to time, or shapes the time budget did not reach; 2 bad usage or
no CUDA device. A row that misses the speed rule does not change it (a miss is listed, not a failure).
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
DEFAULT_TPS = "1,8,16"
DEFAULT_BATCHES = "1,2,4,8,16,32,64"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=None, help="comma-separated op names (default: every op with a fused kernel)")
    p.add_argument("--candidate", default="fused",
                   help="fused | compiled | module:attr, comma-separated (default: fused); timed only where "
                        "they hold a passing verdict")
    p.add_argument("--tp", default=DEFAULT_TPS, help=f"T values; each shape is one rank's (default {DEFAULT_TPS})")
    p.add_argument("--batch", default=DEFAULT_BATCHES, help=f"batch sizes B (default {DEFAULT_BATCHES})")
    p.add_argument("--out", default=None,
                   help="directory for bench.json and bench.html (default: beside --certificate, else "
                        "verify-out/bench)")
    p.add_argument("--json", action="store_true", help="print the bench record JSON on stdout")
    p.add_argument("--certificate", default=None, metavar="CERT.json",
                   help="verdicts to gate on, comma-separated files (default: certify the quick profile first)")
    p.add_argument("--profile-kernels", default=None, choices=["ncu", "torch"],
                   help="also profile each timed entry once: Nsight Compute, or torch.profiler tables")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop starting new shapes after S seconds, shared over the ops; the rest are listed")


class UsageError(Exception):
    pass


def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a comma-separated list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{flag} {text!r}: needs integers of 1 or more")
    return vals


def _setup(args):
    from pathlib import Path

    from verify.ops.registry import UnknownOpError, all_ops, select_ops

    try:
        ops = select_ops(args.ops) if args.ops else [o for o in all_ops().values() if o.fused]
    except UnknownOpError as e:
        raise UsageError(str(e)) from None
    labels = [c.strip() for c in args.candidate.split(",") if c.strip()]
    if not labels:
        raise UsageError(f"--candidate {args.candidate!r}: names nothing")
    for label in labels:
        if label not in ("fused", "compiled", "reference") and ":" not in label:
            raise UsageError(f"--candidate {label!r}: expected fused, compiled, reference or 'module:attr'")
    tps, batches = _ints("--tp", args.tp), _ints("--batch", args.batch)
    certs = [c for c in (args.certificate or "").split(",") if c.strip()]
    for c in certs:
        if not Path(c).is_file():
            raise UsageError(f"--certificate {c}: no such file")
    out = Path(args.out) if args.out else (Path(certs[0]).parent if certs else Path("verify-out") / "bench")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if not certs and _foreign_certificate(out / "certificate.json"):
        raise UsageError(f"--out {out}: holds a certificate of `verify-kernels run`; gate on it with --certificate "
                         f"{out / 'certificate.json'}, or give another --out (the quick certification writes one there)")
    if args.time_budget is not None and not args.time_budget > 0:
        raise UsageError(f"--time-budget {args.time_budget:g}: must be a positive number of seconds")
    return ops, labels, tps, batches, certs, out


def _foreign_certificate(path) -> bool:
    """A certificate there that a bench run did not write (its quick certification would replace it)."""
    import json

    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("options", {}).get("by") != "verify-kernels bench"
    except (OSError, ValueError, AttributeError):
        return True


def cmd_bench(args) -> int:
    try:
        ops, labels, tps, batches, certs, out = _setup(args)
    except UsageError as e:
        print(f"verify-kernels bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    import torch

    if not torch.cuda.is_available():
        print("verify-kernels bench: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return EXIT_USAGE
    from verify.bench import profile as prof

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if args.profile_kernels == "ncu" and not os.environ.get(prof.NVTX_ENV):
        return prof.run_under_ncu(argv, out)
    return _bench(args, ops, labels, tps, batches, certs, out, argv)


def _bench(args, ops, labels, tps, batches, certs, out, argv, device: str = "cuda", clock=None) -> int:
    """The run itself; device and clock are parameters for a CPU dry run of the plumbing (tests)."""
    import json

    from rich.console import Console

    from verify.bench import certified, html, output, run, score
    from verify.bench import profile as prof
    from verify.bench.timing import GraphClock
    from verify.record.certificate import environment

    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 200)
    out.mkdir(parents=True, exist_ok=True)
    torch_settings()
    try:
        gate = (certified.from_certificates(ops, labels, certs, device) if certs
                else certified.by_quick_certification(ops, labels, device, out, log=console.print))
    except ValueError as e:
        console.print(f"verify-kernels bench: --certificate: {e}")
        return EXIT_USAGE
    for x in gate.refused:
        console.print(f"[bold red]refused[/] {x['op']} / {x['candidate']}: {x['state']}: {x['reason']}")
    plan = run.Plan(ops=[o for o in ops if o.name in gate.applies], candidates=gate.applies, allowed=gate.allowed,
                    tps=tps, batches=batches, device=device, budget_s=args.time_budget)
    hook = {"torch": prof.torch_profiler(out), "ncu": prof.nvtx_marker()}.get(args.profile_kernels)
    options = {"ops": [o.name for o in plan.ops], "candidates": labels, "tp": tps, "batch": batches,
               "certificate": certs or None, "profile_kernels": args.profile_kernels, "time_budget": args.time_budget}
    env = environment(device)
    partial = {"rows": [], "not_reached": [], "notes": {}}

    def on_row(row: dict) -> None:             # the record so far, on disk after every row (a cut run keeps it)
        partial["rows"].append(row)
        console.print(f"{row['op']} {row['shape']}: " + ", ".join(
            f"{k} {v['median_us']:.2f}" for k, v in row["timings"].items()) + f" ({row['seconds']} s)")
        output.write(output.record(env, argv, options, gate, partial, {}), out)

    result = run.bench_all(plan, clock or GraphClock(), on_row, hook)
    scores = score.summary(result["rows"], labels, gate.certified_ops())
    rec = output.record(env, argv, options, gate, result, scores)
    path = output.write(rec, out)
    (out / "bench.html").write_text(html.page(rec))
    output.print_report(console, rec, path)
    if args.json:
        print(json.dumps(rec, indent=1, default=str))
    failed = gate.refused or rec["not_reached"] or any(
        c in gate.allowed.get(r["op"], {}) and ("eager" if c == "reference" else c) not in r["timings"]
        for r in rec["rows"] for c in r["candidates"])
    return EXIT_FAIL if failed else EXIT_OK


def torch_settings() -> None:
    """fp32 matmuls stay fp32 (no TF32) in every entry, as the references are judged."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import logging

    torch._logging.set_logs(dynamo=logging.ERROR)      # graph-break notes of the references, once per shape
