"""mxfp4_dequant: packed[O, I/2] uint8 + scale[O, I/32] uint8 -> w[O, I] (bf16, fp16 or fp32).

Elementwise over the flattened tensors: one 32-bit word of packed codes (8 columns, 4 bytes) is a
unit; group g = word // 4 owns scale byte g (both tensors are contiguous, so the flat indices line
up across rows). Each thread takes `units` words spaced one CTA width apart (a warp loads 128
contiguous bytes of codes), all loads issued before any arithmetic. The compiled kernel depends on
the output dtype and the launch shape only, not on O or I.

Stores, by variant: "word" launches store each word's 16 bytes from the thread (a warp writes 32 x
16 bytes contiguous per unit). "bulk" launches (bf16, the default there) put them in shared memory
and thread 0 writes the CTA's whole contiguous span (16 KB at 256 x 4) with one bulk async copy
(cp.async.bulk global <- shared, dynamic size: the grid's last span may be short); on the H200 it
is the faster store (results/performance.md). No L2 eviction hint: the GEMM that reads the weights
next may hit them in L2.

Value of code c (low nibble = even column; bit 3 = sign, bits 0-2 = magnitude m): the fp32 word
`sign << 31 | m << 22` holds E2M1(m) * 2^-126 exactly (m = 1 is the subnormal 2^-127, m >= 2 has
exponent field m >> 1 and mantissa bit m & 1), so `word * 2^126` is E2M1 exactly and one more
multiply by 2^(e-127) (e = 0 is the subnormal 2^-127, built from its bits) is the exact product or
its overflow to inf. The float64 reference rounds the same exact value once to the output dtype;
the kernel's one rounding (fp32 -> output, RNE) matches it bit for bit. fp32 multiplies keep
subnormals here (no flush-to-zero). Scale byte 0xFF selects the output dtype's canonical NaN
constant, so NaN bits do not depend on the hardware's NaN propagation. Code 0x8 is -0.0.
"""
from dataclasses import dataclass

import torch

from fused import runtime

GROUP = 32
CODES = 8                          # codes per 32-bit word of `packed`
WORDS_PER_GROUP = GROUP // CODES


@dataclass(frozen=True)
class Mxfp4DequantConfig:
    threads: int = 256
    units: int = 4                 # words per thread, loaded before any arithmetic
    bulk: bool = False             # bf16 only: the CTA's output span through shared memory, one bulk store

    @property
    def name(self) -> str:
        return f"{'bulk' if self.bulk else 'word'}_t{self.threads}_u{self.units}"


def default_config(out_dtype: str) -> Mxfp4DequantConfig:
    return Mxfp4DequantConfig(256, 4, bulk=out_dtype == "bfloat16")


def all_configs(out_dtype: str = "bfloat16") -> list[Mxfp4DequantConfig]:
    """The word-store launches (any output dtype), and for bf16 the bulk-store default."""
    words = [Mxfp4DequantConfig(256, 4), Mxfp4DequantConfig(128, 8), Mxfp4DequantConfig(256, 1),
             Mxfp4DequantConfig(256, 8), Mxfp4DequantConfig(512, 4)]
    return words + ([Mxfp4DequantConfig(256, 4, bulk=True)] if out_dtype == "bfloat16" else [])


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs (their output dtype)."""
    return all_configs(params["out_dtype"])


def _code_bits(cutlass, word, i: int):
    """fp32 bits of E2M1(code i of `word`) * 2^-126 with the code's sign (see the module doc)."""
    from cutlass import Int32
    sign = (word << (28 - 4 * i)) & Int32(-0x80000000)
    mag = (word << (22 - 4 * i)) if i <= 5 else (word >> (4 * i - 22))
    return sign | (mag & Int32(0x01C00000))


# bf16 bytes of E2M1 magnitudes 0..7 (0, .5, 1, 1.5, 2, 3, 4, 6), as prmt tables (bytes 0-3, 4-7)
_HI = (0x3F3F3F00, 0x40404040)
_LO = (0xC0800000 - (1 << 32), 0xC0804000 - (1 << 32))
_PAIR_LO, _PAIR_HI = 0x5140, 0x7362      # prmt selectors: interleave bytes 0,4,1,5 / 2,6,3,7
_NEG_ZERO_X2 = 0x80008000 - (1 << 32)
_NAN_X2 = 0x7FC07FC0


