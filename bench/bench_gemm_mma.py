"""skinny_gemm tensor-core (mma.sync swap-AB) variants vs the SIMT kernel vs cuBLAS on the H200.

Run on the H200 (see shared/device/README.md):  PYTHONPATH=$PWD python3 bench/bench_gemm_mma.py --out $OUT
Compiles every variant in a pool of processes (export to .o, load here), then per K3 shape and
M in 1,2,4,8,16,32,64: correctness vs a float64 product (and cuBLAS's own error), determinism (two
runs bitwise), batch invariance (rows of M=64 == the same rows at M=1, MMA variants), and
CUDA-graph timings with weights rotated from HBM. Writes gemm_mma.json and gemm_mma.log under --out.
"""
import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from timing import graph_time_us, save_outputs  # bench/timing.py (scripts run from bench/ on sys.path)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

COPY_BW = 4.24e12
ROT_BYTES = 256 << 20
MS = (1, 2, 4, 8, 16, 32, 64)
LOG, RESULTS = [], []


def log(msg):
    print(msg, flush=True)
    LOG.append(msg)


def _worker(jobs, objdir):
    from fused import skinny_gemm as sg
    out = []
    for idx, N, K, cfg in jobs:
        t = time.time()
        try:
            f = sg._compile.__wrapped__("bfloat16", "bfloat16", N, K, cfg)
            path = os.path.join(objdir, f"k{idx}.o")
            f.export_to_c(object_file_path=path, function_name=f"k{idx}")
            out.append((idx, path, time.time() - t, None))
        except Exception as e:                                   # noqa: BLE001
            out.append((idx, None, time.time() - t, f"{type(e).__name__}: {e}"[:300]))
    return out


