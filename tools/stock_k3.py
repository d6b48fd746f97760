"""Time the stock layer step at K3 per-rank shapes (T = 1) on a CUDA device: weights drawn on the device
(stock.weights), one decode step per launch captured in a CUDA graph by the bench's GraphClock, and
the step's kernel launches counted from its own CUDA graph (verify.bench.launches).
Usage: python tools/stock_k3.py [--kinds kda,mla] [--batches 1,8,64] [--context 256] [--no-fla]"""
from __future__ import annotations

import argparse
import time

import torch

import stock.layers as stock
from references.config import K3
from references.layers import DEFAULT_LAYER, new_layer_state
from stock.weights import make_layer_weights_on
from verify.bench.launches import count_launches
from verify.bench.timing import GraphClock, time_launches

STATE = {"kda": ("conv_state", "recurrent_state"), "mla": ("cache", "block_table", "seq_lens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="kda,mla")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=256, help="MLA tokens already cached per sequence")
    ap.add_argument("--no-fla", action="store_true", help="the KDA recurrence in torch even where fla-core runs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    for kind in args.kinds.split(","):
        t0 = time.perf_counter()
        w = make_layer_weights_on(kind, K3, 0, device="cuda")
        torch.cuda.synchronize()
        layer = stock.prepare(kind, w.tensors, K3, DEFAULT_LAYER[kind], torch.bfloat16,
                              use_fla=False if args.no_fla else None)
        print(f"{kind}: weights on the device in {time.perf_counter() - t0:.1f} s; fla={layer.use_fla}", flush=True)
        for B in (int(b) for b in args.batches.split(",")):
            st = new_layer_state(kind, K3, B, max_tokens=args.context + 8)
            state = {n: getattr(st, n).cuda() for n in STATE[kind]}
            if kind == "mla":
                state["seq_lens"].fill_(args.context)
            start = state["seq_lens"].clone() if kind == "mla" else None
            g = torch.Generator(device="cuda").manual_seed(B)
            blocks = torch.randn(B, 8, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
            prefix = torch.randn(B, K3.hidden, device="cuda", generator=g).to(torch.bfloat16)
            stock.validate_state(layer, prefix, blocks, state, 1)

            def step():
                if start is not None:
                    state["seq_lens"].copy_(start)     # the same slot every call (a memcpy node)
                return layer.step(prefix, blocks, *state.values())
            stats = time_launches([step], GraphClock())
            count = count_launches(step)
            print(f"{kind} B={B:3d}: {stats.median_us:9.1f} us/step (p10 {stats.p10_us:.1f}, p90 {stats.p90_us:.1f}, "
                  f"{stats.method}); launches {count.kernels} kernels {count.other} by {count.method}"
                  + (f" ({count.note})" if count.note else ""), flush=True)
        del w, layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
