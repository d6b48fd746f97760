"""Kernels to look at under Nsight Compute (bench/gpu_run.sh job `ncu`): each workload runs warm
(compiled, weights resident), then once inside an NVTX range named after it, which the ncu command
line selects. Workloads: the router's two kernels at B = 1 and 64, skinny_gemm 7168->3584 at M = 8
and 64, 1536->7168 (o_proj) at M = 8, mxfp4_dequant bf16 [7168, 2048]."""
import torch

from fused import mxfp4_dequant as fq
from fused import router_topk as fr
from fused import skinny_gemm as sg


def probe(name, fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def main():
    torch.manual_seed(0)
    E, D = 896, 7168
    w = (torch.randn(E, D, device="cuda") * D ** -0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.01
    for B in (1, 64):
        x = torch.randn(B, D, device="cuda").to(torch.bfloat16)
        probe(f"router_b{B}", lambda x=x: fr.router_topk(x, w, bias, 16, 2.5))
    for K, N, Ms in ((7168, 3584, (8, 64)), (1536, 7168, (8,))):
        wg = torch.randn(N, K, device="cuda").to(torch.bfloat16)
        for M in Ms:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            probe(f"gemm_{K}x{N}_m{M}", lambda x=x, wg=wg: sg.skinny_gemm(x, wg))
    q = torch.randint(0, 256, (7168, 1024), device="cuda", dtype=torch.uint8)
    sc = torch.randint(110, 135, (7168, 64), device="cuda", dtype=torch.uint8)
    probe("dequant", lambda: fq.mxfp4_dequant(q, sc, "bfloat16"))


if __name__ == "__main__":
    main()
