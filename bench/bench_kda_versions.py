"""The current fused.kda_decode against another version of its source file (e.g. the last certified
one, `git show REV:fused/kda_decode.py > FILE`): bitwise y, state and conv_state for every
KdaConfig on a set of shapes (bf16 and fp16, strided activations, Dh 16..128), then CUDA-graph
timings of both dispatchers side by side at T = 1 (96 heads) and T = 8 (12 heads), B = 1..64, with
bench_wave1b's method (state from HBM, median of 5 batches).

    python3 -m bench.bench_kda_versions --old FILE --out $OUT     # kda_versions.log / .json

A change that only moves loads or renames values should be bitwise equal: then the old version's
accuracy evidence carries over, and only the speed is new.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from bench import bench_wave1b as w1b
from bench.bench_wave1b import bench, bitwise, clone_all, kda_inputs, log, record

CASES = [  # (B, H, Dh, strided, wd)
    (1, 12, 128, False, torch.bfloat16), (3, 12, 128, True, torch.bfloat16),
    (8, 12, 128, False, torch.bfloat16), (2, 96, 128, False, torch.bfloat16),
    (2, 12, 128, False, torch.float16), (3, 4, 32, False, torch.bfloat16),
    (2, 6, 16, False, torch.bfloat16), (3, 2, 64, False, torch.bfloat16)]


def load_old(path: str):
    """The old source as module `kda_decode_old`, its compile cache under its own key."""
    src = open(path).read().replace('compile_cache("kda_decode")', 'compile_cache("kda_decode@old")')
    spec = importlib.util.spec_from_loader("kda_decode_old", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kda_decode_old"] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def run(mod, inp: dict, cfg):
    """y, state, conv_state of one launch on copies of the inputs."""
    s = clone_all(inp)
    y = torch.empty_like(s["z"])
    mod.launch(**{k: s[k] for k in ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z", "conv_w",
                                    "conv_state", "A_log", "dt_bias", "o_norm_w", "state")},
               y=y, lower_bound=s["lower_bound"], l2_eps=s["l2_eps"], norm_eps=s["norm_eps"], variant=cfg)
    torch.cuda.synchronize()
    return y, s["state"], s["conv_state"]


def check(new, old) -> None:
    log("== kda_decode: current source vs --old, bitwise, every KdaConfig")
    for B, H, Dh, strided, wd in CASES:
        inp = kda_inputs(B, H, Dh, "cuda", wd=wd, seed=B * 7 + H, strided=strided)
        for cfg in new.KdaConfig.all_configs():
            a, b = run(new, inp, cfg), run(old, inp, old.KdaConfig(cfg.num_warps))
            record("kda_decode", f"B={B} H={H} Dh={Dh} {str(wd)[6:]} strided={strided} w{cfg.num_warps}",
                   [bitwise(n, x, y) for n, x, y in zip(("y", "state", "conv_state"), a, b)])


def timing(new, old) -> None:
    log("== kda_decode timing, current vs old dispatcher (Dh=128, W=4, H=96/T; us per call)")
    Dh, e = 128, 2
    for T in (1, 8):
        H = 96 // T
        for B in (1, 8, 32, 64):
            C = H * Dh
            moved = (B * H * Dh * Dh * 4 * 2 + B * C * e * (6 + 2 * 3 * 3) + B * H * e + 3 * C * 4 * 4
                     + C * 4 + H * 4 + Dh * 4)
            fns = {"current": lambda s: new.kda_decode(**s), "old": lambda s, m=old: _old_call(m, s)}
            bench("kda_decode", f"T={T} H={H} B={B}", fns, lambda i: kda_inputs(B, H, Dh, "cuda", seed=i),
                  B * H * Dh * Dh * 4, moved, 4.24e12)


def _old_call(old, s):
    y = torch.empty_like(s["z"])
    args = {k: v for k, v in s.items() if k not in ("lower_bound", "l2_eps", "norm_eps")}
    old.launch(**args, y=y, lower_bound=s["lower_bound"], l2_eps=s["l2_eps"], norm_eps=s["norm_eps"])
    return y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="an older fused/kda_decode.py")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    from fused import kda_decode as new
    old = load_old(args.old)
    check(new, old)
    timing(new, old)
    n_fail = sum(not r["pass"] for r in w1b.RESULTS["correctness"])
    log(f"bitwise: {len(w1b.RESULTS['correctness']) - n_fail} equal, {n_fail} differ")
    with open(f"{args.out}/kda_versions.json", "w") as f:
        json.dump(w1b.RESULTS, f, indent=1, default=str)
    with open(f"{args.out}/kda_versions.log", "w") as f:
        f.write("\n".join(w1b.LOG) + "\n")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
