"""skinny_gemm wgmma variants (fused/skinny_gemm_wgmma.py) vs the current default vs cuBLAS on the H200.

Run on the H200 from the repo root:  python3 bench/bench_gemm_wgmma.py --out $OUT
Per K3 shape and M in 8, 16, 32, 64: every wgmma variant of M's m_pad bucket and the current
`skinny_gemm.default_config(M, N, K)` are checked against a float64 product (NaN-poisoned output;
error <= cuBLAS's own error + 1 bf16 ulp of the row's max |y|, per row), for determinism (two runs
bitwise) and batch invariance (each row == the same row computed alone at M=1 by the same variant),
then timed with CUDA events over CUDA-graph replays, weights rotated over >= 256 MB of copies
(bench/timing.py), beside torch.nn.functional.linear (cuBLAS).

A hung kernel (a pipeline deadlock) must not cost the run: the work runs in a child process that
prints START before each variant; the parent kills a child silent for --hang-s seconds, records the
variant as HANG and restarts the child, which skips it and everything already recorded (results
stream to gemm_wgmma.jsonl). Writes gemm_wgmma.{json,md,log} under --out.
CPU-only check of this script: python3 bench/bench_gemm_wgmma.py --compile-only --limit 2

Split-K folds (bench-only until measured): `configs_for(..., sweep=True)` also lists the "vec" and
"spread" folds at each split variant's S and at about S/2; on the H200:
  python3 bench/bench_gemm_wgmma.py --shapes 7168x896,7168x3584,7168x6144 --ms 8,16,32,64 --out $OUT/folds
(166 variants; add `--folds vec,spread --ksplit-sweep 2,3,4,6` in a second call for more S values.) The md's "per split-K fold" table gives each
fold's best correct, deterministic, batch-invariant variant beside cuBLAS.
"""
import argparse
import dataclasses
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # repo root: fused/
from bench_gemm_mma import COPY_BW, LOG, ROT_BYTES, compile_all, log  # noqa: E402  (bench/ is on sys.path)
from timing import graph_time_us  # noqa: E402

MS = (8, 16, 32, 64)
JSONL, JSON_OUT, MD_OUT, LOG_OUT = "gemm_wgmma.jsonl", "gemm_wgmma.json", "gemm_wgmma.md", "gemm_wgmma.log"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".", help="directory for gemm_wgmma.{json,jsonl,md,log}")
    ap.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)),
                    help="compile processes")
    ap.add_argument("--shapes", default="all", help="'all' or K->N pairs like 7168x896,1536x7168")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M (1..64)")
    ap.add_argument("--ksplit-sweep", default="", help="extra split-K values tried on every wgmma variant, e.g. 1,2,4")
    ap.add_argument("--folds", default="last,vec,spread",
                    help="split-K folds of the wgmma variants to run (fused/skinny_gemm_wgmma.py FOLDS); "
                         "e.g. vec,spread for the bench-only folds; 'cluster' / 'cspread' add the default's (and "
                         "its tiling twins') cluster-fold twins")
    ap.add_argument("--bk", default="", help="k per stage of the default's twins, e.g. 128 (bench-only)")
    ap.add_argument("--step", default="", help="output columns per CTA of the default's twins with "
                    "overlapping 64-row tiles, e.g. 56,48 (kept where they divide N in one wave; bench-only)")
    ap.add_argument("--occ", default="1", help="CTAs per SM the cluster-fold twins' stages are sized for, e.g. "
                    "1,2 (2: an S whose grid needs 2 CTAs per SM; bench-only)")
    ap.add_argument("--rows", default="", help="weight rows per CTA of extra cluster-fold twins, e.g. 128 (two "
                    "64-row wgmma tiles sharing each token tile; with --step 112 a 128-row tile every 112 rows)")
    ap.add_argument("--hang-s", type=float, default=60.0, help="silence (s) after which a variant counts as hung")
    ap.add_argument("--compile-only", action="store_true", help="compile the variants (no GPU needed) and exit")
    ap.add_argument("--limit", type=int, default=0, help="with --compile-only: compile only this many variants")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def shapes_of(args):
    from fused import skinny_gemm as sg
    if args.shapes == "all":
        return list(sg.K3_SHAPES)
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]


