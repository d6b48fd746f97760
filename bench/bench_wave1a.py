"""Wave 1a on the GPU: correctness, then CUDA-graph timings of skinny_gemm, mxfp4_dequant,
mla_cache_write, router_topk against torch eager, torch.compile and torch linear (cuBLAS).

Run on the H200 (see shared/device/README.md):  PYTHONPATH=$PWD python3 bench/bench_wave1a.py --out $OUT
Weights rotate over enough copies (>= 256 MB together) that every call reads them from HBM.
Prints one line per measurement; writes wave1a.json and wave1a.log under --out.
"""
import argparse
import math
import sys
import time

import torch
from timing import graph_time_us, save_outputs  # bench/timing.py (scripts run from bench/ on sys.path)

COPY_BW = 4.24e12            # bytes/s, measured device-to-device copy (shared/reference/h200-anchors.md)
ROT_BYTES = 256 << 20
LOG = []


def log(msg):
    print(msg, flush=True)
    LOG.append(msg)

def n_copies(nbytes):
    return max(2, math.ceil(ROT_BYTES / max(nbytes, 1)))


def pct(nbytes, us):
    return 100.0 * nbytes / (us * 1e-6) / COPY_BW


RESULTS = []


def record(op, shape, impl, us, nbytes, **extra):
    r = dict(op=op, shape=shape, impl=impl, us=round(us, 2), pct_bw=round(pct(nbytes, us), 1), **extra)
    RESULTS.append(r)
    log(f"{op:16s} {shape:28s} {impl:24s} {us:9.2f} us  {r['pct_bw']:5.1f}% of copy bw")


