"""A fused kernel's current source against another version of its source file (e.g. the last
certified one, `git show REV:fused/OP.py > FILE`), on the GPU.

kda_decode: bitwise y, state and conv_state for every KdaConfig on a set of shapes (bf16 and fp16,
strided activations, Dh 16..128), then CUDA-graph timings of both dispatchers and of every current
KdaConfig (and bench-only trial config) at T = 1 (96 heads) and T = 8 (12 heads), B = 1, 8, 32, 64
(env KDA_BATCHES=1,8,12,... for others, KDA_TS=8 for T = 8 only; KDA_TRIALS: launches beyond the
source's own configs, see _kda_configs).
attn_res_rmsnorm: prefix and blocks bitwise, out against the fp64 oracle (bench_wave1b's derived
criterion) and its largest difference from the old version in ulps, for every AttnResConfig; then
timings of both dispatchers and of every current config at D = 7168, B = 1..64 (env ATTN_BATCHES=1,8,..,
ATTN_NBS=0,4,8 (n_blocks, no block write; default 8 without and 4 with a write), ATTN_CFGS=t224c4,...;
ATTN_TRIALS=896x1,...: launches beyond all_configs).
router_topk (the old fused/router_topk.py with its fused/router_topk_select.py beside it): ids and
weights bitwise for every top-k kernel with the same logits GEMM, the current default's ids and weights
against the old default's; then timings of both defaults and of the current top-k with the old
default's logits GEMM, B = 1..64.
Timings use bench_wave1b's method (operands from HBM, median of 5 batches of graph replays).

    python3 -m bench.bench_versions --op kda_decode --old FILE --out $OUT    # versions_OP.log / .json

A change that only moves loads or renames values should be bitwise equal: then the old version's
accuracy evidence carries over, and only the speed is new.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import os
import sys

import torch

from bench import bench_wave1b as w1b
from bench.timing import save_outputs
from bench.bench_wave1b import attn_bytes, attn_inputs, attn_tag, bench, bitwise, clone_all, derived, kda_bytes, kda_inputs, log, record

CASES = [  # (B, H, Dh, strided, wd)
    (1, 12, 128, False, torch.bfloat16), (3, 12, 128, True, torch.bfloat16),
    (8, 12, 128, False, torch.bfloat16), (2, 96, 128, False, torch.bfloat16),
    (2, 12, 128, False, torch.float16), (3, 4, 32, False, torch.bfloat16),
    (2, 6, 16, False, torch.bfloat16), (3, 2, 64, False, torch.bfloat16),
    (8, 96, 128, False, torch.bfloat16), (5, 96, 64, True, torch.float16)]   # > 3 heads per persistent CTA


SIBLINGS = {"router_topk": "router_topk_select"}     # modules of an op that live in a file of their own


def load_old(op: str, path: str):
    """The old source as module `OP_old`, its compile cache under its own key; a sibling module
    (SIBLINGS) is loaded from the same directory and imported by the old source in its place."""
    src = open(path).read().replace(f'compile_cache("{op}")', f'compile_cache("{op}@old")')
    if op in SIBLINGS:
        sib = SIBLINGS[op]
        load_old(sib, os.path.join(os.path.dirname(path), f"{sib}.py"))
        src = src.replace(f"from fused.{sib} import", f"from {sib}_old import")
    spec = importlib.util.spec_from_loader(f"{op}_old", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"{op}_old"] = mod
    exec(compile(src, path, "exec", dont_inherit=True), mod.__dict__)   # not this file's __future__ flags
    return mod


def _kda_launch(mod, s: dict, cfg=None):
    """One launch of `mod` (kda_decode, any version) on input set `s`, in place; returns y."""
    y = torch.empty_like(s["z"])
    mod.launch(**{k: v for k, v in s.items() if isinstance(v, torch.Tensor)}, y=y,
               lower_bound=s["lower_bound"], l2_eps=s["l2_eps"], norm_eps=s["norm_eps"], variant=cfg)
    return y


def run(mod, inp: dict, cfg):
    """y, state, conv_state of one launch on copies of the inputs."""
    s = clone_all(inp)
    y = _kda_launch(mod, s, cfg)
    torch.cuda.synchronize()
    return y, s["state"], s["conv_state"]


def _kda_configs(mod, extra: bool = False) -> list:
    """Every KdaConfig of `mod`, and its bench-only trial configs where it has them; with `extra`, also
    the launches named in env KDA_TRIALS ("warps,early,stages,ctas_per_sm[,max_ctas];...", e.g.
    "4,1,1,2;4,1,2,1"): trial launches timed without editing the kernel's source (and so its hash)."""
    trial = getattr(mod.KdaConfig, "trial_configs", None)
    cfgs = mod.KdaConfig.all_configs() + (trial() if trial else [])
    for spec in os.environ.get("KDA_TRIALS", "").split(";") if extra else ():
        if spec.strip():
            w, early, *rest = (int(x) for x in spec.split(","))
            cfg = mod.KdaConfig(w, bool(early), *rest)
            cfgs += [] if cfg in cfgs else [cfg]
    return cfgs