def variants_for(N, K, M, sweep, folds=None, bks=(), steps=(), occs=(1,), rows=()):
    """The wgmma variants of M's bucket with a fold in `folds` (all if None), plus the split-K sweep
    (dropped where a variant rejects it, e.g. a "spread" grid that would not be resident), and the
    current default."""
    from fused import skinny_gemm as sg
    from fused import skinny_gemm_wgmma as wg
    base = [c for c in wg.configs_for(N, K, wg.m_pad_for(M), sweep=True) if folds is None or c.fold in folds]
    extra = []
    d = sg.default_config(M, N, K)

    def keep(cand):
        """cand, if new and accepted by the kernel (e.g. not a "spread" grid that would not be resident)."""
        if cand == d or cand in base + extra:
            return
        try:
            wg.validate(N, K, cand)
        except ValueError:
            return
        extra.append(cand)

    for c in base:
        for s in sweep:
            if 1 <= s <= K // wg.BK:
                keep(dataclasses.replace(c, ksplit=s))
    cluster_folds = [f for f in wg.CLUSTER_FOLDS if f in (folds or ())]
    if cluster_folds and not isinstance(d, wg.SkinnyGemmWgmmaConfig):
        dw = sg.default_wgmma(N, K, wg.m_pad_for(M))     # below the shape's min_M: its wgmma bucket too
        if dw is not None:
            keep(dw)
    if isinstance(d, wg.SkinnyGemmWgmmaConfig) and not d.fresh_acc:
        for bk in [wg.BK, *bks]:                         # twins with the default's S: the same sums
            for step in [0, *steps]:
                if step and N % step:
                    continue
                twin = dataclasses.replace(d, bk=bk, step=step, stages=wg.stages_for(d.rows, d.m_pad, d.occupancy, bk))
                blocks = N // (step or d.rows)
                if d.fold == "last" and (not step or blocks * d.ksplit <= wg.SMS):
                    keep(twin)
        for r, bk, step in cluster_tilings(N, d.rows, rows, [wg.BK, *bks], steps):
            blocks = N // (step or r)
            for fold in cluster_folds:                   # the split CTAs as one cluster: at the default's S
                for occ in occs:                         # and at the most in one wave; with `occs` 2, stages
                                                         # for 2 CTAs per SM and an S whose grid needs them
                    most = min(wg.MAX_CLUSTER, wg.SMS * occ // blocks, K // bk // 4)
                    staged = dataclasses.replace(d, rows=r, bk=bk, step=step, occupancy=occ,
                                                 stages=wg.stages_for(r, d.m_pad, occ, bk))
                    for s in ({d.ksplit, most} if r == d.rows else {most}):   # other rows: the one-wave S
                        if wg.SMS * (occ - 1) < blocks * s <= wg.SMS * occ:
                            keep(wg.with_fold(staged, fold, s))
    return base + extra + [d]


def cluster_tilings(N, default_rows, rows, bks, steps):
    """(rows, bk, step) of the cluster-fold twins: the default's rows and every `rows` (e.g. 128: two
    wgmma row tiles sharing each token tile, half the token-tile reads per weight byte), each unstepped
    and at every `step` that divides N and overlaps less than half a tile (56 for 64 rows, 112 for 128)."""
    out = []
    for r in dict.fromkeys([default_rows, *rows]):
        for bk in bks:
            for step in [0, *steps]:
                if (step and (N % step or not r // 2 < step <= r)) or (not step and N % r):
                    continue
                out.append((r, bk, step))
    return out


def tilings_of(args):
    """(bks, steps, occs, rows): the --bk / --step twins of the default, the --occ and --rows of its
    cluster-fold twins."""
    return tuple([int(v) for v in a.split(",") if v] for a in (args.bk, args.step, args.occ, args.rows))


def folds_of(args):
    return {f for f in args.folds.split(",") if f}


def all_variants(args):
    sweep = [int(s) for s in args.ksplit_sweep.split(",") if s]
    ms = [int(m) for m in args.ms.split(",")]
    out = {}
    for K, N in shapes_of(args):
        seen = []
        for M in ms:
            for c in variants_for(N, K, M, sweep, folds_of(args), *tilings_of(args)):
                if c not in seen:
                    seen.append(c)
        out[(K, N)] = seen
    return out


def row_ok(out, ref, base):
    """Per row: |err| <= cuBLAS's |err| + 1 bf16 ulp of the row's max |y|; all finite."""
    import torch
    err = (out.double() - ref).abs().amax(dim=1)
    berr = (base.double() - ref).abs().amax(dim=1)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().amax(dim=1).clamp_min(1e-30))) - 7)
    return bool(torch.isfinite(out).all()) and bool((err <= berr + ulp).all())


