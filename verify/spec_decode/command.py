"""`verify-kernels spec-decode`: drive a speculative-decoding rollback design through KDA over many
steps and print a verdict per contract property (verify.spec_decode.contract); with `--layer kda|mla`,
the whole layer step (references/layers_spec.py, its KDA attention through --design) under the layer
contract (verify.spec_decode.layer). Nothing heavy is imported at module level (the CLI builds its
parser from `add_args` on every start).

Exit status: 0 the design meets every property; 1 a violation (each printed with its step, sequence,
error against tolerance, and a repro command); 2 bad usage (the message names the argument and the fix).
"""
from __future__ import annotations

import argparse
import json
import shlex

EXIT_OK, EXIT_FAIL = 0, 1
CONFIGS = ("tiny", "small", "k3")
DTYPES = ("bfloat16", "float16", "float32")
MAX_N_Q = 8                 # query tokens per sequence in one verify (shared/OPS.md)
MAX_SEED = 2**31 - 1
SHOWN = 3                   # findings printed per property (--json: every one kept)
METHODS = ("begin", "verify", "accept", "committed", "rollback_buffers")
LAYERS = ("kda", "mla")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--design", default=None,
                   help="required without --layer; with --layer kda default checkpoints; not with --layer mla. "
                        "checkpoints[:MODULE] (its kda_verify and kda_accept, e.g. fused.kda_verify) | one-token[:MODULE:ATTR] | replay[:MODULE:ATTR] (over any kda_decode, e.g. "
                        "fused.kda_decode:kda_decode) | input-cache[:W] | MODULE:ATTR (a callable returning a "
                        "design: begin, verify, accept, committed, rollback_buffers)")
    p.add_argument("--layer", default=None, choices=LAYERS,
                   help="judge the whole layer step instead of the op: kda (its attention through --design) or "
                        "mla (references.mla's multi-query decode; takes no --design). Default: the KDA op alone")
    p.add_argument("--config", default="tiny", choices=CONFIGS, help="model dimensions (default: tiny)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="working dtype (default: bfloat16)")
    p.add_argument("--steps", type=int, default=64, help="verify+accept steps (default: 64)")
    p.add_argument("--batch", type=int, default=4, help="sequences B (default: 4)")
    p.add_argument("--n-q", type=int, default=8, dest="n_q", help=f"draft slots per sequence, 1..{MAX_N_Q} (default: 8)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default: cpu")
    p.add_argument("--seed", type=int, default=0, help="every input and accept length derives from it (default: 0)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads on the CPU (default 1: the tensors are small)")
    p.add_argument("--json", action="store_true", help="machine-readable verdict on stdout")


def _validated(args):
    """The Drive the arguments ask for; ValueError naming the argument otherwise."""
    from verify.ops.kda import DECODE_MAX_BATCH
    from verify.spec_decode.contract import Drive

    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: must be 2 or more (step 1 is where every sequence accepts 0; "
                         f"the growth property wants 64 or more)")
    if not 1 <= args.batch <= DECODE_MAX_BATCH:
        raise ValueError(f"--batch {args.batch}: must be in 1..{DECODE_MAX_BATCH}")
    if not 1 <= args.n_q <= MAX_N_Q:
        raise ValueError(f"--n-q {args.n_q}: must be in 1..{MAX_N_Q}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed {args.seed}: must be in 0..{MAX_SEED}")
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads}: must be 1 or more")
    common = dict(config=args.config, dtype=args.dtype, batch=args.batch, n_q=args.n_q, steps=args.steps,
                  seed=args.seed, device=args.device)
    if args.layer is None:
        if args.design is None:
            raise ValueError("the following arguments are required: --design (or --layer kda|mla for the layer "
                             "contract)")
        return Drive(**common)
    if args.layer == "mla" and args.design is not None:
        raise ValueError(f"--design {args.design!r}: --layer mla has no KDA rollback design (its attention is "
                         f"references.mla's); drop --design")
    from verify.spec_decode.layer import LayerDrive

    return LayerDrive(**common, kind=args.layer)


def _factory(name: str, device: str):
    """--design -> a factory whose product has every method of the protocol; ValueError otherwise."""
    from verify.spec_decode.design import DesignError, resolve_design

    try:
        factory = resolve_design(name, device)
    except DesignError as e:
        raise ValueError(str(e)) from None
    try:
        probe = factory()
    except Exception as e:
        raise ValueError(f"--design {name!r}: calling it with no arguments raised {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''} (a design factory takes none; a kda_decode "
                         f"goes after 'one-token:')") from None
    missing = [m for m in METHODS if not callable(getattr(probe, m, None))]
    if missing:
        raise ValueError(f"--design {name!r}: it returned a {type(probe).__name__} without {', '.join(missing)} "
                         f"(see verify/spec_decode/design.py; a kda_decode goes after 'one-token:')")
    return factory