def _kda_name(cfg) -> str:
    return getattr(cfg, "name", f"w{cfg.num_warps}")


def _old_twin(old, cfg):
    """The old version's launch to compare `cfg` with: the same-named config where the old source has
    one; else the one-CTA kernel with the same warps and conv loading (a persistent launch does its
    arithmetic in its order), if the old source has early_conv; else the plain one with the same warps."""
    old_cfgs = {_kda_name(c): c for c in _kda_configs(old)}
    if _kda_name(cfg) in old_cfgs:
        return old_cfgs[_kda_name(cfg)]
    early = getattr(cfg, "early_conv", False)
    if early and "early_conv" in {f.name for f in dataclasses.fields(old.KdaConfig)}:
        return old.KdaConfig(cfg.num_warps, True)
    return old.KdaConfig(cfg.num_warps)


def check_kda(new, old) -> None:
    log("== kda_decode: current source vs --old, bitwise, every KdaConfig against its old twin (_old_twin)")
    for B, H, Dh, strided, wd in CASES:
        inp = kda_inputs(B, H, Dh, "cuda", wd=wd, seed=B * 7 + H, strided=strided)
        for cfg in _kda_configs(new, extra=True):
            twin = _old_twin(old, cfg)
            a, b = run(new, inp, cfg), run(old, inp, twin)
            record("kda_decode", f"B={B} H={H} Dh={Dh} {str(wd)[6:]} strided={strided} {_kda_name(cfg)} "
                   f"vs old {_kda_name(twin)}",
                   [bitwise(n, x, y) for n, x, y in zip(("y", "state", "conv_state"), a, b)])


def timing_kda(new, old) -> None:
    log("== kda_decode timing, current vs old dispatcher (Dh=128, W=4, H=96/T; us per call)")
    Dh, e = 128, 2
    batches = [int(b) for b in os.environ.get("KDA_BATCHES", "1,8,32,64").split(",")]
    for T in [int(t) for t in os.environ.get("KDA_TS", "1,8").split(",")]:
        H = 96 // T
        for B in batches:
            moved = kda_bytes(B, H, Dh, e)
            fns = {"current": lambda s: new.kda_decode(**s), "old": lambda s: _kda_launch(old, s)}
            for cfg in _kda_configs(new, extra=True):        # every current launch variant, by name
                fns[_kda_name(cfg)] = (lambda c: lambda s: new.kda_decode(**s, variant=c))(cfg)
            bench("kda_decode", f"T={T} H={H} B={B}", fns, lambda i: kda_inputs(B, H, Dh, "cuda", seed=i),
                  B * H * Dh * Dh * 4, moved, 4.24e12)


ATTN_CASES = [(1, 7168, 9, 8, -1), (5, 7168, 9, 3, 3), (64, 7168, 9, 8, -1), (3, 7168, 9, 0, 0),
              (7, 256, 4, 2, -1), (2, 64, 9, 8, 8), (33, 7168, 9, 5, 6)]   # (B, D, slots, n_blocks, write)