def run_child(args):
    import torch
    import torch.nn.functional as F

    from fused import runtime
    from fused import skinny_gemm as sg
    from fused.skinny_gemm_wgmma import SkinnyGemmWgmmaConfig
    path = os.path.join(args.out, JSONL)
    done = set()
    if os.path.exists(path):
        with open(path) as f:
            done = {(r["K"], r["N"], r["M"], r["impl"]) for r in map(json.loads, f) if r}
    skip = set(args.skip.split("|")) - {""}
    variants = all_variants(args)
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M:%S')}")
    compile_all(list(variants), args.workers, lambda N, K: variants[(K, N)])
    log("COMPILED")

    def record(r):
        with open(path, "a") as f:
            f.write(json.dumps(r) + "\n")

    torch.manual_seed(0)
    for (K, N), _ in variants.items():
        nb = N * K * 2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
              for _ in range(max(2, math.ceil(ROT_BYTES / nb)))]
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ ws[0].double().T
            base = F.linear(x, ws[0])
            base_err = (base.double() - ref).abs().max().item()
            shape = f"{K}->{N} M={M}"
            for cfg in variants_for(N, K, M, [int(s) for s in args.ksplit_sweep.split(",") if s], folds_of(args),
                                    *tilings_of(args)):
                tag = f"{K}x{N}:{M}:{cfg.name}"
                if (K, N, M, cfg.name) in done:
                    continue
                r = dict(shape=shape, K=K, N=N, M=M, impl=cfg.name, wgmma=isinstance(cfg, SkinnyGemmWgmmaConfig),
                         fold=getattr(cfg, "fold", None), ksplit=getattr(cfg, "ksplit", None),
                         default=cfg == sg.default_config(M, N, K), cublas_err=base_err)
                if tag in skip:
                    record(dict(r, error="HANG (killed; skipped on restart)"))
                    continue
                log(f"START {tag}")
                try:
                    if ("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg) not in runtime._cache:
                        log(f"NOTE {shape} {cfg.name}: not preloaded, compiling in-process")
                        sg._compile("bfloat16", "bfloat16", N, K, cfg)
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    sg.skinny_gemm(x, ws[0], out=out, variant=cfg)
                    again = sg.skinny_gemm(x, ws[0], variant=cfg)
                    one = sg.skinny_gemm(x[M - 1:].clone(), ws[0], variant=cfg) if M > 1 else out
                    torch.cuda.synchronize()
                    d_out = out if r["default"] else sg.skinny_gemm(x, ws[0], variant=sg.default_config(M, N, K))
                    torch.cuda.synchronize()
                    r["same_bits_as_default"] = bool(torch.equal(out.view(torch.int16), d_out.view(torch.int16)))
                    err = (out.double() - ref).abs().max().item()
                    r.update(maxerr=err, ok=row_ok(out, ref, base), le_cublas=err <= base_err,
                             rel=((out.double() - ref).norm() / ref.norm()).item(),
                             deterministic=bool(torch.equal(out.view(torch.int16), again.view(torch.int16))),
                             batch_invariant=bool(torch.equal(one.view(torch.int16), out[M - 1:].view(torch.int16))))
                    fns = [lambda w=w, o=out, c=cfg: sg.skinny_gemm(x, w, out=o, variant=c) for w in ws]
                    us = graph_time_us(fns)
                    r.update(us=round(us, 2), pct_bw=round(100 * nb / (us * 1e-6) / COPY_BW, 1))
                    log(f"{shape:22s} {cfg.name:30s} {us:8.2f} us {r['pct_bw']:5.1f}%  err={err:.3g} "
                        f"cublas_err={base_err:.3g} {'OK' if r['ok'] else 'FAIL'} det={r['deterministic']} "
                        f"inv={r['batch_invariant']} same_bits={r['same_bits_as_default']}")
                except Exception as e:                               # noqa: BLE001
                    r.update(error=f"{type(e).__name__}: {e}"[:400])
                    log(f"FAIL {shape} {cfg.name}: {r['error']}")
                    if "CUDA" in r["error"] or "cuda" in r["error"]:     # context may be unusable: restart
                        record(r)
                        sys.exit(3)
                record(r)
            if (K, N, M, "cublas") not in done:
                us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws])
                record(dict(shape=shape, K=K, N=N, M=M, impl="cublas", us=round(us, 2),
                            pct_bw=round(100 * nb / (us * 1e-6) / COPY_BW, 1)))
                log(f"{shape:22s} {'cublas(F.linear)':30s} {us:8.2f} us")
        del ws
        torch.cuda.empty_cache()
    log("CHILD DONE")


