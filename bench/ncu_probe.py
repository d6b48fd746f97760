"""Kernels to look at under Nsight Compute (bench/gpu_run.sh job `ncu`) or compute-sanitizer (job
`sanprobe_TOOL`, at the K3 shapes the harness's small sanitizer cases do not reach): each workload runs warm
(compiled, weights resident), then once inside an NVTX range named after it, which the ncu command
line selects. Workloads (`--list` prints their names; arguments pick some): the router's two
kernels at B = 1, 8 and 64 (SIMT GEMV; wgmma split-K partials), skinny_gemm 7168->896 at M = 8 and 32
and 7168->3584 at M = 8 and 64 (the "cspread" cluster fold; `_cpush`: the "cpush" twin), 1536->7168 (o_proj) at M = 8,
mxfp4_dequant bf16 [7168, 2048], attn_res_rmsnorm at D = 7168 with 8 blocks at B = 1 and 64 (and with 4
blocks + a block write at B = 64: the one-CTA pick; 7 blocks + a write at B = 8), and
kda_decode at T = 8 (12 heads) B = 1, 32 (the 4-warp early_conv pick) and 64 (the persistent launch)
and T = 1 (96 heads) B = 1 and 8 (persistent)."""
import sys

import torch


def probe(name, fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def router(B):
    from fused import router_topk as fr
    E, D = 896, 7168
    w = (torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.01
    x = torch.randn(B, D, device="cuda").to(torch.bfloat16)
    return lambda: fr.router_topk(x, w, bias, 16, 2.5)


def gemm(K, N, M, fold=None):
    """The default launch, or (fold) the default's twin with this split-K fold at the same S."""
    from fused import skinny_gemm as sg
    from fused import skinny_gemm_wgmma as wg
    w = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    if fold is None:
        return lambda: sg.skinny_gemm(x, w)
    d = sg.default_config(M, N, K)
    cfg = wg.with_fold(d, fold, d.ksplit)
    return lambda: sg.skinny_gemm(x, w, variant=cfg)


def dequant():
    from fused import mxfp4_dequant as fq
    q = torch.randint(0, 256, (7168, 1024), device="cuda", dtype=torch.uint8)
    sc = torch.randint(110, 135, (7168, 64), device="cuda", dtype=torch.uint8)
    return lambda: fq.mxfp4_dequant(q, sc, "bfloat16")


def attn_res(B, nb=8, write=-1):
    from bench.bench_wave1b import attn_inputs
    from fused import attn_res_rmsnorm as fa
    s = attn_inputs(B, 7168, 9, nb, write, "cuda")
    return lambda: fa.attn_res_rmsnorm(**s)


def kda(T, B):
    from bench.bench_wave1b import kda_inputs
    from fused import kda_decode as fk
    s = kda_inputs(B, 96 // T, 128, "cuda")
    return lambda: fk.kda_decode(**s)


WORKLOADS = {
    "router_b1": lambda: router(1), "router_b8": lambda: router(8), "router_b64": lambda: router(64),
    "gemm_7168x896_m8": lambda: gemm(7168, 896, 8), "gemm_7168x896_m32": lambda: gemm(7168, 896, 32),
    "gemm_7168x3584_m8": lambda: gemm(7168, 3584, 8), "gemm_7168x3584_m64": lambda: gemm(7168, 3584, 64),
    "gemm_1536x7168_m8": lambda: gemm(1536, 7168, 8), "dequant": dequant,
    "gemm_7168x896_m8_cpush": lambda: gemm(7168, 896, 8, "cpush"),
    "gemm_7168x896_m64_cpush": lambda: gemm(7168, 896, 64, "cpush"),
    "gemm_7168x3584_m64_cpush": lambda: gemm(7168, 3584, 64, "cpush"),
    "attn_res_b1": lambda: attn_res(1), "attn_res_b64": lambda: attn_res(64),
    "attn_res_b16": lambda: attn_res(16), "attn_res_b32": lambda: attn_res(32),
    "attn_res_b64_nb4w": lambda: attn_res(64, 4, 4), "attn_res_b8_nb7w": lambda: attn_res(8, 7, 2),
    "kda_t8_b1": lambda: kda(8, 1), "kda_t1_b1": lambda: kda(1, 1), "kda_t1_b8": lambda: kda(1, 8),
    "kda_t8_b8": lambda: kda(8, 8), "kda_t8_b32": lambda: kda(8, 32), "kda_t8_b64": lambda: kda(8, 64),
}


def main(argv):
    if argv[:1] == ["--list"]:
        print(" ".join(WORKLOADS))
        return
    torch.manual_seed(0)
    for name in argv or WORKLOADS:
        probe(name, WORKLOADS[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
