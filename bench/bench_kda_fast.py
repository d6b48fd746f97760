"""kda_decode short-chain launches on the H200 (fused/kda_decode_fast.py, experimental).

Checks every KdaFastConfig bitwise against the certified default kernel (y, state, conv_state; the
variants change where values live, not an expression), plus the fp64-oracle criterion of
bench_wave1b; then times the default dispatch and every variant side by side at T in (1, 8)
(96 / 12 heads), B in (1, 8, 32), with bench_wave1b's method (CUDA graphs over rotated input sets,
state from HBM, median of 5 batches), and checks bitwise equality again on one timing input set.

    python3 -m bench.bench_kda_fast --out $OUT        # kda_fast.json, kda_fast.md, kda_fast.log
    python3 -m bench.bench_kda_fast --dry-run         # CPU: plan + compile two configs, no GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from bench import bench_wave1b as w1b
from bench.bench_kda_cluster import BATCHED, CHECK_CASES, DH, W, _fused_run, kda_bytes
from bench.bench_wave1b import bench, bitwise, clone_all, derived, kda_inputs, log, record


def configs(names: list[str] | None):
    from fused import kda_decode
    return [c for c in kda_decode.fast_variants({}, {}) if not names or c.name in names]


def check(cfgs) -> None:
    from references.kda import kda_decode as ref
    from fused import kda_decode as fused
    log("== kda_decode fast variants: bitwise vs the default kernel, oracle = reference on float64")
    for B, H, Dh, strided, wd in CHECK_CASES:
        inp = kda_inputs(B, H, Dh, "cuda", wd=wd, seed=B * 7 + H, strided=strided)
        o_in, b_in = clone_all(inp, torch.float64), clone_all(inp)
        o_y, b_y = ref(**o_in), ref(**b_in)
        src = inp if strided else None
        one = _fused_run(fused, inp, fused.KdaConfig.for_shape(Dh, B * H), src)
        for cfg in cfgs:
            case = f"B={B} H={H} Dh={Dh} {str(wd)[6:]} strided={strided} {cfg.name}"
            try:
                y, st, cs = _fused_run(fused, inp, cfg, src)
                again = _fused_run(fused, inp, cfg, src)
                checks = [bitwise("y==default", y, one[0]), bitwise("state==default", st, one[1]),
                          bitwise("conv==default", cs, one[2]),
                          derived("y", y, b_y, o_y, wd),
                          derived("state", st, b_in["state"], o_in["state"], torch.float32),
                          bitwise("y rerun", y, again[0]), bitwise("state rerun", st, again[1])]
                if B > 1:   # batch invariance: the last sequence run alone
                    alone = {k: (v[B - 1:] if k in BATCHED else v) for k, v in inp.items()}
                    ya, sa, _ = _fused_run(fused, alone, cfg, alone if strided else None)
                    checks += [bitwise("y batch-inv", y[B - 1:], ya), bitwise("state batch-inv", st[B - 1:], sa)]
                record("kda_decode_fast", case, checks)
            except Exception as e:  # noqa: BLE001
                log(f"  ERROR kda_decode_fast {case}: {e!r}")
                traceback.print_exc()
                w1b.RESULTS["correctness"].append({"op": "kda_decode_fast", "case": case,
                                                   "pass": False, "error": repr(e)})


def check_timing_set(fused, cfgs, B, H) -> None:
    """The timed shape itself: every variant bitwise the default on one timing input set."""
    inp = kda_inputs(B, H, DH, "cuda", seed=1000 + B)
    one = _fused_run(fused, inp, fused.KdaConfig.for_shape(DH, B * H))
    for cfg in cfgs:
        y, st, cs = _fused_run(fused, inp, cfg)
        record("kda_decode_fast", f"timed shape B={B} H={H} {cfg.name}",
               [bitwise("y==default", y, one[0]), bitwise("state==default", st, one[1]),
                bitwise("conv==default", cs, one[2])])


def timing(cfgs, Ts, Bs) -> None:
    from fused import kda_decode as fused
    log("== kda_decode timing, default vs fast variants (Dh=128, W=4, H=96/T; us per call)")
    for T in Ts:
        H = 96 // T
        for B in Bs:
            d = fused.KdaConfig.for_shape(DH, B * H)
            fns = {"default": lambda s: fused.kda_decode(**s)}
            for cfg in cfgs:
                fns[cfg.name] = (lambda c: lambda s: fused.kda_decode(**s, variant=c))(cfg)
            try:
                check_timing_set(fused, cfgs, B, H)
                bench("kda_decode", f"T={T} H={H} B={B}", fns,
                      lambda i: kda_inputs(B, H, DH, "cuda", seed=i), B * H * DH * DH * 4,
                      kda_bytes(B, H, DH), w1b.RESULTS["copy_bw"])
                w1b.RESULTS["timing"][-1].update(T=T, H=H, B=B, default_cfg=f"w{d.num_warps}")
            except Exception as e:  # noqa: BLE001
                log(f"  timing T={T} B={B} failed: {e!r}"[:400])


def markdown(cfgs) -> str:
    names = [c.name for c in cfgs]
    cols = ["default"] + names
    lines = ["# kda_decode fast variants (H200)", "",
             "us per call, CUDA graphs over rotated input sets (state from HBM); "
             "% = bytes / 4.24 TB/s / time; speedup = default / best.", "",
             "| T | H | B | MB | floor us | default cfg | " + " | ".join(cols) + " | best | speedup | % bw (best) |",
             "|" + "---|" * (len(cols) + 9)]
    for r in w1b.RESULTS["timing"]:
        if "T" not in r:
            continue
        us = r["us"]
        fast = {n: us[n] for n in names if us.get(n)}
        best = min(fast, key=fast.get) if fast else None
        cell = lambda n: f"{us[n]:.2f}" if us.get(n) else "n/a"
        sp = f"{us['default'] / fast[best]:.2f}x" if best and us.get("default") else "n/a"
        pct = f"{100 * r['floor_us'] / fast[best]:.0f}%" if best else "n/a"
        lines.append(f"| {r['T']} | {r['H']} | {r['B']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.2f} | "
                     f"{r['default_cfg']} | " + " | ".join(cell(n) for n in cols) + f" | {best} | {sp} | {pct} |")
    corr = w1b.RESULTS["correctness"]
    lines += ["", f"Correctness: {sum(c['pass'] for c in corr)}/{len(corr)} cases pass."]
    lines += [f"- FAIL {c['case']}: " + (c.get("error") or "; ".join(
        f"{k['out']}" for k in c["checks"] if not k["pass"])) for c in corr if not c["pass"]]
    return "\n".join(lines) + "\n"


def dry_run(cfgs, args) -> int:
    from fused import runtime
    log(f"plan: T {args.T}, B {args.B}, configs {[c.name for c in cfgs]}, {len(CHECK_CASES)} check cases")
    for cfg, dt in ((cfgs[0], "bfloat16"), (cfgs[-1], "float16")):
        t = time.time()
        runtime.compile_for_cpu_check("kda_decode_fast", dt, DH, W, cfg)
        log(f"compiled {cfg.name} {dt} in {time.time() - t:.1f}s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--T", type=int, nargs="+", default=[1, 8], choices=[1, 2, 4, 8])
    ap.add_argument("--B", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--configs", nargs="*", default=None, help="config names, e.g. f8w16 f16w8c")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: plan + compile two configs")
    args = ap.parse_args(argv)
    cfgs = configs(args.configs)
    if not cfgs:
        ap.error(f"--configs: none of {args.configs} is a config; see fused.kda_decode.fast_variants")
    if args.dry_run:
        return dry_run(cfgs, args)
    import cutlass
    log(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | cutlass {cutlass.__version__} | "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    t0 = time.time()
    if not args.no_check:
        check(cfgs)
    if not args.no_timing:
        w1b.RESULTS["copy_bw"] = 4.24e12
        timing(cfgs, args.T, args.B)
    n_fail = sum(not r["pass"] for r in w1b.RESULTS["correctness"])
    log(f"correctness: {len(w1b.RESULTS['correctness']) - n_fail} pass, {n_fail} fail; total {time.time() - t0:.1f}s")
    with open(f"{args.out}/kda_fast.json", "w") as f:
        json.dump(w1b.RESULTS, f, indent=1, default=str)
    with open(f"{args.out}/kda_fast.md", "w") as f:
        f.write(markdown(cfgs))
    with open(f"{args.out}/kda_fast.log", "w") as f:
        f.write("\n".join(w1b.LOG) + "\n")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
