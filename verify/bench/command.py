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
    p.add_argument("--variants", action="store_true",
                   help="also time every launch variant a candidate's module declares (variants(tensors, params)) "
                        "at each shape, beside the one its dispatcher picks: which is fastest, by how much")
    p.add_argument("--spec-decode", default=None, metavar="DESIGNS",
                   help="time speculative-decoding rollback designs through KDA instead of ops: comma-separated "
                        "--design values of `spec-decode` (e.g. checkpoints:fused.kda_verify,one-token:"
                        "fused.kda_decode:kda_decode,checkpoints), each gated by a short contract run; per step "
                        "(verify + accept) over many steps of random accept lengths, beside one fused kda_decode token")
    p.add_argument("--n-q", type=int, default=6, dest="n_q",
                   help="with --spec-decode: draft tokens per sequence and step, 1..8 (default 6)")
    p.add_argument("--peer", action="append", default=[], metavar="OP:NAME=MODULE:ATTR",
                   help="also time a peer the registry does not declare, beside the op's own: MODULE:ATTR is a "
                        "function (tensors, params) -> zero-argument launch (verify/bench/peers.py), checked against "
                        "the reference like the declared ones and counted in the speed rule; repeatable")
    p.add_argument("--knobs", action="append", default=[], metavar="OP:K=V[,K=V]",
                   help="time OP at this knob set instead of its declared bench knobs; repeatable, one set each "
                        "(e.g. mla_decode_attn:q_per_seq=6,context=8192: context=N gives every sequence of a paged "
                        "attention op N cached slots)")
    p.add_argument("--isolate", action="store_true",
                   help="bench each (op, T, B) in a process of its own (records under OUT/rows/, merged into OUT): "
                        "no row runs in memory an earlier row left held, and a row that crashes its process is "
                        "listed with the exit while the next row runs (K3 layer and 896-expert rows)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="stop starting new shapes after S seconds (shapes run in rounds of one batch size of every "
                        "op, so a cut keeps a spread of batches for each); the rest are listed")


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
    return _with_knobs(_with_peers(ops, args.peer), args.knobs), labels, tps, batches, certs, out


def _require_benched(flag: str, spec: str, op_name: str, by_name: dict) -> None:
    if op_name not in by_name:
        raise UsageError(f"{flag} {spec!r}: op {op_name!r} is not among the benched ops ({', '.join(sorted(by_name))})")


def _with_peers(ops: list, specs: list[str]) -> list:
    """ops with each --peer OP:NAME=MODULE:ATTR added to its OP's declared peers (for this run only)."""
    import dataclasses

    from verify.model.opdef import Peer

    extra: dict[str, list] = {}
    by_name = {op.name: op for op in ops}
    for spec in specs:
        head, eq, path = spec.partition("=")
        op_name, colon, name = head.partition(":")
        if not (eq and colon and name and ":" in path):
            raise UsageError(f"--peer {spec!r}: expected OP:NAME=MODULE:ATTR")
        _require_benched("--peer", spec, op_name, by_name)
        taken = [p.name for p in by_name[op_name].peers] + [p.name for p in extra.get(op_name, [])]
        if name in taken:
            raise UsageError(f"--peer {spec!r}: {op_name} already has a peer named {name!r}")
        extra.setdefault(op_name, []).append(Peer(name, path))
    return [dataclasses.replace(op, peers=tuple(op.peers) + tuple(extra[op.name])) if op.name in extra else op
            for op in ops]


def _knob_value(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def _with_knobs(ops: list, specs: list[str]) -> list:
    """ops with their bench knob sets replaced by the --knobs OP:K=V[,K=V] sets given for them (this run only)."""
    import dataclasses

    from verify.bench.shapes import knob_error

    sets: dict[str, list[dict]] = {}
    by_name = {op.name: op for op in ops}
    for spec in specs:
        op_name, colon, body = spec.partition(":")
        pairs = [kv.partition("=") for kv in body.split(",")]
        if not (colon and body and all(k.strip() and eq and v.strip() for k, eq, v in pairs)):
            raise UsageError(f"--knobs {spec!r}: expected OP:K=V[,K=V]")
        _require_benched("--knobs", spec, op_name, by_name)
        knobs = {k.strip(): _knob_value(v.strip()) for k, _, v in pairs}
        problem = knob_error(by_name[op_name], knobs)
        if problem:
            raise UsageError(f"--knobs {spec!r}: {problem}")
        sets.setdefault(op_name, []).append(knobs)
    return [dataclasses.replace(op, bench_knobs=tuple(sets[op.name])) if op.name in sets else op for op in ops]


def _has_cuda() -> bool:
    """A CUDA device is there; else the one-line usage error, printed."""
    import torch

    if torch.cuda.is_available():
        return True
    print("verify-kernels bench: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
    return False


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
    if not _has_cuda():
        return EXIT_USAGE
    from verify.bench import profile as prof

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if args.profile_kernels == "ncu" and not os.environ.get(prof.NVTX_ENV):
        return prof.run_under_ncu(argv, out)
    if getattr(args, "isolate", False):
        from verify.bench import isolate

        return isolate.bench_isolated(args, ops, labels, tps, batches, certs, out, argv)
    return _bench(args, ops, labels, tps, batches, certs, out, argv)


def _bench(args, ops, labels, tps, batches, certs, out, argv, device: str = "cuda", clock=None) -> int:
    """The run itself; device and clock are parameters for a CPU dry run of the plumbing (tests).

    Nothing timed is lost to a cut: bench.json and bench.md (its tables for results/) are rewritten
    after every row with the shapes not yet timed listed as pending; bench.txt (the terminal report)
    every few rows and after every round; SIGTERM (what `timeout` sends) stops the run between two
    steps and writes them and bench.html with the rest listed."""
    import signal

    from rich.console import Console

    from verify.bench import run
    from verify.bench import profile as prof
    from verify.bench.timing import GraphClock
    from verify.record.certificate import environment

    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 200)
    out.mkdir(parents=True, exist_ok=True)
    torch_settings()
    previous = _on_sigterm(_interrupt)
    try:
        gate = gate_candidates(ops, labels, certs, device, out, console)
        if isinstance(gate, int):
            return gate
        plan, options = plan_and_options(args, ops, gate, labels, tps, batches, certs, device)
        hook = {"torch": prof.torch_profiler(out), "ncu": prof.nvtx_marker()}.get(args.profile_kernels)
        saver = _Saver(out, environment(device) | bench_versions(), argv, options, gate, labels)
        from verify.bench import shapes

        planned = {o.name: len(shapes.shapes_for(o, tps, batches)[0]) for o in plan.ops}
        console.print(f"bench: {sum(planned.values())} shapes (" + ", ".join(f"{k} {v}" for k, v in planned.items()) +
                      ")" + (f", time budget {args.time_budget:g} s" if args.time_budget else ""))

        def on_row(row: dict, state: dict) -> None:
            console.print(f"{row['op']} {row['shape']}: " + (", ".join(
                f"{k} {v['median_us']:.2f}" for k, v in row["timings"].items()) or "not timed") +
                f" ({row.get('seconds', 0)} s)")
            saver.save(state)

        try:
            result = run.bench_all(plan, clock or GraphClock(), on_row, hook,
                                   on_round=lambda st: saver.save(st, text=True))
        finally:
            _on_sigterm(signal.SIG_IGN)      # a second one would cut the writing short
        rec = saver.save(result, html=True)
    finally:
        _on_sigterm(previous)
    return finish(console, rec, out, args, gate)


def plan_and_options(args, ops, gate, labels, tps, batches, certs, device: str):
    """The run's plan (the ops the gate applies to, its allowed candidates) and the record's options."""
    from verify.bench import run
    from verify.bench.isolate import inherited_failures

    plan = run.Plan(ops=[o for o in ops if o.name in gate.applies], candidates=gate.applies,
                    allowed=gate.allowed, tps=tps, batches=batches, device=device, budget_s=args.time_budget,
                    variants=getattr(args, "variants", False), failures=inherited_failures())
    options = {"ops": [o.name for o in plan.ops], "candidates": labels, "tp": tps, "batch": batches,
               "certificate": certs or None, "profile_kernels": args.profile_kernels,
               "time_budget": args.time_budget, "variants": getattr(args, "variants", False)}
    return plan, options


def gate_candidates(ops, labels, certs, device, out, console):
    """The gate (certified.Gate) of the asked candidates: the verdicts of --certificate, else a quick
    certification written to OUT; each refusal printed. An exit status instead where there is none."""
    from verify.bench import certified, run

    try:
        gate = (certified.from_certificates(ops, labels, certs, device) if certs
                else certified.by_quick_certification(ops, labels, device, out, log=console.print))
    except ValueError as e:
        console.print(f"verify-kernels bench: --certificate: {e}")
        return EXIT_USAGE
    except run.Interrupted as e:
        console.print(f"verify-kernels bench: {e} before any shape was timed (while gating the candidates)")
        return EXIT_FAIL
    for x in gate.refused:
        console.print(f"[bold red]refused[/] {x['op']} / {x['candidate']}: {x['state']}: {x['reason']}")
    return gate


def finish(console, rec: dict, out, args, gate) -> int:
    """The report of a written record, the JSON where asked, and the exit status (module docstring)."""
    import json

    from verify.bench import output

    output.print_report(console, rec, out / output.FILE)
    if args.json:
        print(json.dumps(rec, indent=1, default=str))
    failed = gate.refused or rec["not_reached"] or any(
        c in gate.allowed.get(r["op"], {}) and ("eager" if c == "reference" else c) not in r["timings"]
        for r in rec["rows"] for c in r["candidates"])
    return EXIT_FAIL if failed else EXIT_OK


def bench_versions() -> dict:
    """Versions of what the peers run on (None where not installed)."""
    from importlib import metadata

    out = {}
    for key, dist in (("triton", "triton"), ("fla_core", "fla-core")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    from stock import flashinfer_mla, flashmla

    out["flashmla"] = flashmla.source_commit()           # the FlashMLA commit of stock.flashmla's library
    out["flashinfer_mla"] = flashinfer_mla.version()     # FlashInfer version and commit of its MLA module
    return out


def _on_sigterm(handler):
    """Install a SIGTERM handler where Python allows one (the main thread); the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)
    return previous


def _interrupt(signum, frame):
    from verify.bench.run import Interrupted

    raise Interrupted(signal_name(signum))


def signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _Saver:
    """Writes the record so far: bench.json and bench.md (its tables) every time; bench.txt (the
    terminal report, a second to render at a full grid) at most every TEXT_EVERY_S and when asked
    (after each round);
    bench.html when asked (at the end: its plots take seconds; `html.page(output.load(bench.json))`
    draws it from a record cut by SIGKILL)."""

    TEXT_EVERY_S = 15.0

    def __init__(self, out, env: dict, argv: list[str], options: dict, gate, labels: list[str]):
        self.out, self.env, self.argv, self.options, self.gate, self.labels = out, env, argv, options, gate, labels
        self.plots: dict = {}         # op -> its plot against its rows (html.plots draws only what changed)
        self.text_at = None

    def save(self, state: dict, text: bool = False, html: bool = False) -> dict:
        import time

        from rich.console import Console

        from verify.bench import output, score

        scores = score.summary(state["rows"], self.labels, self.gate.certified_ops())
        rec = output.record(self.env, self.argv, self.options, self.gate, state, scores)
        path = output.write(rec, self.out)
        _atomic_write(self.out / "bench.md", output.markdown(rec))
        if text or html or self.text_at is None or time.monotonic() - self.text_at >= self.TEXT_EVERY_S:
            text = Console(record=True, width=250, file=_Null(), color_system=None)
            output.print_report(text, rec, path)
            _atomic_write(self.out / "bench.txt", text.export_text())
            self.text_at = time.monotonic()
        if html:
            try:
                from verify.bench import html as page

                _atomic_write(self.out / "bench.html", page.page(rec, self.plots))
            except Exception as e:  # noqa: BLE001  (the report is not the record: bench.json stands)
                print(f"verify-kernels bench: bench.html not written: {type(e).__name__}: {e}", file=sys.stderr)
        return rec


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _atomic_write(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def torch_settings() -> None:
    """fp32 matmuls stay fp32 (no TF32) in every entry, as the references are judged."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import logging

    torch._logging.set_logs(dynamo=logging.ERROR)      # graph-break notes of the references, once per shape
