"""Wave 1b on the H200: fused attn_res_rmsnorm and kda_decode. Correctness vs the fp64 oracle
(references run on float64 copies) next to the bf16 baseline, then CUDA-graph timings of the fused
kernels against the eager reference composition and torch.compile of it, at the K3 shapes.

    python3 -m bench.bench_wave1b --out $OUT          # writes wave1b.log / wave1b.json there

Timings: median of 5 timed batches of graph replays; each graph runs the op once on each of R
input sets (>= 256 MB together, so state and activations come from HBM, not L2), time / R.
% of copy bandwidth uses the measured device-to-device copy (bytes read + written).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback

import torch

LOG: list[str] = []
RESULTS: dict = {"correctness": [], "timing": []}


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


# ------------------------------------------------------------------------------------------ checks

def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e - mant)


def derived(name: str, cand, base, oracle, wd: torch.dtype, k: float = 2.0) -> dict:
    """Per row (all dims but the last): |cand-oracle| <= k*|base-oracle| + 1 ulp(max|oracle|)."""
    c, b, o = (t.double().reshape(-1, t.shape[-1]) for t in (cand, base, oracle))
    ec = (c - o).abs().amax(-1)
    eb = (b - o).abs().amax(-1)
    floor = ulp(o.abs().amax(-1), wd)
    worst = (ec / (k * eb + floor)).max().item()
    rel = ((c - o).norm() / o.norm().clamp_min(1e-300)).item()
    relb = ((b - o).norm() / o.norm().clamp_min(1e-300)).item()
    finite = bool(torch.isfinite(c).all())
    return {"out": name, "pass": finite and worst <= 1.0, "worst_ratio": worst, "rel_l2": rel,
            "rel_l2_baseline": relb, "finite": finite}


def bitwise(name: str, cand, base) -> dict:
    same = torch.equal(cand.view(torch.int16 if cand.element_size() == 2 else torch.int32),
                       base.view(torch.int16 if base.element_size() == 2 else torch.int32))
    return {"out": name, "pass": same, "bitwise": same}


def record(op: str, case: str, checks: list[dict]) -> None:
    ok = all(c["pass"] for c in checks)
    RESULTS["correctness"].append({"op": op, "case": case, "pass": ok, "checks": checks})
    parts = []
    for c in checks:
        if "worst_ratio" in c:
            parts.append(f"{c['out']}: ratio {c['worst_ratio']:.3f} rel {c['rel_l2']:.2e} (base {c['rel_l2_baseline']:.2e})")
        else:
            parts.append(f"{c['out']}: {'bitwise' if c['pass'] else 'DIFFERS'}")
    log(f"  {'PASS' if ok else 'FAIL'} {op} {case}: " + "; ".join(parts))


def clone_all(d: dict, dtype=None) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(torch.float64) if (dtype is torch.float64 and v.is_floating_point()) else v.clone()
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------------------------------ inputs

def attn_inputs(B, D, NB, n_blocks, block_write, dev, wd=torch.bfloat16, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device=dev)
    scales = torch.rand(1, NB, 1, generator=g, device=dev) * 3 + 0.3
    return dict(prefix=(rn(B, D) * 2).to(wd), delta=rn(B, D).to(wd), blocks=(rn(B, NB, D) * scales).to(wd),
                res_norm_w=(1 + 0.2 * rn(D)).to(wd), res_proj_w=(3 * rn(D) / math.sqrt(D)).to(wd),
                norm_w=(1 + 0.2 * rn(D)).to(wd), n_blocks=n_blocks, block_write=block_write,
                eps=1e-5, norm_eps=1e-5)


def kda_inputs(B, H, Dh, dev, wd=torch.bfloat16, W=4, seed=0, strided=False):
    g = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device=dev)
    C = H * Dh
    if strided:   # q,k,v,g,z as column slices of one merged projection output
        merged = rn(B, 5 * C + 16).to(wd)
        q, k, v, gr, z = (merged[:, i * C:(i + 1) * C] for i in range(5))
    else:
        q, k, v, gr, z = (rn(B, C).to(wd) for _ in range(5))
    return dict(q_raw=q, k_raw=k, v_raw=v, g_raw=gr, beta_raw=rn(B, H).to(wd), z=z,
                conv_w=0.5 * rn(3, C, W), conv_state=rn(B, 3, C, W - 1).to(wd), A_log=0.5 * rn(H),
                dt_bias=0.3 * rn(C), o_norm_w=1 + 0.2 * rn(Dh), state=0.3 * rn(B, H, Dh, Dh),
                lower_bound=-5.0, l2_eps=1e-6, norm_eps=1e-5)


# ------------------------------------------------------------------------------------------ correctness

def check_attn(dev):
    from references.attn_res import attn_res_rmsnorm as ref
    from fused import attn_res_rmsnorm as fused
    log("== attn_res_rmsnorm correctness (bf16; oracle = reference on float64 copies)")
    cases = [(1, 7168, 9, 8, -1), (5, 7168, 9, 3, 3), (64, 7168, 9, 8, -1), (3, 7168, 9, 0, 0),
             (7, 256, 4, 2, -1), (2, 64, 9, 8, 8), (33, 7168, 9, 5, 6)]
    for B, D, NB, nb, bw in cases:
        for cfg in fused.AttnResConfig.all_configs(D):
            case = f"B={B} D={D} nb={nb} bw={bw} threads={cfg.num_threads}"
            try:
                inp = attn_inputs(B, D, NB, nb, bw, dev, seed=B * 31 + nb)
                o_in, b_in, f_in = clone_all(inp, torch.float64), clone_all(inp), clone_all(inp)
                o_out = ref(**o_in)
                b_out = ref(**b_in)
                out = torch.full_like(f_in["prefix"], float("nan"))      # poisoned: every element must be written
                fused.launch(f_in["prefix"], f_in["delta"], f_in["blocks"], f_in["res_norm_w"],
                             f_in["res_proj_w"], f_in["norm_w"], out, nb, bw, 1e-5, 1e-5, variant=cfg)
                torch.cuda.synchronize()
                record("attn_res_rmsnorm", case, [
                    derived("out", out, b_out, o_out, torch.bfloat16),
                    bitwise("prefix", f_in["prefix"], b_in["prefix"]),
                    bitwise("blocks", f_in["blocks"], b_in["blocks"])])
            except Exception as e:  # noqa: BLE001
                log(f"  ERROR attn_res_rmsnorm {case}: {e!r}")
                traceback.print_exc()
                RESULTS["correctness"].append({"op": "attn_res_rmsnorm", "case": case, "pass": False, "error": repr(e)})
    try:   # the custom-op path (what the harness calls)
        inp = attn_inputs(4, 7168, 9, 8, -1, dev, seed=7)
        b_in, f_in = clone_all(inp), clone_all(inp)
        o_out = ref(**clone_all(inp, torch.float64))
        record("attn_res_rmsnorm", "custom op B=4", [derived("out", fused.attn_res_rmsnorm(**f_in), ref(**b_in), o_out, torch.bfloat16)])
    except Exception as e:  # noqa: BLE001
        log(f"  ERROR attn_res_rmsnorm custom op: {e!r}")


def check_kda(dev):
    from references.kda import kda_decode as ref
    from fused import kda_decode as fused
    log("== kda_decode correctness (bf16; oracle = reference on float64 copies)")
    cases = [(2, 12, 128, False), (8, 12, 128, True), (1, 96, 128, False), (3, 4, 32, False), (2, 6, 16, False),
             (3, 2, 64, False)]
    for B, H, Dh, strided in cases:
        for cfg in fused.KdaConfig.all_configs():
            case = f"B={B} H={H} Dh={Dh} strided={strided} warps={cfg.num_warps}"
            try:
                inp = kda_inputs(B, H, Dh, dev, seed=B * 7 + H, strided=strided)
                o_in, b_in, f_in = clone_all(inp, torch.float64), clone_all(inp), clone_all(inp)
                if strided:
                    for k in ("q_raw", "k_raw", "v_raw", "g_raw", "z"):
                        f_in[k] = inp[k]      # keep the strided views for the fused call
                o_y = ref(**o_in)
                b_y = ref(**b_in)
                y = torch.full_like(b_y, float("nan"))
                a = f_in
                fused.launch(a["q_raw"], a["k_raw"], a["v_raw"], a["g_raw"], a["beta_raw"], a["z"], a["conv_w"],
                             a["conv_state"], a["A_log"], a["dt_bias"], a["o_norm_w"], a["state"], y,
                             -5.0, 1e-6, 1e-5, variant=cfg)
                torch.cuda.synchronize()
                record("kda_decode", case, [
                    derived("y", y, b_y, o_y, torch.bfloat16),
                    derived("state", f_in["state"], b_in["state"], o_in["state"], torch.float32),
                    bitwise("conv_state", f_in["conv_state"], b_in["conv_state"])])
            except Exception as e:  # noqa: BLE001
                log(f"  ERROR kda_decode {case}: {e!r}")
                traceback.print_exc()
                RESULTS["correctness"].append({"op": "kda_decode", "case": case, "pass": False, "error": repr(e)})
    try:
        inp = kda_inputs(4, 12, 128, dev, seed=11)
        b_in, f_in = clone_all(inp), clone_all(inp)
        o_y = ref(**clone_all(inp, torch.float64))
        record("kda_decode", "custom op B=4 H=12", [derived("y", fused.kda_decode(**f_in), ref(**b_in), o_y, torch.bfloat16)])
    except Exception as e:  # noqa: BLE001
        log(f"  ERROR kda_decode custom op: {e!r}")


# ------------------------------------------------------------------------------------------ timing

MIN_NODES = 20   # calls per captured graph, at least (bench/timing.py's graph_time_us: 20)


def time_graph(fn, sets, reps=5, min_nodes=None) -> float:
    """us per call: a graph calls fn on each input set in turn, the whole rotation repeated until the
    graph holds >= min_nodes calls (MIN_NODES); median over reps batches of replays. A replay costs a
    few us of launch gap on top of its nodes: with a graph of only the 2-5 sets that rotate a large
    weight out of L2, that gap was charged to every call (0.6-0.8 us per call at skinny_gemm 7168->3584,
    session 18), which a decode layer's graph of hundreds of nodes does not pay."""
    min_nodes = MIN_NODES if min_nodes is None else min_nodes
    rounds = max(1, math.ceil(min_nodes / len(sets)))
    for s in sets[:2]:
        fn(s)
        fn(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g, stream=stream):
            for _ in range(rounds):
                for s in sets:
                    fn(s)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = max(3, min(200, int(0.02 / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n / (rounds * len(sets)))
    return statistics.median(times)


def copy_bandwidth() -> tuple[float, float]:
    """(memcpy-engine copy, SM copy kernel) of 1 GiB, bytes read + written per second."""
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    us_memcpy = time_graph(lambda s: y.copy_(x), [None], reps=5)
    us_kernel = time_graph(lambda s: torch.mul(x, 1.0, out=y), [None], reps=5)
    tiny = torch.zeros(8, device="cuda")
    log(f"one tiny kernel per graph node: {time_graph(lambda s: tiny.add_(1.0), [None] * 32):.2f} us")
    return 2 * x.nbytes / (us_memcpy * 1e-6), 2 * x.nbytes / (us_kernel * 1e-6)


def n_sets(set_bytes: int, cap: int = 48) -> int:
    """Input sets per graph: >= 256 MB together (operands from HBM, not L2), at most `cap`."""
    return max(2, min(cap, math.ceil(256e6 / set_bytes)))


def bench(op, shape, fns: dict, make_set, set_bytes, moved, bw):
    sets = [make_set(i) for i in range(n_sets(set_bytes))]
    row = {"op": op, "shape": shape, "bytes": moved, "us": {}}
    for name, fn in fns.items():
        try:
            us = time_graph(fn, sets)
            row["us"][name] = us
        except Exception as e:  # noqa: BLE001
            row["us"][name] = None
            log(f"  timing {op} {shape} {name} failed: {e!r}"[:400])
    del sets
    torch.cuda.empty_cache()
    floor = moved / bw * 1e6
    cells = []
    for name, us in row["us"].items():
        cells.append(f"{name} {us:8.2f} us ({100 * floor / us:5.1f}%)" if us else f"{name} n/a")
    log(f"  {op:17s} {shape:16s} floor {floor:7.2f} us | " + " | ".join(cells))
    row["floor_us"] = floor
    RESULTS["timing"].append(row)


def attn_bytes(B: int, D: int, nb: int, bwr: int, e: int = 2) -> int:
    """HBM bytes attn_res_rmsnorm must move: n_blocks block rows, prefix, delta, out and the prefix
    write per row (+ the block write), and the three weight vectors."""
    return B * D * e * (nb + 4 + (1 if bwr >= 0 else 0)) + 3 * D * e


def kda_bytes(B: int, H: int, Dh: int, e: int = 2) -> int:
    """HBM bytes kda_decode must move: the fp32 state read and written, activations, conv state
    read and written, conv weights, dt_bias, A_log, o_norm_w."""
    C = H * Dh
    return (B * H * Dh * Dh * 4 * 2 + B * C * e * (6 + 2 * 3 * 3) + B * H * e + 3 * C * 4 * 4
            + C * 4 + H * 4 + Dh * 4)


def attn_tag(cfg) -> str:
    """An AttnResConfig's short name in the timing tables: t<threads>c<CTAs per row>."""
    return f"t{cfg.num_threads}c{cfg.cluster_n}"


def timing_attn(bw, compile_ok=True):
    from references.attn_res import attn_res_rmsnorm as ref
    from fused import attn_res_rmsnorm as fused
    log("== attn_res_rmsnorm timing (D=7168, 9 block slots; us per call; % = bytes/(copy bw)/time)")
    comp = torch.compile(ref, dynamic=True) if compile_ok else None
    D, NB, e = 7168, 9, 2
    for B in (1, 8, 32, 64):
        for nb, bwr in ((8, -1), (4, 4)):
            moved = attn_bytes(B, D, nb, bwr, e)
            fns = {"fused": lambda s: fused.attn_res_rmsnorm(**s), "eager": lambda s: ref(**s)}
            for cfg in fused.AttnResConfig.all_configs(D):
                if cfg != fused.AttnResConfig.for_shape(D, 16, B, nb):
                    fns[attn_tag(cfg)] = (lambda c: lambda s: fused.attn_res_rmsnorm(**s, variant=c))(cfg)
            if comp is not None:
                fns["compile"] = lambda s: comp(**s)
            bench("attn_res_rmsnorm", f"B={B} nb={nb} bw={bwr}", fns,
                  lambda i: attn_inputs(B, D, NB, nb, bwr, "cuda", seed=i), B * (NB + 3) * D * e, moved, bw)


def timing_kda(bw, compile_ok=True):
    from references.kda import kda_decode as ref
    from fused import kda_decode as fused
    log("== kda_decode timing (Dh=128, W=4, H=96/T; us per call)")
    comp = torch.compile(ref, dynamic=True) if compile_ok else None
    Dh, e = 128, 2
    for T in (1, 8):
        H = 96 // T
        for B in (1, 8, 32, 64):
            moved = kda_bytes(B, H, Dh, e)
            fns = {"fused": lambda s: fused.kda_decode(**s), "eager": lambda s: ref(**s)}
            for cfg in fused.KdaConfig.all_configs():
                if cfg != fused.KdaConfig.for_shape(Dh, B * H):
                    fns[f"w{cfg.num_warps}"] = (lambda c: lambda s: fused.kda_decode(**s, variant=c))(cfg)
            if comp is not None:
                fns["compile"] = lambda s: comp(**s)
            bench("kda_decode", f"T={T} H={H} B={B}", fns,
                  lambda i: kda_inputs(B, H, Dh, "cuda", seed=i), B * H * Dh * Dh * 4, moved, bw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", choices=["attn", "kda"], default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    import cutlass
    log(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | cutlass {cutlass.__version__} | "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    if args.only in (None, "attn"):
        check_attn("cuda")
    if args.only in (None, "kda"):
        check_kda("cuda")
    log(f"correctness done in {time.time() - t0:.1f}s")
    if not args.no_timing:
        bw_memcpy, bw_kernel = copy_bandwidth()
        RESULTS["copy_bw_measured"] = {"memcpy": bw_memcpy, "kernel": bw_kernel}
        log(f"copy bandwidth (1 GiB d2d, read+write): memcpy {bw_memcpy / 1e12:.3f} TB/s, "
            f"SM kernel {bw_kernel / 1e12:.3f} TB/s; % below are of the 4.24 TB/s anchor")
        bw = RESULTS["copy_bw"] = 4.24e12
        if args.only in (None, "attn"):
            timing_attn(bw, not args.no_compile)
        if args.only in (None, "kda"):
            timing_kda(bw, not args.no_compile)
    n_fail = sum(not r["pass"] for r in RESULTS["correctness"])
    log(f"correctness: {len(RESULTS['correctness']) - n_fail} pass, {n_fail} fail; total {time.time() - t0:.1f}s")
    from bench.timing import save_outputs
    save_outputs(args.out, "wave1b", RESULTS, LOG)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