def repro_command(design: str | None, drive, steps: int | None = None) -> str:
    layer = getattr(drive, "kind", None)
    argv = ["verify-kernels", "spec-decode"] + (["--layer", layer] if layer else [])
    argv += (["--design", design] if design else []) + ["--config", drive.config, "--dtype", drive.dtype,
            "--steps", str(steps or drive.steps), "--batch", str(drive.batch), "--n-q", str(drive.n_q),
            "--device", drive.device, "--seed", str(drive.seed)]
    return shlex.join(argv)


def cmd_spec_decode(args) -> int:
    """Raises ValueError for bad usage (the CLI prints it as one line, exit 2)."""
    import torch

    drive = _validated(args)
    if drive.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device found on this machine")
    torch.set_num_threads(args.threads)
    if args.layer is None:
        factory = _factory(args.design, drive.device)
        from verify.spec_decode.contract import PROPERTIES, check_contract

        return _print_report(check_contract(factory, drive), PROPERTIES, args.design, args.design, args.json)
    from verify.spec_decode.layer import PROPERTIES, check_layer_contract, reference_layer

    design = args.design or ("checkpoints" if args.layer == "kda" else None)
    make = reference_layer(_factory(design, drive.device) if args.layer == "kda" else None)
    subject = f"{args.layer}_layer" + (f" with {design}" if design else "")
    return _print_report(check_layer_contract(make, drive), PROPERTIES, subject, args.design, args.json)


def _print_report(report, properties: dict, subject: str, design: str | None, as_json: bool) -> int:
    """A verdict per property (text or --json), the first findings and a repro; the exit status."""
    from verify.spec_decode.contract import MAX_REPORTED

    drive = report.drive
    first = {}
    for v in report.violations:
        first.setdefault(v.prop, v)
    repros = {p: repro_command(design, drive, max(2, v.step + 1)) for p, v in first.items()}
    if as_json:
        print(json.dumps({
            "design": design, "layer": getattr(drive, "kind", None), "drive": drive.__dict__, "ok": report.ok,
            "steps_run": report.steps_run, "unjudged": report.unjudged,
            "properties": {p: {"what": properties[p], "ok": t.violations == 0 and p not in report.unjudged,
                               "checks": t.checks,
                               "violations": t.violations, "worst_ratio": t.worst_ratio, "worst_step": t.worst_step,
                               "repro": repros.get(p)} for p, t in report.tally.items()},
            "violations": [{"property": v.prop, "step": v.step, "sequence": v.sequence, "message": v.message}
                           for v in report.violations]}, indent=1))
        return EXIT_OK if report.ok else EXIT_FAIL
    print(f"spec-decode {subject}: {drive.config} {drive.dtype}, B={drive.batch}, n_q={drive.n_q}, "
          f"{drive.steps} steps, seed {drive.seed}, {drive.device}")
    for p, t in report.tally.items():
        if p == "run" and not t.violations:
            continue
        worst = f", worst err/tol {t.worst_ratio:.3g} (step {t.worst_step})" if t.worst_step is not None else ""
        found = f"; {t.violations} failing (step, sequence) findings" if t.violations else ""
        verdict = "FAIL" if t.violations else "NOT JUDGED" if p in report.unjudged else "PASS"
        print(f"{verdict} {p}: {properties[p]}")
        print(f"     {t.checks} checks{worst}{found}")
        shown = [x for x in report.violations if x.prop == p][:SHOWN]
        for v in shown:
            print(f"     {v}")
        if t.violations > len(shown):
            print(f"     ... {t.violations - len(shown)} more (--json lists the first {MAX_REPORTED})")
        if p in repros:
            print(f"     repro: {repros[p]}")
    if report.ok:
        print(f"verdict: {subject} meets the contract over {report.steps_run} steps")
        return EXIT_OK
    bad = [p for p, t in report.tally.items() if t.violations]
    unjudged = f"; not judged: {', '.join(report.unjudged)}" if report.unjudged else ""
    print(f"verdict: {subject} FAILED {', '.join(bad) or '-'}{unjudged} (ran {report.steps_run} of "
          f"{drive.steps} steps)")
    return EXIT_FAIL
