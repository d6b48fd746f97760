"""router_topk on the GPU: where the logits' error comes from, then CUDA-graph timings.

Diagnosis: fp32 logits of E=896 x D=7168 against the fp64 product, per implementation: torch fp32
(the reference, cuBLAS SGEMM), the SIMT GEMV, the tensor-core kernel accumulating in the MMA's C
fragment (the 2026-11-29 default for M >= 9), the split-K fresh-accumulator mma.sync kernel (the
default for 2..16 tokens), and the split-K wgmma kernel with its running sum in C and with fresh
accumulators per k-tile (the default from 17 tokens). Error unit: u * sum_d |x_d w_d| (u = 2^-24), the scale any fp32 summation order errs by.
Timing: the fused op per B against the reference eager, torch.compile and cuBLAS bf16 logits alone,
and a row per other certified variant (the argmax-round top-k kernels, the other logits GEMM).

    PYTHONPATH=$PWD python3 bench/bench_router.py --out $OUT
"""
import argparse
import dataclasses
import math
import time

import torch
from timing import graph_time_us, save_outputs

COPY_BW = 4.24e12
LOG, RESULTS = [], []


def log(msg):
    print(msg, flush=True)
    LOG.append(msg)


def diagnose():
    from fused import skinny_gemm as sg
    from fused.skinny_gemm_mma import SkinnyGemmMmaConfig
    from fused import router_topk as fr
    E, D = 896, 7168
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(E, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    for dist in ("normal", "wide_range"):
        for B in (16, 64):
            x = torch.randn(B, D, device="cuda", generator=g)
            if dist == "wide_range":
                x = x * torch.exp2(torch.randint(-8, 9, (B, D), device="cuda", generator=g).float())
            x = x.to(torch.bfloat16)
            exact = x.double() @ w.double().T
            unit = 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
            impls = {"torch fp32 (reference)": lambda: x.float() @ w.float().T}
            for name, cfg in (("simt gemv", sg.simt_config(B, E, D)),
                              ("mma, C-fragment chain", SkinnyGemmMmaConfig(16 if B <= 16 else 64, 8, 8, 4 if B <= 16 else 2)),
                              ("mma split7, C-fragment", SkinnyGemmMmaConfig(16 if B <= 16 else 64, 8, 8, 4 if B <= 16 else 2, True, 7, False)),
                              ("mma split-K fresh_acc", fr.mma_logits_config(B, E, D)),
                              ("wgmma split-K, C chains of 12 k-tiles", dataclasses.replace(fr.wgmma_logits_config(B, E, D), fresh_acc=False)),
                              ("wgmma split-K fresh_acc per k-tile", fr.wgmma_logits_config(B, E, D))):
                def run(cfg=cfg):
                    S = fr.partials(cfg)
                    out = torch.full((S, B, E), float("nan"), device="cuda")
                    sg.launch(x, w, out if S > 1 else out[0], cfg)
                    acc = out[0].clone()
                    for s in range(1, S):
                        acc = acc + out[s]
                    return acc
                impls[f"{name} [{cfg.name}]"] = run
            for name, fn in impls.items():
                err = (fn().double() - exact).abs() / unit
                r = dict(dist=dist, B=B, impl=name, max_err_units=round(err.max().item(), 3),
                         median_err_units=round(err.median().item(), 4), p99=round(err.quantile(0.99).item(), 3))
                RESULTS.append(r)
                log(f"DIAG {dist:10s} B={B:2d} {name:55s} max {r['max_err_units']:8.3f}  p99 {r['p99']:7.3f}  "
                    f"median {r['median_err_units']:7.4f}  (units of u*sum|xw|)")


def timing(args):
    from fused import router_topk as fr
    from references.moe import router_topk as ref_rt
    E, k, D = 896, 16, 7168
    nb = E * D * 2
    copies = max(2, math.ceil((256 << 20) / nb))
    ws = [(torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16) for _ in range(copies)]
    bias = torch.randn(E, device="cuda") * 0.01
    empty = torch.empty(1, device="cuda")
    t_empty = graph_time_us([lambda: empty.add_(0)])
    log(f"TIME empty elementwise kernel in a graph: {t_empty:.2f} us; bytes at copy bw: {nb / COPY_BW * 1e6:.2f} us")
    cr = torch.compile(ref_rt) if not args.no_compile else None
    for B in (1, 2, 4, 8, 9, 16, 32, 64):
        x = torch.randn(B, D, device="cuda").to(torch.bfloat16)
        row = {"B": B}
        row["fused"] = graph_time_us([lambda w_=w_: fr.router_topk(x, w_, bias, k, 2.5) for w_ in ws])
        vs = fr.variants({"x": x, "w_gate": ws[0]}, {})[1:]
        if B <= 16 and 1 <= B:                   # the wgmma partials logits below WGMMA_MIN_PAD (not shipped)
            vs.append(fr.RouterTopkConfig(1, fr.wgmma_logits_config(B, E, D), 4))
        for v in vs:
            row[f"fused {v.name}"] = graph_time_us([lambda w_=w_, v=v: fr.router_topk(x, w_, bias, k, 2.5, variant=v) for w_ in ws])
        row["eager"] = graph_time_us([lambda w_=w_: ref_rt(x, w_, bias, k, 2.5) for w_ in ws])
        if cr is not None:
            row["compile"] = graph_time_us([lambda w_=w_: cr(x, w_, bias, k, 2.5) for w_ in ws])
        lo = torch.empty(B, E, device="cuda", dtype=torch.bfloat16)
        row["cublas bf16 logits only"] = graph_time_us([lambda w_=w_: torch.matmul(x, w_.T, out=lo) for w_ in ws])
        row["target 1.5x(empty + bytes)"] = 1.5 * (t_empty + nb / COPY_BW * 1e6)
        RESULTS.append({"timing": {k_: round(v_, 2) if isinstance(v_, float) else v_ for k_, v_ in row.items()}})
        log("TIME " + "  ".join(f"{k_}={v_:.2f}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in row.items()))


def kernels():
    """Per-kernel device time of one fused call (torch.profiler): which launch the time goes to."""
    from torch.profiler import ProfilerActivity, profile
    from fused import router_topk as fr
    E, k, D = 896, 16, 7168
    w = (torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.01
    for B in (1, 16, 32, 64):
        x = torch.randn(B, D, device="cuda").to(torch.bfloat16)
        rounds = fr.RouterTopkConfig(1, None, 4, select="rounds")
        for label, v in (("default", None), ("rounds_w4", rounds)):
            for _ in range(3):
                fr.router_topk(x, w, bias, k, 2.5, variant=v)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fr.router_topk(x, w, bias, k, 2.5, variant=v)
                torch.cuda.synchronize()
            for ev in prof.key_averages():
                if ev.device_time_total > 0:
                    log(f"KERNEL B={B:2d} {label:16s} {ev.key[:70]:70s} calls {ev.count:3d} "
                        f"avg {ev.device_time_total / max(ev.count, 1):8.2f} us")


def gemm_sweep():
    """The logits GEMM alone per split-K config (fresh accumulators), to pick the default per M."""
    from fused import skinny_gemm as sg
    from fused import skinny_gemm_mma as mma
    from fused.skinny_gemm_mma import SkinnyGemmMmaConfig
    E, D = 896, 7168
    nb = E * D * 2
    ws = [(torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16) for _ in range(max(2, math.ceil((256 << 20) / nb)))]
    from fused import skinny_gemm_wgmma as wg
    for B in (1, 2, 8, 9, 16, 32, 64):
        x = torch.randn(B, D, device="cuda").to(torch.bfloat16)
        pad = mma.m_pad_for(B)
        row = {}
        simt = sg.simt_config(B, E, D)
        out1 = torch.empty(B, E, device="cuda")
        row[simt.name] = graph_time_us([lambda w_=w_: sg.launch(x, w_, out1, simt) for w_ in ws])
        for c in wg.configs_for(E, D, wg.m_pad_for(B)):      # wgmma, split-K partials for the top-k
            if (c.rows, c.occupancy) == (64, 1):
                cfg = dataclasses.replace(c, fold="partials", fresh_acc=True)
                out = torch.empty(cfg.ksplit, B, E, device="cuda")
                row[cfg.name] = graph_time_us([lambda w_=w_, c=cfg, o=out: sg.launch(x, w_, o, c) for w_ in ws])
        for S in (2, 4, 7, 14):
            if (D // 32) % S:
                continue
            w = mma.warps_for(D // S)
            for rows in (8, 16):
                cfg = SkinnyGemmMmaConfig(pad, rows, w, mma._unroll(D // S, w, pad), True, S, True)
                out = torch.empty(S, B, E, device="cuda")
                try:
                    row[cfg.name] = graph_time_us([lambda w_=w_, c=cfg, o=out: sg.launch(x, w_, o, c) for w_ in ws])
                except Exception as e:
                    log(f"GEMM {cfg.name} failed: {type(e).__name__}: {str(e)[:200]}")
        best = min(row, key=row.get)
        RESULTS.append({"gemm_sweep": {"B": B, **{k: round(v, 2) for k, v in row.items()}}})
        log(f"GEMM B={B:2d} best {best} {row[best]:.2f} us | " + "  ".join(f"{k}={v:.2f}" for k, v in sorted(row.items(), key=lambda kv: kv[1])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--steps", default="diagnose,kernels,timing")
    args = ap.parse_args()
    log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__} date {time.strftime('%Y-%m-%d %H:%M:%S')}")
    table = {"diagnose": diagnose, "kernels": kernels, "timing": lambda: timing(args), "gemm_sweep": gemm_sweep}
    for step in (table[n] for n in args.steps.split(",")):
        try:
            step()
        except Exception as e:
            import traceback
            log(f"ERROR: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        save_outputs(args.out, "router", RESULTS)           # after each step: a cut run keeps the rest
    save_outputs(args.out, "router", RESULTS, LOG)


if __name__ == "__main__":
    main()
