"""skinny_gemm's split-K folds at the router shape (7168 -> 896) on the GPU: their cost, and whether
two "spread" launches on two streams can wait on each other forever.

Timing (CUDA graphs, weights from HBM): per token bucket, the "spread" fold launched cooperatively
(the current source), the "spread" fold as a plain launch (the source in --old, e.g. the session-7
fused/skinny_gemm_wgmma.py), "vec", and "partials" (no fold in the kernel; the caller's fold is not
in this time). Bitwise: spread (both launches), vec and the ks-order fold of "partials" give the
same y (fp32 out).

Stress (`--stress plain|coop`, run by the main process in a child with a time limit): a filler
matmul holds the SMs on one stream; a spread GEMM is launched on a low-priority stream and another
on a high-priority stream after a delay swept over the filler's run, so the first can be placed only
in part when the second's CTAs take the SMs that free up. Each CTA of a spread grid spins until its split peers arrive: placed in
part, both grids wait forever. The child reports its iterations; a hang shows as the child killed.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/bench_streams.py --old .device/old/skinny_gemm_wgmma.py --out $OUT
"""
import argparse
import dataclasses
import importlib.util
import math
import subprocess
import sys
import time

import torch

E, D = 896, 7168
LOG, RESULTS = [], []


def log(msg):
    print(msg, flush=True)
    LOG.append(msg)


def load_old(path):
    spec = importlib.util.spec_from_file_location("skinny_gemm_wgmma_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def spread_cfg(mod, m_pad):
    for c in mod.configs_for(E, D, m_pad):
        if (c.rows, c.occupancy) == (64, 1):
            return dataclasses.replace(c, fold="spread")
    raise RuntimeError("no r64 o1 variant")


class Gemm:
    """One compiled variant with its own workspace and counters per stream."""

    def __init__(self, mod, cfg):
        self.mod, self.cfg = mod, cfg
        out = "float32"
        self.fn = mod.compile_variant("bfloat16", out, E, D, cfg)
        self.bufs = {}

    def __call__(self, x, w, y):
        key = torch.cuda.current_stream().cuda_stream
        if key not in self.bufs:
            ws, cnt = self.mod.workspace_shapes(E, self.cfg)
            self.bufs[key] = (torch.empty(ws, dtype=torch.float32, device="cuda"),
                              torch.zeros(cnt, dtype=torch.int32, device="cuda"))
        self.fn(x, w, y, *self.bufs[key])


def timing(old):
    from timing import graph_time_us
    from fused import skinny_gemm_wgmma as wg
    nb = E * D * 2
    ws = [(torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
          for _ in range(max(2, math.ceil((256 << 20) / nb)))]
    for M in (17, 32, 64):
        pad = wg.m_pad_for(M)
        x = torch.randn(M, D, device="cuda").to(torch.bfloat16)
        coop = spread_cfg(wg, pad)
        gem = {"spread coop": Gemm(wg, coop), "spread plain (old)": Gemm(old, spread_cfg(old, pad)),
               "vec": Gemm(wg, dataclasses.replace(coop, fold="vec")),
               "partials": Gemm(wg, dataclasses.replace(coop, fold="partials"))}
        outs, row = {}, {"M": M}
        for name, g in gem.items():
            shape = (coop.ksplit, M, E) if name == "partials" else (M, E)
            y = torch.full(shape, float("nan"), device="cuda")
            g(x, ws[0], y)
            torch.cuda.synchronize()
            outs[name] = y.clone() if name != "partials" else _fold(y)   # before the replays overwrite y
            row[name] = round(graph_time_us([lambda w_=w_, g=g, y=y: g(x, w_, y) for w_ in ws]), 2)
        ref = outs["spread coop"]
        row["bitwise"] = {n: bool(torch.equal(o, ref)) for n, o in outs.items()}
        RESULTS.append({"timing": row})
        log(f"TIME M={M:2d} " + "  ".join(f"{k}={v}" for k, v in row.items() if k != "M"))


def _fold(p):
    acc = p[0].clone()
    for s in range(1, p.shape[0]):
        acc = acc + p[s]
    return acc


def stress(mode, old_path, iters):
    """The child: `iters` rounds of filler + two spread launches on two priorities."""
    from fused import skinny_gemm_wgmma as wg
    mod = wg if mode == "coop" else load_old(old_path)
    g = Gemm(mod, spread_cfg(mod, 64))
    w = (torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
    x = torch.randn(64, D, device="cuda").to(torch.bfloat16)
    a_big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    lo, hi = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    fill = torch.cuda.Stream()
    ys = [torch.empty(64, E, device="cuda") for _ in range(2)]
    for s, y in ((lo, ys[0]), (hi, ys[1])):          # compile and allocate per stream first
        with torch.cuda.stream(s):
            g(x, w, y)
    torch.cuda.synchronize()
    want = ys[0].clone()
    t0 = time.time()
    for i in range(iters):
        with torch.cuda.stream(fill):
            a_big @ a_big
        with torch.cuda.stream(lo):                   # queued behind the filler's CTAs
            g(x, w, ys[0])
        with torch.cuda.stream(hi):                   # ahead of both once it is issued; the delay
            torch.cuda._sleep(1 + (i % 32) * 100_000)  # sweeps 0..1.6 ms over the filler's drain
            g(x, w, ys[1])
        if i % 10 == 9:
            torch.cuda.synchronize()
            print(f"STRESS {mode} {i + 1} rounds {time.time() - t0:.1f}s", flush=True)
    torch.cuda.synchronize()
    ok = all(torch.equal(y, want) for y in ys)
    print(f"STRESS {mode} done {iters} rounds {time.time() - t0:.1f}s bitwise={ok}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--old", help="the plain-launch source (timing and --stress plain)")
    ap.add_argument("--stress", choices=("plain", "coop"))
    ap.add_argument("--iters", type=int, default=640)
    ap.add_argument("--limit", type=float, default=40.0)
    args = ap.parse_args()
    if args.stress:
        return stress(args.stress, args.old, args.iters)
    log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__} date {time.strftime('%Y-%m-%d %H:%M:%S')}")
    try:
        timing(load_old(args.old))
    except Exception as e:
        import traceback
        log(f"ERROR timing: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    for mode in ("coop", "plain"):
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, "--old", args.old, "--stress", mode,
                                "--iters", str(args.iters)], capture_output=True, text=True, timeout=args.limit)
            tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
            verdict = f"rc={r.returncode} " + " | ".join(tail)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            last = out.strip().splitlines()[-1:] if out else []
            verdict = f"HANG: killed after {args.limit:.0f} s; last: {last}"
        RESULTS.append({"stress": mode, "verdict": verdict, "s": round(time.time() - t0, 1)})
        log(f"STRESS {mode}: {verdict} ({time.time() - t0:.1f} s)")
    from timing import save_outputs
    save_outputs(args.out, "streams", RESULTS, LOG)


if __name__ == "__main__":
    main()