def compile_all(shapes, workers, configs=None):
    """Compile every variant of `shapes` (configs(N, K), default sg.all_configs) in `workers`
    processes; load each into the project compile cache. Failures are logged, not raised."""
    from fused import runtime
    from fused import skinny_gemm as sg
    jobs = []
    for K, N in shapes:
        for cfg in (configs or sg.all_configs)(N, K):
            jobs.append((len(jobs), N, K, cfg))
    objdir = "/tmp/skgemm_objs"
    os.makedirs(objdir, exist_ok=True)
    t = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    res = []
    import multiprocessing as mp
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for r in ex.map(_worker, chunks, [objdir] * workers):
                res += r
    except Exception as e:                                       # noqa: BLE001
        log(f"POOL FAIL {type(e).__name__}: {e}; variants compile in-process on first use"[:300])
    log(f"compiled {len(jobs)} variants in {time.time() - t:.1f} s with {workers} processes")
    _, cute = runtime.cutlass_modules()
    for idx, path, secs, err in sorted(res, key=lambda r: r[0]):
        _, N, K, cfg = jobs[idx]
        if err:
            log(f"COMPILE FAIL K={K} N={N} {cfg.name}: {err}")
            continue
        try:
            mod = cute.runtime.load_module(path, enable_tvm_ffi=True)
            runtime._cache[("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg)] = getattr(mod, f"k{idx}")
        except Exception as e:                                   # noqa: BLE001
            log(f"LOAD FAIL K={K} N={N} {cfg.name}: {type(e).__name__}: {e}"[:300])

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from fused import skinny_gemm as sg
    from fused.skinny_gemm_mma import SkinnyGemmMmaConfig, m_pad_for
    shapes = sg.K3_SHAPES if not args.quick else sg.K3_SHAPES[3:4]
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} {time.strftime('%Y-%m-%d %H:%M:%S')}")
    compile_all(shapes, args.workers)
    torch.manual_seed(0)
    for K, N in shapes:
        nb = N * K * 2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(max(2, math.ceil(ROT_BYTES / nb)))]
        cfgs = sg.all_configs(N, K)
        out1 = {}                                    # rows -> M=1 output of the m8 MMA variant
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ ws[0].double().T
            base = F.linear(x, ws[0])
            base_err = (base.double() - ref).abs().max().item()
            variants = [sg.simt_config(M, N, K)]
            variants += [c for c in cfgs if isinstance(c, SkinnyGemmMmaConfig) and c.m_pad == m_pad_for(M)]
            shape = f"{K}->{N} M={M}"
            for cfg in variants:
                key = ("skinny_gemm", "bfloat16", "bfloat16", N, K, cfg)
                from fused import runtime
                if key not in runtime._cache:
                    log(f"NOTE {shape} {cfg.name}: not preloaded, compiling in-process")
                try:
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    sg.skinny_gemm(x, ws[0], out=out, variant=cfg)
                    again = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    sg.skinny_gemm(x, ws[0], out=again, variant=cfg)
                    torch.cuda.synchronize()
                except Exception as e:                           # noqa: BLE001
                    log(f"RUN FAIL {shape} {cfg.name}: {type(e).__name__}: {e}"[:300])
                    continue
                err = (out.double() - ref).abs().max().item()
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all()) and err <= 2 * base_err + 1e-2 * ref.abs().max().item() / 64
                det = bool(torch.equal(out.view(torch.int16), again.view(torch.int16)))
                inv = None
                if isinstance(cfg, SkinnyGemmMmaConfig):
                    if M == 1:
                        out1[cfg.rows] = (x, out)
                    elif M == 64 and cfg.rows in out1:
                        inv = True
                        for r in (0, 13, 37, 63):
                            o1 = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
                            sg.skinny_gemm(x[r:r + 1].clone(), ws[0], out=o1,
                                           variant=SkinnyGemmMmaConfig(8, cfg.rows, cfg.warps,
                                                                       sg.mma._unroll(K, cfg.warps, 8),
                                                                       cfg.interleave))
                            inv = inv and bool(torch.equal(o1.view(torch.int16), out[r:r + 1].view(torch.int16)))
                fns = [lambda w=w, o=out, c=cfg: sg.skinny_gemm(x, w, out=o, variant=c) for w in ws]
                us = graph_time_us(fns)
                r = dict(shape=shape, K=K, N=N, M=M, impl=cfg.name, us=round(us, 2),
                         pct_bw=round(100 * nb / (us * 1e-6) / COPY_BW, 1), maxerr=err, cublas_err=base_err,
                         rel=rel, ok=ok, le_cublas=err <= base_err, deterministic=det, batch_invariant=inv)
                RESULTS.append(r)
                log(f"{shape:22s} {cfg.name:22s} {us:8.2f} us {r['pct_bw']:5.1f}%  err={err:.3g} "
                    f"cublas_err={base_err:.3g} rel={rel:.2e} {'OK' if ok else 'FAIL'} det={det} inv={inv}")
            fns = [lambda w=w: F.linear(x, w) for w in ws]
            us = graph_time_us(fns)
            RESULTS.append(dict(shape=shape, K=K, N=N, M=M, impl="cublas", us=round(us, 2),
                                pct_bw=round(100 * nb / (us * 1e-6) / COPY_BW, 1)))
            log(f"{shape:22s} {'cublas(F.linear)':22s} {us:8.2f} us {RESULTS[-1]['pct_bw']:5.1f}%")
        del ws
        torch.cuda.empty_cache()
    # summary: best fused per (shape, M) vs cuBLAS
    log("SUMMARY shape | cublas us | best simt | best mma (correct, det)")
    by = {}
    for r in RESULTS:
        by.setdefault(r["shape"], []).append(r)
    for shape, rs in by.items():
        cb = next(r for r in rs if r["impl"] == "cublas")["us"]
        simt = [r for r in rs if r["impl"].startswith(("gemv", "tiled")) and r["ok"]]
        mm = [r for r in rs if r["impl"].startswith("mma") and r["ok"] and r["deterministic"]]
        bs = min(simt, key=lambda r: r["us"]) if simt else None
        bm = min(mm, key=lambda r: r["us"]) if mm else None
        log(f"SUMMARY {shape:22s} cublas {cb:8.2f} | simt {bs['us'] if bs else '-':>8} | "
            f"mma {bm['us'] if bm else '-':>8} {bm['impl'] if bm else ''}")
    os.makedirs(args.out, exist_ok=True)
    save_outputs(args.out, "gemm_mma", RESULTS, LOG)


if __name__ == "__main__":
    sys.exit(main())