def _bf16_words(cutlass, cute, Int32, w, e, ow):
    """The 8 codes of `w` times 2^(e-127) as four bf16x2 words into `ow`. Byte permutes look up
    each magnitude's high and low bf16 byte, the sign bits are moved into the high bytes, and one
    bf16x2 fma by the scale (+ -0.0, so -0.0 stays -0.0) forms the value: E2M1 * 2^k has two
    significant bits, so the bf16 product is exact (subnormals included) or overflows to inf,
    the reference's RNE result."""
    prmt = cute.arch.prmt
    s16 = Int32(cutlass.select_(e == 0, Int32(0x0040), e << 7))   # e = 0: 2^-127, a bf16 subnormal
    sw = s16 | (s16 << 16)
    mw = w & Int32(0x77777777)
    mhi = mw >> 16
    se = (w << 4) & Int32(0x80808080 - (1 << 32))     # sign of nibble 2j at the msb of byte j
    so = w & Int32(0x80808080 - (1 << 32))            # sign of nibble 2j+1
    h03 = Int32(prmt(_HI[0], _HI[1], mw)) | Int32(prmt(se, so, _PAIR_LO))
    h47 = Int32(prmt(_HI[0], _HI[1], mhi)) | Int32(prmt(se, so, _PAIR_HI))
    l03 = Int32(prmt(_LO[0], _LO[1], mw))
    l47 = Int32(prmt(_LO[0], _LO[1], mhi))
    pairs = (prmt(l03, h03, _PAIR_LO), prmt(l03, h03, _PAIR_HI),
             prmt(l47, h47, _PAIR_LO), prmt(l47, h47, _PAIR_HI))
    for k in range(4):
        v = Int32(cute.arch.fma_packed_bf16x2(Int32(pairs[k]), sw, Int32(_NEG_ZERO_X2)))
        ow[k] = Int32(cutlass.select_(e == 255, Int32(_NAN_X2), v))