def _attn_run(mod, inp: dict, cfg):
    s = clone_all(inp)
    out = torch.full_like(s["prefix"], float("nan"))      # poisoned: every element must be written
    mod.launch(s["prefix"], s["delta"], s["blocks"], s["res_norm_w"], s["res_proj_w"], s["norm_w"], out,
               s["n_blocks"], s["block_write"], s["eps"], s["norm_eps"], variant=cfg)
    torch.cuda.synchronize()
    return out, s["prefix"], s["blocks"]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype tensors (finite values)."""
    ia, ib = (t.view(torch.int16).to(torch.int32) for t in (a, b))
    ia, ib = (torch.where(i < 0, -32768 - i, i) for i in (ia, ib))   # sign-magnitude -> ordered
    return int((ia - ib).abs().max())


def _attn_configs(mod, D: int) -> list:
    """Every AttnResConfig of `mod` at D, and the launches named in env ATTN_TRIALS ("threads x CTAs per
    row", e.g. "896x1,768x1"), timed and checked without editing the kernel's source (and its hash)."""
    cfgs = mod.AttnResConfig.all_configs(D)
    for spec in os.environ.get("ATTN_TRIALS", "").split(","):
        if spec.strip():
            t, c = (int(x) for x in spec.split("x"))
            cfg = mod.AttnResConfig(t, c)
            cfgs += [] if cfg in cfgs or (D // 8) % c else [cfg]
    return cfgs


def check_attn(new, old) -> None:
    from references.attn_res import attn_res_rmsnorm as ref
    log("== attn_res_rmsnorm: current source vs --old, every AttnResConfig (oracle = reference on float64)")
    for B, D, NB, nb, bw in ATTN_CASES:
        inp = attn_inputs(B, D, NB, nb, bw, "cuda", seed=B * 31 + nb)
        o_out, b_out = ref(**clone_all(inp, torch.float64)), ref(**clone_all(inp))
        for cfg in _attn_configs(new, D):
            a = _attn_run(new, inp, cfg)
            b = _attn_run(old, inp, old.AttnResConfig(cfg.num_threads, cfg.cluster_n))
            checks = [derived("out", a[0], b_out, o_out, torch.bfloat16),
                      bitwise("prefix", a[1], b[1]), bitwise("blocks", a[2], b[2])]
            checks[0]["ulps_from_old"] = ulps_apart(a[0], b[0])
            record("attn_res_rmsnorm", f"B={B} D={D} nb={nb} bw={bw} {attn_tag(cfg)} "
                   f"(out {checks[0]['ulps_from_old']} ulp from old)", checks)


def timing_attn(new, old) -> None:
    log("== attn_res_rmsnorm timing, current vs old dispatcher and every current config (D=7168, 9 slots)")
    D, NB, e = 7168, 9, 2
    batches = [int(b) for b in os.environ.get("ATTN_BATCHES", "1,8,32,64").split(",")]
    cases = [(int(nb), -1) for nb in os.environ["ATTN_NBS"].split(",")] if os.environ.get("ATTN_NBS") else [(8, -1), (4, 4)]
    only = set(os.environ.get("ATTN_CFGS", "").split(",")) - {""}      # e.g. t224c4,t448c2,t448c1
    for B in batches:
        for nb, bwr in cases:
            moved = attn_bytes(B, D, nb, bwr, e)
            # both dispatchers' picks as explicit variants: the launch path, no custom op (the old
            # module would register its op under the current one's name)
            pick = new.AttnResConfig.for_shape(D, 16, B, nb)
            old_by_blocks = "n_blocks" in inspect.signature(old.AttnResConfig.for_shape).parameters
            pick_old = old.AttnResConfig.for_shape(D, 16, B, *([nb] if old_by_blocks else []))   # before session 14: by B only
            fns = {f"current {attn_tag(pick)}": lambda s: new.attn_res_rmsnorm(**s, variant=pick),
                   f"old {attn_tag(pick_old)}": lambda s: old.attn_res_rmsnorm(**s, variant=pick_old)}
            for cfg in _attn_configs(new, D):
                if not only or attn_tag(cfg) in only:
                    fns[attn_tag(cfg)] = (lambda c: lambda s: new.attn_res_rmsnorm(**s, variant=c))(cfg)
            bench("attn_res_rmsnorm", f"B={B} nb={nb} bw={bwr}", fns,
                  lambda i: attn_inputs(B, D, NB, nb, bwr, "cuda", seed=i), B * (NB + 3) * D * e, moved, 4.24e12)


ROUTER_SHAPES = [(896, 16, 7168), (48, 8, 1024), (20, 16, 256)]     # (E, k, D)


def _router_inputs(B: int, E: int, D: int, seed: int, tied: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(E, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    if tied:                                       # 4 distinct rows: exact ties the lower id must win
        w, bias = w[torch.arange(E, device="cuda") % 4].contiguous(), bias[torch.arange(E, device="cuda") % 4].contiguous()
    return {"x": x, "w_gate": w, "bias": bias}


def check_router(new, old) -> None:
    log("== router_topk: current source vs --old; every top-k kernel with the same logits GEMM bitwise, "
        "then the two defaults (their logits GEMMs may differ)")
    for E, k, D in ROUTER_SHAPES:
        for B in (1, 5, 16, 17, 32, 64):
            for tied in (False, True):
                s = _router_inputs(B, E, D, B * 7 + E, tied)
                tag = f"E={E} k={k} D={D} B={B}{' tied' if tied else ''}"
                gemm = old.logits_config(B, E, D)
                for cfg in new.all_configs():
                    a = new.router_topk(**s, top_k=k, routed_scale=2.5, variant=dataclasses.replace(cfg, gemm=gemm))
                    b = old.router_topk(**s, top_k=k, routed_scale=2.5, variant=old.RouterTopkConfig(
                        cfg.tokens_per_cta, gemm, cfg.warps_per_token, cfg.select))
                    record("router_topk", f"{tag} {cfg.name} logits {gemm.name}",
                           [bitwise("ids", a[0], b[0]), bitwise("weights", a[1], b[1])])
                a = new.router_topk(**s, top_k=k, routed_scale=2.5, variant=new.RouterTopkConfig())
                b = old.router_topk(**s, top_k=k, routed_scale=2.5, variant=old.RouterTopkConfig())
                same_ids = torch.equal(a[0], b[0])
                rel = ((a[1] - b[1]).abs() / b[1].abs().clamp_min(1e-30)).max().item() if same_ids else float("nan")
                log(f"  defaults {tag}: logits {new.logits_config(B, E, D).name} vs {gemm.name}: ids "
                    f"{'equal' if same_ids else 'DIFFER'}, weights max rel diff {rel:.3g} "
                    f"({'bitwise' if same_ids and torch.equal(a[1], b[1]) else 'not bitwise'})")


def timing_router(new, old) -> None:
    log("== router_topk timing, E=896 k=16 D=7168: current default, old default, current top-k with the "
        "old default's logits GEMM (weights from HBM; us per call)")
    E, k, D = 896, 16, 7168
    for B in (1, 2, 8, 16, 17, 32, 64):
        gemm = old.logits_config(B, E, D)
        fns = {f"current ({new.logits_config(B, E, D).name})": lambda s: new.router_topk(**s, top_k=k, routed_scale=2.5, variant=new.RouterTopkConfig()),
               f"old ({gemm.name})": lambda s: old.router_topk(**s, top_k=k, routed_scale=2.5, variant=old.RouterTopkConfig()),
               "current top-k, old logits": lambda s: new.router_topk(**s, top_k=k, routed_scale=2.5, variant=new.RouterTopkConfig(gemm=gemm))}
        bench("router_topk", f"B={B}", fns, lambda i: _router_inputs(B, E, D, i), E * D * 2, E * D * 2 + B * D * 2, 4.24e12)


OPS = {"kda_decode": (check_kda, timing_kda), "attn_res_rmsnorm": (check_attn, timing_attn),
       "router_topk": (check_router, timing_router)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True, choices=sorted(OPS))
    ap.add_argument("--old", required=True, help="an older fused/OP.py")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    new = importlib.import_module(f"fused.{args.op}")
    old = load_old(args.op, args.old)
    check, timing = OPS[args.op]
    check(new, old)
    timing(new, old)
    n_fail = sum(not r["pass"] for r in w1b.RESULTS["correctness"])
    log(f"checks: {len(w1b.RESULTS['correctness']) - n_fail} pass, {n_fail} fail")
    save_outputs(args.out, f"versions_{args.op}", w1b.RESULTS, w1b.LOG)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