def supervise(args):
    """Run the child; on silence past --hang-s after START (600 s while compiling) kill it, mark the
    started variant HANG and restart it with that variant skipped; restart after a CUDA error too."""
    skip, here = [], os.path.abspath(__file__)
    for _attempt in range(6):
        cmd = [sys.executable, "-u", here, "--child", "--skip", "|".join(skip)] + sys.argv[1:]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines = queue.Queue()
        threading.Thread(target=lambda out=p.stdout, q=lines: [q.put(x) for x in iter(out.readline, "")] + [q.put(None)],
                         daemon=True).start()
        current, compiled, last, hung = None, False, time.time(), False
        while True:
            try:
                line = lines.get(timeout=5.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                last = time.time()
                log(line.rstrip())
                compiled = compiled or line.startswith("COMPILED")
                if line.startswith("START "):
                    current = line.split()[1]
            elif time.time() - last > (args.hang_s if compiled else 600):
                p.kill()
                hung = True
                log(f"HANG {current or '(compile phase)'}: silent {time.time() - last:.0f} s; killed")
                break
        rc = p.wait()
        if rc == 0 and not hung:
            return 0
        if hung and current is None:
            return 1
        if hung:
            skip.append(current)
        log(f"child ended (rc={rc}, hung={hung}); restarting, skipping what is recorded")
    return 1


def report(args):
    path = os.path.join(args.out, JSONL)
    rows = [json.loads(r) for r in open(path)] if os.path.exists(path) else []
    with open(os.path.join(args.out, JSON_OUT), "w") as f:
        json.dump(rows, f, indent=1)
    md = ["# skinny_gemm wgmma variants vs default vs cuBLAS (H200)", "",
          "us = median per call over CUDA-graph replays, weights rotated from HBM; % = weight bytes / time "
          "over 4.24 TB/s. ok = per-row error <= cuBLAS's + 1 bf16 ulp; det = two runs bitwise; "
          "inv = last row alone (M=1) bitwise equal.", "",
          "| K -> N | M | cuBLAS us | default (name) us | best wgmma (name) us, % | best / cuBLAS |",
          "|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["K"], r["N"], r["M"]), []).append(r)
    for (K, N, M), rs in groups.items():
        cb = next((r for r in rs if r["impl"] == "cublas"), None)
        dflt = next((r for r in rs if r.get("default") and "us" in r), None)
        good = [r for r in rs if r.get("wgmma") and r.get("ok") and r.get("deterministic") and "us" in r]
        best = min(good, key=lambda r: r["us"]) if good else None
        ratio = f"{best['us'] / cb['us']:.2f}x" if best and cb else "-"
        md.append(f"| {K} -> {N} | {M} | {cb['us'] if cb else '-'} | "
                  f"{dflt['us'] if dflt else '-'} ({dflt['impl'] if dflt else '-'}) | "
                  f"{best['us'] if best else '-'} ({best['impl'] if best else 'none correct'}), "
                  f"{best['pct_bw'] if best else '-'}% | {ratio} |")
    md += ["", "## Best correct wgmma variant per split-K fold (fused/skinny_gemm_wgmma.py FOLDS)", "",
           "| K -> N | M | cuBLAS us | last | vec | spread |", "|---|---|---|---|---|---|"]
    for (K, N, M), rs in groups.items():
        cb = next((r for r in rs if r["impl"] == "cublas"), None)
        cells = []
        for fold in ("last", "vec", "spread"):
            good = [r for r in rs if r.get("fold") == fold and r.get("ok") and r.get("deterministic")
                    and r.get("batch_invariant") and "us" in r]
            b = min(good, key=lambda r: r["us"]) if good else None
            cells.append(f"{b['us']} ({b['impl']})" if b else "-")
        md.append(f"| {K} -> {N} | {M} | {cb['us'] if cb else '-'} | " + " | ".join(cells) + " |")
    md += ["", "## Every variant", "", "| K -> N | M | variant | us | % bw | maxerr | cuBLAS err | ok | det | inv | error |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["impl"] == "cublas":
            continue
        md.append(f"| {r['K']} -> {r['N']} | {r['M']} | {r['impl']}{' (default)' if r.get('default') else ''} | "
                  f"{r.get('us', '-')} | {r.get('pct_bw', '-')} | {r.get('maxerr', float('nan')):.3g} | "
                  f"{r.get('cublas_err', float('nan')):.3g} | {r.get('ok', '-')} | {r.get('deterministic', '-')} | "
                  f"{r.get('batch_invariant', '-')} | {r.get('error', '')} |")
    with open(os.path.join(args.out, MD_OUT), "w") as f:
        f.write("\n".join(md) + "\n")
    bad = [r for r in rows if r.get("wgmma") and not (r.get("ok") and r.get("deterministic")
                                                      and r.get("batch_invariant"))]
    log(f"REPORT {len(rows)} records, {len(bad)} wgmma records not (ok, det, inv); "
        f"written {JSON_OUT}, {MD_OUT} under {args.out}")


def main():
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    if args.compile_only:
        variants = all_variants(args)
        jobs = [(k, c) for k, cs in variants.items() for c in cs]
        jobs = jobs[:args.limit] if args.limit else jobs
        chosen = {}
        for k, c in jobs:
            chosen.setdefault(k, []).append(c)
        compile_all(list(chosen), args.workers, lambda N, K: chosen.get((K, N), []))
        from fused import runtime
        log(f"compile-only: {runtime.cache_info().entries} of {len(jobs)} variants in the cache")
        return 0 if runtime.cache_info().entries == len(jobs) else 1
    if args.child:
        run_child(args)
        return 0
    import torch
    if not torch.cuda.is_available():
        log("bench_gemm_wgmma: needs a CUDA device (the H200); on a CPU run --compile-only")
        return 2
    if os.path.exists(os.path.join(args.out, JSONL)):
        os.remove(os.path.join(args.out, JSONL))              # a fresh run; the child resumes only after restarts
    rc = supervise(args)
    report(args)
    with open(os.path.join(args.out, LOG_OUT), "w") as f:
        f.write("\n".join(LOG) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