class Mxfp4Dequant:
    def __init__(self, cfg: Mxfp4DequantConfig, out_dtype: str):
        if cfg.bulk and out_dtype != "bfloat16":
            raise ValueError(f"variant: {cfg.name} stores bf16 only, not {out_dtype}; use a word_* variant")
        self.cfg, self.out_dtype = cfg, out_dtype

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        bulk = self.cfg.bulk
        kernel = self.bulk_kernel() if bulk else self.device_kernel()
        T, U = self.cfg.threads, self.cfg.units

        @cute.jit
        def host(mP: cute.Tensor, mS: cute.Tensor, mW: cute.Tensor, stream):
            nwords = mP.shape[0]
            out = mW if cutlass.const_expr(bulk) else cute.zipped_divide(mW, (CODES,))
            kernel(mP, mS, out, nwords).launch(grid=[(nwords + T * U - 1) // (T * U), 1, 1],
                                               block=[T, 1, 1], stream=stream)

        return host

    def bulk_kernel(self):
        """bf16 out through shared memory: the default kernel's loads and conversion, each word's 16
        bytes to shared memory, then one bulk async store of the CTA's span by thread 0, which waits
        for the copy to have read shared memory before the CTA exits."""
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32
        from cutlass._mlir.dialects import nvvm

        T, U = self.cfg.threads, self.cfg.units
        span = T * U

        @cute.kernel
        def kernel(mP: cute.Tensor, mS: cute.Tensor, mW: cute.Tensor, nwords: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            base = bidx * span
            sOut = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout((CODES // 2, span)), 128)
            words = cute.make_rmem_tensor(cute.make_layout(U), Int32)
            exps = cute.make_rmem_tensor(cute.make_layout(U), Int32)
            for j in cutlass.range_constexpr(U):
                u = base + tidx + j * T
                if u < nwords:
                    words[j] = mP[u]
                    exps[j] = Int32(mS[u // WORDS_PER_GROUP])
            for j in cutlass.range_constexpr(U):
                w = tidx + j * T
                if base + w < nwords:
                    ow = cute.make_rmem_tensor(cute.make_layout(CODES // 2), Int32)
                    _bf16_words(cutlass, cute, Int32, words[j], exps[j], ow)
                    sOut[None, w].store(ow.load())
            cute.arch.fence_proxy("async.shared", space="cta")     # st.shared before the async proxy reads
            cute.arch.sync_threads()
            if tidx == 0:
                n = cutlass.min(nwords - base, span)
                nvvm.cp_async_bulk_global_shared_cta((mW.iterator + base * CODES).to_llvm_ptr(),
                                                     sOut.iterator.to_llvm_ptr(), Int32(n * CODES * 2).ir_value())
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory must outlive the reads

        return kernel

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32, Int32

        T, U = self.cfg.threads, self.cfg.units
        bf16_out = self.out_dtype == "bfloat16"

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
                    e = exps[j]
                    w = words[j]
                    if cutlass.const_expr(bf16_out):
                        ow = cute.make_rmem_tensor(cute.make_layout(CODES // 2), Int32)
                        _bf16_words(cutlass, cute, Int32, w, e, ow)
                        gW[None, u].store(cute.recast_tensor(ow, gW.element_type).load())
                    else:
                        sbits = cute.make_rmem_tensor(cute.make_layout(1), Int32)
                        sbits[0] = e << 23
                        if e == 0:
                            sbits[0] = Int32(0x00400000)           # 2^-127, an fp32 subnormal
                        scale = cute.recast_tensor(sbits, Float32)[0]
                        bits = cute.make_rmem_tensor(cute.make_layout(CODES), Int32)
                        for i in cutlass.range_constexpr(CODES):
                            bits[i] = _code_bits(cutlass, w, i)
                        vals = cute.recast_tensor(bits, Float32).load() * Float32(2.0 ** 126) * scale
                        outv = vals.to(gW.element_type)
                        if e == 255:
                            outv = cute.full_like(outv, float("nan"))
                        gW[None, u].store(outv)

        return kernel


@runtime.compile_cache("mxfp4_dequant")
def _compile(out_dtype: str, cfg: Mxfp4DequantConfig):
    n = runtime.sym_int()
    op = Mxfp4Dequant(cfg, out_dtype)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor("int32", (n,)),
        runtime.fake_tensor("uint8", (runtime.sym_int(),), align=1),
        runtime.fake_tensor(out_dtype, (runtime.sym_int(CODES),)))


_OUT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _check(packed, scale, out_dtype):
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype: {out_dtype!r} has no fused kernel; use one of {sorted(_OUT)}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"packed: expected 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    O, I = packed.shape[0], packed.shape[1] * 2
    if I % GROUP:
        raise ValueError(f"packed: input dim {I} is not a multiple of the group {GROUP}")
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (O, I // GROUP):
        raise ValueError(f"scale: expected uint8 {(O, I // GROUP)}, got {scale.dtype} {tuple(scale.shape)}")
    runtime.require_cuda("packed", packed)


def launch(packed, scale, out, variant=None) -> None:
    if packed.shape[0] == 0:
        return
    out_dtype = runtime.dtype_name(out.dtype)
    cfg = variant or default_config(out_dtype)
    if cfg.bulk and out_dtype != "bfloat16":
        raise ValueError(f"variant: {cfg.name} stores bf16 only, not {out_dtype}; use a word_* variant")
    fn = _compile(out_dtype, cfg)
    # the kernel reads `packed` as 32-bit words and writes 16-byte vectors (bulk stores: 16-byte
    # aligned spans): fresh storage if the caller's views are offset or strided
    packed = runtime.aligned(packed)
    dst = out if out.is_contiguous() and out.data_ptr() % 16 == 0 else torch.empty_like(
        out, memory_format=torch.contiguous_format)
    args = (packed.view(torch.int32).view(-1), scale.contiguous().view(-1), dst.view(-1))
    fn(*args)
    if dst is not out:
        out.copy_(dst)


_op = None


def _custom_op():
    global _op
    if _op is None:
        @runtime.register_op("mxfp4_dequant", mutates_args=("out",))
        def mxfp4_dequant_out(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
            launch(packed.contiguous(), scale.contiguous(), out)

        _op = mxfp4_dequant_out
    return _op


def mxfp4_dequant(packed, scale, out_dtype: str = "bfloat16", *, out=None, variant=None):
    """Fused replacement of references.mxfp4.mxfp4_dequant (same signature)."""
    _check(packed, scale, out_dtype)
    if out is None:
        out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=_OUT[out_dtype],
                          device=packed.device)
    if variant is not None:
        launch(packed.contiguous(), scale.contiguous(), out, variant)
    else:
        _custom_op()(packed, scale, out)
    return out