def bench_gemm(args):
    from fused import skinny_gemm as sg
    shapes = sg.K3_SHAPES if not args.quick else sg.K3_SHAPES[1:2]
    for K, N in shapes:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(n_copies(N * K * 2))]
        nb = N * K * 2
        for M in (1, 3, 8, 13, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.double() @ ws[0].double().T)
            base = torch.nn.functional.linear(x, ws[0])
            base_err = (base.double() - ref).abs().max().item()
            cfgs = [None] + (sg.all_configs(N, K) if M == 8 else [])
            for cfg in cfgs:
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                sg.skinny_gemm(x, ws[0], out=out, variant=cfg)
                err = (out.double() - ref).abs().max().item()
                rel = ((out.double() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all()) and err <= 2 * base_err + 1e-2 * ref.abs().max().item() / 64
                name = "fused:" + (cfg.name if cfg else sg.default_config(M, N, K).name)
                log(f"CHECK skinny_gemm K={K} N={N} M={M} {name} maxerr={err:.3g} cublas_err={base_err:.3g} "
                    f"rel={rel:.2e} {'OK' if ok else 'FAIL'}")
                if M in (1, 8, 64) or cfg is not None:
                    fns = [lambda w=w, o=out, c=cfg: sg.skinny_gemm(x, w, out=o, variant=c) for w in ws]
                    record("skinny_gemm", f"{K}->{N} M={M}", name, graph_time_us(fns), nb, ok=ok)
            if M in (1, 8, 64):
                outs = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                fns = [lambda w=w: torch.matmul(x, w.T, out=outs) for w in ws]
                record("skinny_gemm", f"{K}->{N} M={M}", "cublas(linear)", graph_time_us(fns), nb)
                fns = [lambda w=w: sg.skinny_gemm(x, w) for w in ws]
                record("skinny_gemm", f"{K}->{N} M={M}", "fused via custom op", graph_time_us(fns), nb)
            if M == 8 and not args.no_compile:
                cf = torch.compile(lambda a, b: (a.float() @ b.float().T).to(torch.bfloat16))
                fns = [lambda w=w: cf(x, w) for w in ws]
                record("skinny_gemm", f"{K}->{N} M={M}", "torch.compile(f32 matmul)", graph_time_us(fns), nb)
        del ws
        torch.cuda.empty_cache()


def bench_dequant(args):
    from fused.mxfp4_dequant import all_configs, mxfp4_dequant
    from references.mxfp4 import mxfp4_dequant as ref_dq
    O, I = 7168, 2048
    for out_dtype in ("bfloat16", "float16", "float32"):
        packed = torch.randint(0, 256, (O, I // 2), dtype=torch.uint8)
        scale = torch.randint(100, 150, (O, I // 32), dtype=torch.uint8)
        scale[0, :8] = torch.tensor([0, 1, 2, 126, 127, 253, 254, 255], dtype=torch.uint8)
        scale[1, :] = 255
        ref = ref_dq(packed, scale, out_dtype).cuda()
        pk, sc = packed.cuda(), scale.cuda()
        for cfg in all_configs(out_dtype):
            out = mxfp4_dequant(pk, sc, out_dtype, variant=cfg)
            ib = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32}[out_dtype]
            nan_r, nan_o = torch.isnan(ref), torch.isnan(out)
            same = bool((nan_r == nan_o).all()) and bool((ref.view(ib) == out.view(ib))[~nan_r].all())
            nan_bits = bool((ref.view(ib) == out.view(ib)).all())
            log(f"CHECK mxfp4_dequant {out_dtype} {cfg.name} bitwise(non-NaN, NaN positions)={same} "
                f"NaN bits identical={nan_bits}")
    nb = O * I // 2 + O * I // 32 + O * I * 2
    sets = [(torch.randint(0, 256, (O, I // 2), dtype=torch.uint8, device="cuda"),
             torch.randint(100, 150, (O, I // 32), dtype=torch.uint8, device="cuda")) for _ in range(n_copies(nb))]
    outs = [torch.empty(O, I, dtype=torch.bfloat16, device="cuda") for _ in sets]
    from fused import mxfp4_dequant as fm
    for cfg in all_configs():
        fns = [lambda p=p, s=s, o=o, c=cfg: fm.launch(p, s, o, c) for (p, s), o in zip(sets, outs)]
        record("mxfp4_dequant", f"[{O},{I}] bf16", "fused:" + cfg.name, graph_time_us(fns), nb)
    # the same loads and stores as the default launch with the conversion left out: what this access
    # pattern reaches on its own (if it is no faster than the kernel, the arithmetic costs nothing)
    mix = _byte_mix_kernel()
    fns = [lambda p=p, s=s, o=o: mix(p.view(torch.int32).view(-1), s.view(-1), o.view(-1))
           for (p, s), o in zip(sets, outs)]
    record("mxfp4_dequant", f"[{O},{I}] bf16", "anchor: same loads+stores, no math", graph_time_us(fns), nb)
    _write_anchors(f"[{O},{I}] bf16", outs, nb)
    lut = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], device="cuda")

    def eager(p, s):
        codes = torch.stack([p & 15, p >> 4], -1).reshape(O, I).long()
        sv = torch.exp2(s.float() - 127).masked_fill(s == 255, float("nan"))
        return (lut[codes] * sv.repeat_interleave(32, 1)).to(torch.bfloat16)
    fns = [lambda p=p, s=s: eager(p, s) for p, s in sets]
    record("mxfp4_dequant", f"[{O},{I}] bf16", "torch eager", graph_time_us(fns), nb)
    if not args.no_compile:
        ce = torch.compile(eager)
        fns = [lambda p=p, s=s: ce(p, s) for p, s in sets]
        record("mxfp4_dequant", f"[{O},{I}] bf16", "torch.compile", graph_time_us(fns), nb)


def _write_anchors(shape, outs, nb):
    """What this byte mix allows: the output's bytes written alone (fill_), and the copy-bandwidth
    anchor at this size, a device-to-device copy moving the same bytes (nb/2 read + nb/2 written)."""
    fns = [lambda o=o: o.fill_(1.0) for o in outs]
    record("mxfp4_dequant", shape, "anchor: fill_ of the output (write only)", graph_time_us(fns),
           outs[0].numel() * outs[0].element_size())
    srcs = [torch.empty(nb // 2, dtype=torch.uint8, device="cuda") for _ in outs]
    dsts = [torch.empty_like(x) for x in srcs]
    fns = [lambda a=a, b=b: b.copy_(a) for a, b in zip(srcs, dsts)]
    record("mxfp4_dequant", shape, "anchor: copy_ of the same bytes", graph_time_us(fns), nb)


def _byte_mix_kernel():
    """Bench-only anchor: mxfp4_dequant's default launch (256 threads x 4 words) doing the same
    4-byte code loads, scale-byte loads and 16-byte stores, with each output vector the code word
    plus its scale byte instead of the conversion."""
    from fused import runtime
    from fused.mxfp4_dequant import CODES, WORDS_PER_GROUP, Mxfp4Dequant, Mxfp4DequantConfig
    cutlass, cute = runtime.cutlass_modules()
    from cutlass import Int32
    T, U = 256, 4

    @cute.kernel
    def kernel(mP: cute.Tensor, mS: cute.Tensor, gW: cute.Tensor, nwords: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        base = bidx * (T * U) + tidx
        words = cute.make_rmem_tensor(cute.make_layout(U), Int32)
        exps = cute.make_rmem_tensor(cute.make_layout(U), Int32)
        for j in cutlass.range_constexpr(U):
            u = base + j * T
            if u < nwords:
                words[j] = mP[u]
                exps[j] = Int32(mS[u // WORDS_PER_GROUP])
        for j in cutlass.range_constexpr(U):
            u = base + j * T
            if u < nwords:
                ow = cute.make_rmem_tensor(cute.make_layout(CODES // 2), Int32)
                for k in cutlass.range_constexpr(CODES // 2):
                    ow[k] = words[j] + exps[j] + k
                gW[None, u].store(cute.recast_tensor(ow, gW.element_type).load())

    class Mix(Mxfp4Dequant):
        def device_kernel(self):
            return kernel

    op = Mix(Mxfp4DequantConfig(T, U), "bfloat16")
    n = runtime.sym_int()
    return runtime.compile_tvm_ffi(op.jit_host(), runtime.fake_tensor("int32", (n,)),
                                   runtime.fake_tensor("uint8", (runtime.sym_int(),), align=1),
                                   runtime.fake_tensor("bfloat16", (runtime.sym_int(8),)))


def bench_cache_write(args):
    from fused import mla_cache_write as fm
    from references.mla import mla_cache_write as ref_cw
    C, P, page = 576, 2048, 64
    for N in (1, 8, 64, 256):
        cache = torch.randn(P, page, C, dtype=torch.bfloat16, device="cuda")
        latent = torch.randn(N, C, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(P * page, device="cuda")[:N].to(torch.int64)
        slots[::3] = -1
        ref = cache.clone()
        ref_cw(latent, ref, slots)
        for cfg in fm.all_configs():
            got = cache.clone()
            fm.mla_cache_write(latent, got, slots, variant=cfg)
            same = bool((got.view(torch.int16) == ref.view(torch.int16)).all())
            log(f"CHECK mla_cache_write N={N} {cfg.name} bitwise={same}")
        nb = 2 * N * C * 2 + N * 8
        fns = [lambda: fm.mla_cache_write(latent, cache, slots)]
        record("mla_cache_write", f"N={N} C={C}", "fused", graph_time_us(fns), nb)

        def eager(lat, cch, sl):                            # capturable: no boolean-mask sync
            flat = cch.view(-1, C)
            idx = sl.clamp(min=0)
            flat[idx] = torch.where((sl >= 0)[:, None], lat, flat[idx])
        record("mla_cache_write", f"N={N} C={C}", "torch eager (clamp+where)",
               graph_time_us([lambda: eager(latent, cache, slots)]), nb)
        if not args.no_compile:
            ce = torch.compile(eager)
            record("mla_cache_write", f"N={N} C={C}", "torch.compile (clamp+where)",
                   graph_time_us([lambda: ce(latent, cache, slots)]), nb)


def bench_router(args):
    from fused import router_topk as fr
    from references.moe import router_topk as ref_rt
    for E, k, D in ((896, 16, 7168), (48, 8, 1024)):
        ws = [torch.randn(E, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_copies(E * D * 2))]
        bias = torch.randn(E, device="cuda") * 0.01
        for B in (1, 8, 64):
            x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
            rid, rw = ref_rt(x, ws[0], bias, k, 2.5)
            for cfg in fr.all_configs():
                ids, w = fr.router_topk(x, ws[0], bias, k, 2.5, variant=cfg)
                id_ok = bool((ids == rid).all())
                werr = (w - rw).abs().max().item()
                log(f"CHECK router_topk E={E} k={k} B={B} {cfg.name} ids_equal={id_ok} "
                    f"n_id_diff={int((ids != rid).sum())} weights_maxerr={werr:.2e}")
            nb = E * D * 2
            shape = f"E={E} k={k} D={D} B={B}"
            fns = [lambda w_=w_: fr.router_topk(x, w_, bias, k, 2.5) for w_ in ws]
            record("router_topk", shape, "fused", graph_time_us(fns), nb)
            fns = [lambda w_=w_: ref_rt(x, w_, bias, k, 2.5) for w_ in ws]
            record("router_topk", shape, "torch eager (reference)", graph_time_us(fns), nb)
            lo = torch.empty(B, E, device="cuda", dtype=torch.bfloat16)
            fns = [lambda w_=w_: torch.matmul(x, w_.T, out=lo) for w_ in ws]
            record("router_topk", shape, "cublas linear only", graph_time_us(fns), nb)
            if not args.no_compile and B == 8:
                cr = torch.compile(ref_rt)
                fns = [lambda w_=w_: cr(x, w_, bias, k, 2.5) for w_ in ws]
                record("router_topk", shape, "torch.compile(reference)", graph_time_us(fns), nb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ops", default="gemm,dequant,cache,router")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__} "
        f"date {time.strftime('%Y-%m-%d %H:%M:%S')}")
    table = {"gemm": bench_gemm, "dequant": bench_dequant, "cache": bench_cache_write, "router": bench_router}
    for name in args.ops.split(","):
        t0 = time.time()
        try:
            table[name](args)
        except Exception as e:                                  # keep the other ops' numbers
            import traceback
            log(f"ERROR in {name}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        log(f"[{name} took {time.time() - t0:.1f} s]")
        save_outputs(args.out, "wave1a", RESULTS, LOG)
    from fused.runtime import cache_info
    log(f"compile cache: {cache_info()}")
    with open(f"{args.out}/wave1a.log", "w") as f:
        f.write("\n".join(LOG) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
