"""kda_decode cluster variants on the H200 (fused/kda_decode_cluster.py, experimental).

Checks every KdaClusterConfig against the fp64 oracle (bench_wave1b's derived criterion), against
the certified one-CTA kernel (expected bitwise: same per-row code and sum orders), determinism and
batch invariance; then times them beside the default dispatch, the eager reference and
torch.compile of it at T in (1, 8) (96 / 12 heads), B in (1, 8, 32, 64), in CUDA graphs over
rotated input sets (state from HBM), as bench_wave1b does. One failing config does not stop the run.

    python3 -m bench.bench_kda_cluster --out $OUT      # kda_cluster.json, kda_cluster.md, .log
    python3 -m bench.bench_kda_cluster --dry-run       # CPU: plan + compile two configs, no GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from bench import bench_wave1b as w1b
from bench.bench_wave1b import bench, bitwise, clone_all, derived, kda_inputs, log, record

DH, W = 128, 4
BATCHED = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z", "conv_state", "state")
CHECK_CASES = [  # (B, H, Dh, strided, wd)
    (1, 12, 128, False, torch.bfloat16), (3, 12, 128, True, torch.bfloat16),
    (8, 12, 128, False, torch.bfloat16), (2, 96, 128, False, torch.bfloat16),
    (2, 12, 128, False, torch.float16), (3, 4, 32, False, torch.bfloat16),
    (2, 6, 16, False, torch.bfloat16), (3, 2, 64, False, torch.bfloat16)]


def kda_bytes(B: int, H: int, Dh: int, e: int = 2) -> int:
    """Bytes the op must move (bench_wave1b.timing_kda's count): state r+w, activations, conv."""
    C = H * Dh
    return (B * H * Dh * Dh * 4 * 2 + B * C * e * (6 + 2 * 3 * 3) + B * H * e + 3 * C * 4 * 4
            + C * 4 + H * 4 + Dh * 4)


def configs(names: list[str] | None):
    from fused import kda_decode
    cfgs = kda_decode.experimental_variants({}, {})
    return [c for c in cfgs if not names or c.name in names]


def _call(fused, a, y, cfg):
    fused.launch(a["q_raw"], a["k_raw"], a["v_raw"], a["g_raw"], a["beta_raw"], a["z"], a["conv_w"],
                 a["conv_state"], a["A_log"], a["dt_bias"], a["o_norm_w"], a["state"], y,
                 -5.0, 1e-6, 1e-5, variant=cfg)


def _fused_run(fused, inp, cfg, strided_src=None):
    a = clone_all(inp)
    if strided_src is not None:
        for k in ("q_raw", "k_raw", "v_raw", "g_raw", "z"):
            a[k] = strided_src[k]            # the column-slice views, not contiguous clones
    y = torch.full_like(inp["q_raw"], float("nan"), memory_format=torch.contiguous_format)
    _call(fused, a, y, cfg)
    torch.cuda.synchronize()
    return y, a["state"], a["conv_state"]


def check(cfgs) -> None:
    from references.kda import kda_decode as ref
    from fused import kda_decode as fused
    log("== kda_decode cluster correctness (oracle = reference on float64 copies)")
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
                checks = [derived("y", y, b_y, o_y, wd),
                          derived("state", st, b_in["state"], o_in["state"], torch.float32),
                          bitwise("conv_state", cs, b_in["conv_state"]),
                          bitwise("y==one_cta", y, one[0]), bitwise("state==one_cta", st, one[1]),
                          bitwise("y rerun", y, again[0]), bitwise("state rerun", st, again[1])]
                if B > 1:   # batch invariance: the last sequence run alone
                    alone = {k: (v[B - 1:] if k in BATCHED else v) for k, v in inp.items()}
                    ya, sa, _ = _fused_run(fused, alone, cfg, alone if strided else None)
                    checks += [bitwise("y batch-inv", y[B - 1:], ya), bitwise("state batch-inv", st[B - 1:], sa)]
                record("kda_decode_cluster", case, checks)
            except Exception as e:  # noqa: BLE001
                log(f"  ERROR kda_decode_cluster {case}: {e!r}")
                traceback.print_exc()
                w1b.RESULTS["correctness"].append({"op": "kda_decode_cluster", "case": case,
                                                   "pass": False, "error": repr(e)})


def timing(cfgs, Ts, Bs, compile_ok: bool) -> None:
    from references.kda import kda_decode as ref
    from fused import kda_decode as fused
    log("== kda_decode timing, cluster variants (Dh=128, W=4, H=96/T; us per call)")
    comp = torch.compile(ref, dynamic=True) if compile_ok else None
    for T in Ts:
        H = 96 // T
        for B in Bs:
            fns = {"fused": lambda s: fused.kda_decode(**s), "eager": lambda s: ref(**s)}
            for cfg in cfgs:
                fns[cfg.name] = (lambda c: lambda s: fused.kda_decode(**s, variant=c))(cfg)
            if comp is not None:
                fns["compile"] = lambda s: comp(**s)
            try:
                bench("kda_decode", f"T={T} H={H} B={B}", fns,
                      lambda i: kda_inputs(B, H, DH, "cuda", seed=i), B * H * DH * DH * 4,
                      kda_bytes(B, H, DH), w1b.RESULTS["copy_bw"])
                w1b.RESULTS["timing"][-1].update(T=T, H=H, B=B)
            except Exception as e:  # noqa: BLE001
                log(f"  timing T={T} B={B} failed: {e!r}"[:400])


def markdown(cfgs) -> str:
    names = [c.name for c in cfgs]
    cols = ["fused"] + names + ["eager", "compile"]
    lines = ["# kda_decode cluster variants (H200)", "",
             "us per call, CUDA graphs over rotated input sets (state from HBM); "
             "% = bytes / 4.24 TB/s / time.", "",
             "| T | H | B | MB | floor us | " + " | ".join(cols) + " | best cluster | % bw (best) |",
             "|" + "---|" * (len(cols) + 7)]
    for r in w1b.RESULTS["timing"]:
        if "T" not in r:
            continue
        us = r["us"]
        cl = {n: us.get(n) for n in names if us.get(n)}
        best = min(cl, key=cl.get) if cl else None
        cell = lambda n: f"{us[n]:.2f}" if us.get(n) else "n/a"
        pct = f"{100 * r['floor_us'] / cl[best]:.0f}%" if best else "n/a"
        lines.append(f"| {r['T']} | {r['H']} | {r['B']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.2f} | "
                     + " | ".join(cell(n) for n in cols) + f" | {best} | {pct} |")
    corr = w1b.RESULTS["correctness"]
    lines += ["", f"Correctness: {sum(c['pass'] for c in corr)}/{len(corr)} cases pass."]
    lines += [f"- FAIL {c['case']}: " + (c.get("error") or "; ".join(
        f"{k['out']}" for k in c["checks"] if not k["pass"])) for c in corr if not c["pass"]]
    return "\n".join(lines) + "\n"


def dry_run(cfgs, args) -> int:
    """CPU-side parts: the plan and a compile of two configs (bf16 and fp16)."""
    from fused import runtime
    log(f"plan: T {args.T}, B {args.B}, configs {[c.name for c in cfgs]}, "
        f"{len(CHECK_CASES)} check cases; bytes T=8 B=1: {kda_bytes(1, 12, DH) / 1e6:.2f} MB")
    for cfg, dt in ((cfgs[0], "bfloat16"), (cfgs[-1], "float16")):
        t = time.time()
        runtime.compile_for_cpu_check("kda_decode_cluster", dt, DH, W, cfg)
        log(f"compiled {cfg.name} {dt} in {time.time() - t:.1f}s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--T", type=int, nargs="+", default=[1, 8], choices=[1, 2, 4, 8])
    ap.add_argument("--B", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--configs", nargs="*", default=None, help="config names, e.g. c8w16 c4w8")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile timings")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: plan + compile two configs")
    args = ap.parse_args(argv)
    cfgs = configs(args.configs)
    if not cfgs:
        ap.error(f"--configs: none of {args.configs} is a config; see fused.kda_decode.experimental_variants")
    if args.dry_run:
        return dry_run(cfgs, args)
    import cutlass
    log(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | cutlass {cutlass.__version__} | "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    if not args.no_check:
        check(cfgs)
    if not args.no_timing:
        w1b.RESULTS["copy_bw"] = 4.24e12
        timing(cfgs, args.T, args.B, not args.no_compile)
    n_fail = sum(not r["pass"] for r in w1b.RESULTS["correctness"])
    log(f"correctness: {len(w1b.RESULTS['correctness']) - n_fail} pass, {n_fail} fail; total {time.time() - t0:.1f}s")
    with open(f"{args.out}/kda_cluster.json", "w") as f:
        json.dump(w1b.RESULTS, f, indent=1, default=str)
    with open(f"{args.out}/kda_cluster.md", "w") as f:
        f.write(markdown(cfgs))
    with open(f"{args.out}/kda_cluster.log", "w") as f:
        f.write("\n".join(w1b.LOG) + "\n")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
