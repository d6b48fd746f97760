"""The child of test_fused_compile_wgmma's two-streams test (not collected by pytest): rounds of a
filler matmul, a "spread"-fold skinny GEMM at the router shape (7168 -> 896, 64 tokens) on a
low-priority stream and another on a high-priority stream after a delay swept over the filler's run.
Each CTA of a spread grid waits for its split peers: grids placed only in part would wait on each
other forever, so the parent kills this process at its time limit and reports a hang. Prints
"STRESS done N rounds ... bitwise=True|False" at the end (both results equal to the first).

    python3 property_tests/spread_stream_stress.py [ITERS]
"""
import dataclasses
import sys
import time

import torch

E, D = 896, 7168


class Gemm:
    """One compiled variant with its own workspace and counters per stream."""

    def __init__(self, mod, cfg):
        self.mod, self.cfg = mod, cfg
        self.fn = mod.compile_variant("bfloat16", "float32", E, D, cfg)
        self.bufs = {}

    def __call__(self, x, w, y):
        key = torch.cuda.current_stream().cuda_stream
        if key not in self.bufs:
            ws, cnt = self.mod.workspace_shapes(E, self.cfg)
            self.bufs[key] = (torch.empty(ws, dtype=torch.float32, device="cuda"),
                              torch.zeros(cnt, dtype=torch.int32, device="cuda"))
        self.fn(x, w, y, *self.bufs[key])


def spread_cfg(mod, m_pad):
    for c in mod.configs_for(E, D, m_pad):
        if (c.rows, c.occupancy) == (64, 1):
            return dataclasses.replace(c, fold="spread")
    raise RuntimeError("no r64 o1 variant")


def stress(iters: int) -> None:
    from fused import skinny_gemm_wgmma as wg

    g = Gemm(wg, spread_cfg(wg, 64))
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
            print(f"STRESS {i + 1} rounds {time.time() - t0:.1f}s", flush=True)
    torch.cuda.synchronize()
    ok = all(torch.equal(y, want) for y in ys)
    print(f"STRESS done {iters} rounds {time.time() - t0:.1f}s bitwise={ok}", flush=True)


if __name__ == "__main__":
    stress(int(sys.argv[1]) if len(sys.argv) > 1 else 640)
