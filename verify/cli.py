"""verify-kernels: certify kernels of a Kimi K3 decode layer against their references.

Heavy imports (torch, hypothesis, cutlass) are deferred so --help and list answer at once.
Exit codes: 0 every op certified by at least one candidate and none failed (skipped candidates are
listed), 1 an op failed or had no certified candidate (every one skipped), 2 bad usage or config,
130 interrupted (Ctrl-C or SIGTERM; a cut `run` writes the certificate of what it judged and
`run --resume` continues).
`run` isolates candidates in a worker process (--no-isolate to run in-process), appends every verdict
to OUT/run.jsonl (--resume continues a killed run, a cut op/candidate pair case by case), and writes
OUT/certificate.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141      # 128 + SIGINT, 128 + SIGPIPE, as a shell reports them


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):     # one line a tired engineer can act on, not the whole usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="verify-kernels",
        description="Certify fused kernels of a Kimi K3 decode layer against plain-PyTorch references. "
                    "With no command: `run` on every op with the default candidates.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    ls = sub.add_parser("list", help="every op with its class and reference")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    de = sub.add_parser("describe", help="signature, shapes, spec and split of one op")
    de.add_argument("op")
    de.add_argument("--json", action="store_true", help="machine-readable output")
    run = sub.add_parser("run", help="certify candidates op by op and write a certificate")
    add_run_args(run)
    rp = sub.add_parser("repro", help="rerun one case and print the worst elements")
    rp.add_argument("case", help="the case JSON printed with a failure")
    rp.add_argument("--candidate", default="reference",
                    help="fused | compiled | reference | module:attr | path/to/file.py:attr")
    rp.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    rep = sub.add_parser("report", help="one self-contained HTML page from a certificate")
    rep.add_argument("certificate", metavar="CERT.json")
    rep.add_argument("-o", "--output", default=None, help="HTML file (default: report.html beside CERT)")
    di = sub.add_parser("diff", help="new failures, fixed ops, error growth and judged code changed between two "
                        "certificates; speed changes between the bench records beside them (or two bench.json)")
    di.add_argument("old", metavar="OLD.json")
    di.add_argument("new", metavar="NEW.json")
    di.add_argument("--json", action="store_true", help="machine-readable output")
    me = sub.add_parser("merge", help="join the outputs of `run --shard I/N` runs of one plan into one certificate")
    me.add_argument("dirs", metavar="DIR", nargs="+", help="output directories of the shards")
    me.add_argument("--out", default="verify-out", help="directory for certificate.json (default: verify-out)")
    me.add_argument("--json", action="store_true", help="print the certificate JSON on stdout")
    me.add_argument("--junit", default=None, metavar="FILE", help="also write JUnit XML")
    me.add_argument("--changed-since", default=None, metavar="OLD.json",
                    help="carry forward from OLD.json the ops the shards did not judge (as their runs did)")
    me.add_argument("--partial", action="store_true",
                    help="outputs of a cut run: certify the op/candidate pairs whose every case was judged; "
                    "the others fail as incomplete")
    be = sub.add_parser("bench", help="time certified candidates beside eager, torch.compile, peers and a copy of "
                        "the op's bytes (needs a CUDA device)")
    from verify.bench.command import add_args as add_bench_args
    add_bench_args(be)
    sd = sub.add_parser("spec-decode", help="judge a speculative-decoding rollback design through KDA (--layer: "
                        "a whole KDA or MLA layer) over many verify+accept steps: each contract property's verdict")
    from verify.spec_decode.command import add_args as add_spec_decode_args
    add_spec_decode_args(sd)
    ck = sub.add_parser("check", help="which certificate still holds for this tree (the release gate)")
    ck.add_argument("certificates", metavar="CERT.json", nargs="+",
                    help="certificates to look in; per op, the newest verdict whose sources match the tree counts")
    ck.add_argument("--ops", default=None,
                    help="comma-separated op names (default: every op; with --candidate fused, those with a fused kernel)")
    ck.add_argument("--candidate", default="fused", help="fused | compiled | reference | module:attr (default: fused)")
    ck.add_argument("--profile", default=None, help="count only certificates run with this profile, e.g. release")
    ck.add_argument("--device", default=None, choices=["cpu", "cuda"], help="count only certificates run on this device")
    ck.add_argument("--full-scope", action="store_true",
                    help="refuse a verdict certified only in the candidate's declared scope (its module's DTYPES "
                         "or PARAMS); implied by --profile release")
    ck.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def add_run_args(run: argparse.ArgumentParser) -> None:
    run.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    run.add_argument("--candidate", default=None,
                     help="fused | compiled | reference | module:attr, comma-separated "
                          "(default: fused,compiled; reference with --distributed; fused with --sanitize)")
    run.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    run.add_argument("--profile", default="quick", help="quick | ci | release")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--tp", default=None, help="comma-separated T values for split cases, e.g. 1,2,4")
    run.add_argument("--examples", type=int, default=None, help="override the profile's cases per op")
    run.add_argument("--configs", default=None, help="restrict configs, e.g. k3 or tiny,small")
    run.add_argument("--dtypes", default=None, help="restrict working dtypes, e.g. bfloat16")
    run.add_argument("--out", default="verify-out", help="directory for certificate.json")
    run.add_argument("--json", action="store_true", help="print the certificate JSON on stdout")
    run.add_argument("--junit", default=None, metavar="FILE", help="also write JUnit XML")
    run.add_argument("--no-isolate", action="store_true",
                     help="run candidates in this process (faster; a crash or hang ends the run)")
    run.add_argument("--case-timeout", type=float, default=120.0, metavar="S",
                     help="seconds per case before a candidate counts as hung (isolated runs; default 120)")
    run.add_argument("--resume", action="store_true",
                     help="continue from OUT/run.jsonl: skip op/candidate pairs already finished, replay the "
                          "judged cases of a cut pair and evaluate only the rest (same settings as the log)")
    run.add_argument("--changed-since", default=None, metavar="OLD.json",
                     help="certify only ops whose sources changed since OLD.json; carry the rest forward")
    run.add_argument("--distributed", default=None, choices=["gloo", "nccl"],
                     help="real multi-process rank splits (one process per rank) for ops with a collective; "
                          "T from --tp (default 2,4)")
    run.add_argument("--sanitize", default=None, choices=["memcheck", "racecheck", "synccheck", "initcheck"],
                     help="run each op's GPU cases under compute-sanitizer with this tool")
    run.add_argument("--jobs", type=int, default=1, metavar="N",
                     help="judge the plan (or its --shard slice) in N child processes that share its cases "
                          "(one GPU each where several are visible; their logs under OUT/shards/)")
    run.add_argument("--threads", type=int, default=0, metavar="N",
                     help="torch intra-op threads for every case (default: torch's here); part of the plan, "
                          "since CPU BLAS results depend on it")
    run.add_argument("--shard", default=None, metavar="I/N",
                     help="judge only slice I of N of the plan (0 <= I < N) into OUT; join the N outputs with "
                          "`verify-kernels merge`")


def main(argv: list[str] | None = None) -> int:
    # a candidate's import path is read from where the command runs, as `python -m` reads it: the
    # console script starts with its own bin directory on sys.path, not the working directory, and
    # the repro lines it prints name modules of the user's tree
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run"] + argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    _terminate_as_interrupt()
    try:
        rc = {"list": cmd_list, "describe": cmd_describe, "run": cmd_run, "repro": cmd_repro,
              "report": cmd_report, "diff": cmd_diff, "check": cmd_check, "merge": cmd_merge,
              "bench": cmd_bench, "spec-decode": cmd_spec_decode}[args.command](args)
        sys.stdout.flush()            # a closed pipe raises here, inside the handler below, not at exit
        return rc
    except UsageError as e:
        print(f"verify-kernels: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:       # `verify-kernels list | head -3`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())      # the interpreter's final flush must not raise again
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"\nverify-kernels: interrupted{_resume_hint(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> None:
    """SIGTERM (a scheduler's or `timeout`'s stop) ends the command as Ctrl-C does: a cut run writes
    the certificate of what it judged and prints how to resume."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _resume_hint(args) -> str:
    """Where a cut `run` left its results and the command that continues it."""
    if args.command != "run" or getattr(args, "case_list", None):
        return ""
    import shlex

    again = list(args.argv) if args.argv and args.argv[0] == "run" else ["run", *args.argv]
    if "--resume" not in again:
        again.append("--resume")
    return (f"; every finished case is kept in {Path(args.out) / 'run.jsonl'}. Continue with:\n"
            f"  verify-kernels {shlex.join(again)}")


def _op_or_usage(name: str):
    from verify.ops.registry import UnknownOpError, get_op

    try:
        return get_op(name)
    except UnknownOpError as e:
        raise UsageError(str(e)) from None


def _spec_classes(name: str) -> dict[str, str]:
    """output -> class, read from the spec file as it stands (no validation, no torch: `list`)."""
    spec_dir = Path(__file__).resolve().parent.parent / "tolerance_specs"     # verify.model.specs.SPEC_DIR, without pydantic
    try:
        import tomllib
    except ModuleNotFoundError:      # Python 3.10
        import tomli as tomllib

    try:
        raw = tomllib.loads((spec_dir / f"{name}.toml").read_text())
        return {n: o.get("class", "?") for n, o in raw.get("outputs", {}).items()}
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def cmd_list(args) -> int:
    from verify.ops import index as op_index

    rows = [{"op": e["op"], "family": e["family"], "reference": e["reference"], "fused": e["fused"],
             "classes": _spec_classes(e["op"]), "split": e["split"]["kind"] if e["split"] else None}
            for e in op_index.load().values()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            cls = ",".join(sorted(set(r["classes"].values())))
            print(f"{r['op']:<28} {cls:<24} {r['reference']}")
    return EXIT_OK


def _wrapped(label: str, text: str, width: int) -> str:
    import textwrap

    return textwrap.fill(" ".join(str(text).split()), width=width, initial_indent=f"  {label}: ",
                         subsequent_indent="      ")


def cmd_describe(args) -> int:
    from verify.ops import index as op_index
    from verify.ops.registry import UnknownOpError
    from verify.model.specs import SpecError, load_spec

    try:
        e = op_index.lookup(args.op)
    except UnknownOpError as err:
        raise UsageError(str(err)) from None
    try:
        spec = load_spec(e["op"]).model_dump(by_alias=True)
    except SpecError as err:
        spec = {"error": str(err)}
    info = {**e, "spec": spec}
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return EXIT_OK
    import shutil

    width = min(100, shutil.get_terminal_size((100, 24)).columns)
    split = e["split"]
    lines = [f"{e['op']}  ({e['reference']})", _wrapped("signature", e["signature"], width),
             f"  outputs: {', '.join(e['outputs']) or '-'}; state: {', '.join(e['state']) or '-'}",
             f"  dtypes: {', '.join(e['dtypes'])}; configs: {', '.join(e['configs'])}; batch up to {e['max_batch']}",
             _wrapped("dists", ", ".join(e["dists"]), width),
             _wrapped("split", "none" if split is None else f"{split['kind']} over T in "
                      f"{', '.join(map(str, split['tp_values']))}; reduction order: {split['reduction_order']}", width),
             f"  fused: {e['fused'] or '-'}"]
    if "error" in spec:
        lines.append(_wrapped("spec", spec["error"], width))
    else:
        lines.append("  outputs judged:")
        for name, o in spec["outputs"].items():
            bounds = "" if o.get("k") is None else f": k = {o['k']:g}, floor = {o['floor_ulps']:g} ulps" + (
                f", element floor = {o['element_floor']:g}" if o.get("element_floor") else "")
            per = "".join(f"; {d}: k = {b['k']:g}, floor = {b['floor_ulps']:g} ulps"
                          for d, b in (o.get("by_dtype") or {}).items())
            lines.append(_wrapped(f"  {name}", f"{o['class']}{bounds}{per}", width))
        claims = spec.get("claims") or {}
        lines.append(_wrapped("claims", ", ".join(f"{k} = {v}" for k, v in claims.items()), width))
        if spec.get("waivers"):
            lines.append(f"  waivers: {len(spec['waivers'])} (see --json)")
        lines.append("  derivation:")
        # a paragraph per blank line, or per line opening with a heading ("Element rule (element_floor): ...")
        for para in re.split(r"\n\s*\n|\n(?=[^\n]{0,60}\): )", spec["derivation"].strip()):
            lines.append(_wrapped("  ", para, width).replace("    : ", "    ", 1))
    if e["notes"]:
        lines.append(_wrapped("notes", e["notes"], width))
    print("\n".join(lines))
    return EXIT_OK


def _resolve_device(requested: str | None) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device found on this machine")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def _candidates(text: str | None, device: str) -> list:
    from verify.judge.candidates import CandidateImportError, import_checked, is_tainted, parse_candidate

    labels = (text or "fused,compiled").split(",")
    out = []
    for label in (s.strip() for s in labels if s.strip()):
        try:
            cand = parse_candidate(label)
            if ":" in label:
                import_checked(label, device)
        except CandidateImportError as e:
            if not is_tainted(label):       # a module that imports but changes torch: its verdicts say so
                raise UsageError(f"--candidate: {e}") from None
        out.append(cand)
    return out


def restrict_profile(profile, configs: str | None, dtypes: str | None):
    """--configs / --dtypes narrow a profile (e.g. the real K3 shapes only on a GPU run)."""
    import dataclasses

    from verify.model.profile import CONFIG_ORDER

    if configs:
        wanted = tuple(c.strip() for c in configs.split(",") if c.strip())
        bad = [c for c in wanted if c not in CONFIG_ORDER]
        if bad:
            raise ValueError(f"--configs {','.join(bad)}: unknown; choose from {', '.join(CONFIG_ORDER)}")
        profile = dataclasses.replace(profile, configs=wanted)
    if dtypes:
        wanted = tuple(d.strip() for d in dtypes.split(",") if d.strip())
        bad = [d for d in wanted if d not in ("bfloat16", "float16", "float32")]
        if bad:
            raise ValueError(f"--dtypes {','.join(bad)}: unknown; choose from bfloat16, float16, float32")
        profile = dataclasses.replace(profile, dtypes=wanted)
    return profile


MAX_CASE_TIMEOUT_S = 86400.0


def _int_flag(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: not an integer") from None


def _check_out_paths(args) -> None:
    """--out must be a directory this process can create or write, --junit a file path whose folder
    exists or can be made: said before the run, not after it."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create it ({e.strerror or e})") from None
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {out}: not writable")
    junit = getattr(args, "junit", None)
    if junit:
        j = Path(junit)
        if j.is_dir():
            raise UsageError(f"--junit {j}: is a directory; give a file path")
        if j.parent.exists() and not j.parent.is_dir():
            raise UsageError(f"--junit {j}: its folder {j.parent} is not a directory")


def _run_setup(args):
    from verify.model.profile import get_profile, validate_tp
    from verify.ops.registry import UnknownOpError, select_ops

    try:
        ops = select_ops(args.ops)
        profile = restrict_profile(get_profile(args.profile), getattr(args, "configs", None),
                                   getattr(args, "dtypes", None))
        tps = validate_tp([_int_flag("--tp", t) for t in args.tp.split(",")]) if args.tp else None
    except (UnknownOpError, ValueError) as e:
        raise UsageError(str(e)) from None
    for flag, value in (("--ops", args.ops), ("--candidate", getattr(args, "candidate", None)),
                        ("--configs", getattr(args, "configs", None)), ("--dtypes", getattr(args, "dtypes", None)),
                        ("--tp", args.tp)):
        if value is not None and not [v for v in value.split(",") if v.strip()]:
            raise UsageError(f"{flag} {value!r}: names nothing (an empty run would certify nothing)")
    from verify.model.values import SEED_MODULUS
    if not 0 <= args.seed < SEED_MODULUS:
        raise UsageError(f"--seed {args.seed}: must be in 0..{SEED_MODULUS - 1}")
    if not (math.isfinite(args.case_timeout) and 0 < args.case_timeout <= MAX_CASE_TIMEOUT_S):
        raise UsageError(f"--case-timeout {args.case_timeout:g}: must be a number of seconds in (0, {MAX_CASE_TIMEOUT_S}]")
    _check_out_paths(args)
    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples {args.examples}: must be 1 or more (cases drawn per op and candidate)")
    modes = [m for m in ("resume", "changed_since", "distributed", "sanitize") if getattr(args, m)]
    if len(set(modes) - {"resume"}) > 1:
        raise UsageError(f"--{modes[0].replace('_', '-')} and --{modes[1].replace('_', '-')} cannot be combined")
    if getattr(args, "threads", 0) < 0:
        raise UsageError(f"--threads {args.threads}: must be 1 or more (0: torch's default)")
    jobs = getattr(args, "jobs", 1)
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: must be 1 or more")
    if jobs > 1 and set(modes) & {"distributed", "sanitize"}:
        raise UsageError(f"--jobs and --{(set(modes) & {'distributed', 'sanitize'}).pop()} cannot be combined")
    args.shard_of = _shard(args.shard)
    if args.shard_of != (0, 1) and set(modes) & {"distributed", "sanitize"}:
        raise UsageError("--shard judges one slice of a plain run; it cannot be combined with "
                         "--distributed or --sanitize")
    return ops, profile, tps


def _shard(text: str | None) -> tuple[int, int]:
    if text is None:
        return (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard {text!r}: expected I/N, e.g. 0/2") from None
    if not (n >= 1 and 0 <= i < n):
        raise UsageError(f"--shard {text}: needs N >= 1 and 0 <= I < N")
    return i, n


def cmd_run(args) -> int:
    from rich.console import Console

    from verify.record import certificate

    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 160)
    ops, profile, tps = _run_setup(args)
    if args.sanitize:
        from verify.run.sanitize import unavailable_reason

        why = unavailable_reason()
        if why:
            raise UsageError(f"--sanitize {args.sanitize}: {why}")
    device = "cuda" if args.sanitize or args.distributed == "nccl" else _resolve_device(args.device)
    candidates = _candidates(args.candidate or ("fused" if args.sanitize else "reference" if args.distributed
                                                 else None), device)
    carried = {}
    if args.changed_since:
        carried, changed = _carry_forward(args.changed_since, {o.name: o for o in ops}, [c.label for c in candidates])
        ops = [o for o in ops if o.name in changed]
        console.print(f"changed since {args.changed_since}: {', '.join(changed) or 'nothing'}; "
                      f"carried forward: {', '.join(carried) or 'nothing'}")
    if args.distributed or args.sanitize:
        return _run_special(args, ops, candidates, device, tps, console, carried)
    from verify.record.merge import assemble
    from verify.run.execute import PlanMismatch, run_jobs, run_slice
    from verify.run.runner import RunConfig, build_plan

    cfg = RunConfig(tuple(o.name for o in ops), tuple(c.label for c in candidates), device, profile, args.seed,
                    None if tps is None else tuple(tps), args.examples, not args.no_isolate, args.case_timeout,
                    certificate.harness_hash(), args.threads)
    plan = build_plan(cfg, ops, candidates)
    out = Path(args.out)
    console.print(f"plan {plan.id}: {len(plan.cases)} cases over {len(plan.pairs)} op/candidate pairs "
                  f"({out / 'plan.json'})")
    try:
        if args.jobs > 1:
            judged, problems = run_jobs(plan, cfg, out, args.jobs, args.resume, args.shard_of)
            for line in problems:
                console.print(f"[bold red]{line}[/]")
        else:
            judged = run_slice(plan, cfg, out, args.shard_of, args.resume, console)
    except PlanMismatch as e:
        raise UsageError(f"--resume: {e}") from None
    except KeyboardInterrupt:
        if args.shard_of == (0, 1):
            _certify_cut_run(args, plan, out, carried, console)
        raise
    if args.shard_of != (0, 1):
        mine = [judged.verdicts[pc.index] for pc in plan.slice(*args.shard_of) if pc.index in judged.verdicts]
        bad = [v for v in mine if v.status in ("fail", "unexpected_pass")]
        i, n = args.shard_of
        console.print(f"shard {i}/{n} of plan {plan.id}: {len(mine)} cases judged, {len(bad)} failed; "
                      f"join the {n} outputs with: verify-kernels merge DIR...")
        return EXIT_FAIL if bad else EXIT_OK
    verdicts, cert = assemble(plan, judged, carried, {"jobs": args.jobs})
    return _finish_run(args, verdicts, cert, console, f"{len(carried)} ops carried; log {out / 'run.jsonl'}")


def _certify_cut_run(args, plan, out: Path, carried: dict, console) -> None:
    """An interrupted run's certificate from the cases its logs hold: the pairs judged in full get their
    verdicts, the others fail as incomplete (as `merge --partial`). Never masks the interrupt."""
    import signal

    from verify.record.merge import assemble
    from verify.run.execute import judged_in

    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}   # written whole
    try:
        judged = judged_in([out], plan.id)
        if judged.verdicts:
            verdicts, cert = assemble(plan, judged, carried, {"jobs": args.jobs, "interrupted": True})
            _finish_run(args, verdicts, cert, console, f"interrupted after {len(judged.verdicts)} of "
                        f"{len(plan.cases)} cases")
    except Exception as e:  # noqa: BLE001 - the interrupt and its resume hint come first
        print(f"verify-kernels: the interrupted run's certificate was not written: {e}", file=sys.stderr)
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def _run_special(args, ops, candidates, device, tps, console, carried) -> int:
    """--distributed (one process per rank, real collectives) and --sanitize (compute-sanitizer):
    each draws its own few cases per op; the verdicts go straight into the certificate."""
    from verify.ops.registry import all_ops
    from verify.record import certificate
    from verify.run.runlog import case_record

    cases: dict = {}

    def on_case(v) -> None:
        cases.setdefault((v.op, v.candidate), []).append(case_record(v))

    verdicts = []
    if args.distributed:
        from verify.run.distributed import certify_distributed, collective_ops

        chosen = ops if args.ops else collective_ops(ops)
        for cand in candidates:
            verdicts += certify_distributed(chosen, cand.label, args.distributed, tps or [2, 4], args.seed,
                                            on_case=on_case)
    else:
        from verify.run.sanitize import sanitize_op

        verdicts = [sanitize_op(op, cand.label, args.sanitize, args.seed) for op in ops for cand in candidates]
    options = {"device": device, "seed": args.seed, "tp": tps, "distributed": args.distributed,
               "sanitize": args.sanitize, "candidates": [c.label for c in candidates], "ops": [o.name for o in ops],
               "harness": certificate.harness_hash()}
    cert = certificate.build(verdicts, all_ops(), options, device, cases, carried)
    return _finish_run(args, verdicts, cert, console, f"{len(carried)} ops carried")


def _finish_run(args, verdicts, cert, console, where: str) -> int:
    """Failures, the certificate (and JUnit), the summary table; the exit status."""
    from verify.record import certificate
    from verify.record.outcome import outcome
    from verify.record.reporters.terminal import print_failure, print_skips, summary_table
    from verify.model.verdict import FAIL, XPASS

    for v in verdicts:
        if v.status in (FAIL, XPASS):
            print_failure(console, v)
    from verify.bench.launches import record_layer_launches

    for line in record_layer_launches(cert, verdicts, cert.get("options", {}).get("device", "cpu")):
        console.print(f"launches: {line}", soft_wrap=True)
    path = certificate.write(cert, Path(args.out))
    if args.junit:
        from verify.record.reporters.junit import write_junit

        write_junit(verdicts, args.junit)
    console.print(summary_table(verdicts))
    print_skips(console, verdicts)
    result = outcome(verdicts)
    console.print(f"certificate: {path}  ({result.line()}; {where})", soft_wrap=True)
    if args.json:
        print(json.dumps(cert, indent=1, default=str))
    return EXIT_OK if result.ok else EXIT_FAIL


def _carry_forward(path: str, ops: dict, candidates: list[str]) -> tuple[dict, list[str]]:
    """--changed-since: (the entries of OLD.json whose sources are unchanged, the op names to judge)."""
    from verify.record import certificate

    try:
        old = certificate.load(path)
    except ValueError as e:
        raise UsageError(f"--changed-since: {e}") from None
    return certificate.carry_forward(old, ops, candidates)


def cmd_merge(args) -> int:
    from rich.console import Console

    from verify.record.merge import MergeError, assemble, load_shards

    _check_out_paths(args)
    try:
        plan, judged = load_shards([Path(d) for d in args.dirs], partial=args.partial)
    except MergeError as e:
        raise UsageError(f"merge: {e}") from None
    carried = {}
    if args.changed_since:
        from verify.ops.registry import all_ops

        unjudged = {n: o for n, o in all_ops().items() if n not in plan.options.get("ops", ())}
        carried, _ = _carry_forward(args.changed_since, unjudged, list(plan.options.get("candidates", ())))
    verdicts, cert = assemble(plan, judged, carried)
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 160)
    return _finish_run(args, verdicts, cert, console, f"merged {len(args.dirs)} outputs of plan {plan.id}; "
                       f"{len(carried)} ops carried")


def cmd_bench(args) -> int:
    if getattr(args, "spec_decode", None):
        if getattr(args, "isolate", False):
            raise UsageError("--isolate: applies to op rows, not to --spec-decode designs")
        from verify.spec_decode.bench import cmd_bench_spec_decode
        return cmd_bench_spec_decode(args)
    from verify.bench.command import cmd_bench as bench

    return bench(args)


def cmd_spec_decode(args) -> int:
    from verify.spec_decode.command import cmd_spec_decode as spec_decode

    try:
        return spec_decode(args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _bench_beside(cert_path: str):
    """The bench record beside a certificate (bench.json in its folder), or None."""
    from verify.bench import output

    p = Path(cert_path).with_name(output.FILE)
    return output.load(p) if p.is_file() and output.is_bench(p) else None


def cmd_report(args) -> int:
    from verify.record import certificate
    from verify.record.reporters.html import write_report

    try:
        cert = certificate.load(args.certificate)
        bench = _bench_beside(args.certificate)
    except ValueError as e:
        raise UsageError(str(e)) from None
    sections = []
    if bench is not None:
        from verify.bench.html import section

        sections.append(section(bench))
    out = Path(args.output) if args.output else Path(args.certificate).with_name("report.html")
    print(write_report(cert, out, sections))
    return EXIT_OK


def cmd_diff(args) -> int:
    """Two certificates (and the bench records beside them, if both have one), or two bench records."""
    from verify.record import certificate
    from verify.bench import diff as speed
    from verify.bench import output
    from verify.record.diff import diff, render_text

    try:
        if output.is_bench(args.old) or output.is_bench(args.new):
            d, old_b, new_b = None, output.load(args.old), output.load(args.new)
        else:
            old, new = certificate.load(args.old), certificate.load(args.new)
            d, old_b, new_b = diff(old, new), _bench_beside(args.old), _bench_beside(args.new)
    except ValueError as e:
        raise UsageError(str(e)) from None
    changes = speed.speed_diff(old_b, new_b) if old_b is not None and new_b is not None else None
    slower = speed.regressions(changes or [], speed.candidates_of(new_b) if new_b else None)
    if args.json:
        print(json.dumps({**(d.to_dict() if d else {}), **({"speed": speed.to_dict(changes)} if changes is not None
                                                          else {})}, indent=1))
    else:
        print("\n".join(t for t in (render_text(d) if d else "", speed.render_text(changes) if changes is not None
                                    else "") if t))
    return EXIT_FAIL if (d is not None and d.of("new_failure")) or slower else EXIT_OK


def cmd_check(args) -> int:
    from verify.record import certificate
    from verify.record import gate
    from verify.ops.registry import UnknownOpError, select_ops

    certs = []
    for path in args.certificates:
        try:
            certs.append((path, certificate.load(path)))
        except ValueError as e:
            raise UsageError(str(e)) from None
    try:
        ops = select_ops(args.ops)
    except UnknownOpError as e:
        raise UsageError(str(e)) from None
    if args.candidate == "fused" and not args.ops:
        ops = [o for o in ops if o.fused]
    states = gate.check(ops, certs, args.candidate, args.profile, args.device,
                        full_scope=args.full_scope or args.profile == "release")
    if args.json:
        print(json.dumps(gate.to_dict(states), indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"verify-kernels check: {args.candidate}")
        for col in ("op", "state", "judged", "certificate"):
            t.add_column(col, overflow="fold")
        for st in states:
            judged = f"{st.git_commit[:7]} {st.created[:10]} {st.profile}/{st.device}" if st.created else ""
            t.add_row(st.op, f"[{'green' if st.ok else 'bold red'}]{st.state}[/]", judged, st.certificate)
        console = Console()
        console.print(t)
        for st in states:
            if not st.ok:
                console.print(f"[bold red]{st.op}[/]: {st.state}: {st.detail}")
        bad = [st.op for st in states if not st.ok]
        print(f"{len(states) - len(bad)} of {len(states)} ops hold a passing verdict for this tree"
              + (f"; not: {', '.join(bad)}" if bad else ""))
    return EXIT_OK if all(st.ok for st in states) else EXIT_FAIL


def _check_case(case, op) -> None:
    """A case record names only what the harness can rebuild for this op, or the CLI says which field
    is wrong (rather than a failed "harness" verdict from deep inside the input builders)."""
    import dataclasses

    from references.config import CONFIGS
    from verify.model.case import Case
    from verify.model.values import DISTS, SEED_MODULUS

    def bad(field, why):
        raise UsageError(f"CASE {field}: {why} (op {op.name})")

    for field in ("seed", "batch", "tp"):
        v = getattr(case, field)
        if not isinstance(v, int) or isinstance(v, bool):
            bad(field, f"{v!r} is not an integer")
    if not 0 <= case.seed < SEED_MODULUS:
        bad("seed", f"{case.seed}: must be in 0..{SEED_MODULUS - 1}")
    if case.batch < 1:
        bad("batch", f"{case.batch}: must be 1 or more")
    for field, known in (("config", sorted(CONFIGS)), ("dtype", list(op.dtypes)), ("dist", list(DISTS))):
        if getattr(case, field) not in known:
            bad(field, f"{getattr(case, field)!r} is not one of {known}")
    tps = (1,) + (tuple(op.split.tp_values) if op.split is not None else ())
    if case.tp not in tps:
        bad("tp", f"{case.tp} is not one of {sorted(set(tps))}" + ("" if op.split else ": the op has no split rule"))
    if not all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in case.extra):
        bad("extra", f"{[list(kv) for kv in case.extra]} is not a list of [name, value] pairs")
    if case.extra:   # a knob the op's input builder never reads would be silently ignored
        read: set[str] = set()

        class Tracked(Case):
            def knob(self, key, default=None):
                read.add(key)
                return super().knob(key, default)

        tracked = Tracked(**dataclasses.asdict(case) | {"extra": case.extra})
        try:
            op.make_inputs(tracked)
        except Exception:  # noqa: BLE001  (the replay reports a builder failure as the case's verdict)
            return
        unread = [k for k, _ in case.extra if k not in read]
        if unread:
            bad("extra", f"{unread} not read by the op's input builder (it reads {sorted(read) or 'no knob'} here)")


def cmd_repro(args) -> int:
    from rich.console import Console

    from verify.model.case import Case
    from verify.run.runner import replay
    from verify.record.reporters.terminal import print_case
    from verify.model.verdict import PASS

    try:
        if not isinstance(json.loads(args.case), dict):
            raise ValueError("a JSON object is expected")
        case = Case.from_json(args.case)
    except (ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"CASE is not a case record: {e}") from None
    if not isinstance(case.op, str):
        raise UsageError(f"CASE op: {case.op!r} is not an op name")
    op = _op_or_usage(case.op)
    _check_case(case, op)
    device = _resolve_device(args.device)
    cand = _candidates(args.candidate, device)[0]
    from verify.judge.candidates import CandidateUnavailable

    try:
        v = replay(op, case, cand, device)
    except CandidateUnavailable as e:
        raise UsageError(f"candidate {cand.label} cannot run here: {e}") from None
    console = Console()
    print_case(console, v)
    for c in v.checks:
        if c.ok:
            console.print(f"  [green]ok[/] {c.name}: {c.detail}")
    return EXIT_OK if v.status == PASS else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
