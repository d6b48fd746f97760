"""Bench-only experiment: mxfp4_dequant (bf16 out) with the output written through shared memory by
bulk async stores (`cp.async.bulk.global.shared::cta.bulk_group`, the non-tensor TMA store) instead
of each thread's 16-byte st.global.

Why: the default launch reaches 77.6-79.2 % of copy bandwidth at [7168, 2048] and the stores are the
time (results/gpu/targets.md, "mxfp4_dequant"). Each CTA's words are contiguous, so its output is
one contiguous span; the hypothesis is that one bulk store per span writes DRAM better than 4096
per-thread 16-byte stores. Not certified and not dispatched: fused/mxfp4_dequant.py is untouched.

Per CTA: `chunks` chunks of threads x units words (16 B of bf16 out per word, so 16 KB per chunk
at 256 x 4). Per chunk: the same loads as the default kernel (thread t takes words t + j*threads),
the same conversion (`_bf16_words`), a 16-byte st.shared per word, fence.proxy.async, a barrier,
then thread 0 issues one bulk store of the chunk (dynamic size: the grid's last chunk may be
short; any multiple of 16 bytes is legal). With `stages` = 2 the next chunk converts into the other
buffer while the previous store drains (thread 0 waits `cp.async.bulk.wait_group.read` before a
buffer is reused). `evict_first` adds `.L2::cache_hint` with a createpolicy evict_first policy.
"""
from dataclasses import dataclass

import torch

from fused import runtime
from fused.mxfp4_dequant import CODES, WORDS_PER_GROUP, _bf16_words

WORD_BYTES = CODES * 2                      # bf16 output bytes per 32-bit word of codes


@dataclass(frozen=True)
class BulkStoreConfig:
    threads: int = 256
    units: int = 4                          # words per thread per chunk
    chunks: int = 1                         # chunks per CTA: its span is chunks*threads*units words
    stages: int = 1                         # smem buffers; 2 overlaps a chunk's store with the next
    evict_first: bool = False               # L2 evict_first cache hint on the bulk store
    preload: bool = False                   # every chunk's loads before the first conversion

    @property
    def name(self) -> str:
        ef = "_ef" if self.evict_first else ""
        pl = "_pl" if self.preload else ""
        return f"bulk_t{self.threads}_u{self.units}_c{self.chunks}_s{self.stages}{ef}{pl}"

    @property
    def chunk_words(self) -> int:
        return self.threads * self.units


def all_configs() -> list[BulkStoreConfig]:
    """16 KB per CTA (the direct test), 32 KB / 64 KB spans double-buffered, and the cache hint."""
    return [BulkStoreConfig(256, 4, 1, 1), BulkStoreConfig(256, 4, 1, 1, True),
            BulkStoreConfig(128, 8, 1, 1), BulkStoreConfig(256, 4, 2, 2),
            BulkStoreConfig(256, 4, 4, 2), BulkStoreConfig(256, 4, 4, 2, True),
            BulkStoreConfig(256, 8, 2, 2), BulkStoreConfig(256, 4, 4, 2, preload=True)]


def _evict_first_policy():
    """A 64-bit L2 cache policy: evict_first for the whole access (createpolicy, PTX ISA 7.4)."""
    from cutlass import Int64
    from cutlass._mlir.dialects import llvm
    return llvm.inline_asm(Int64.mlir_type, [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;",
                           "=l")


def _bulk_store(gptr, sptr, nbytes, evict_first: bool):
    """cp.async.bulk.global.shared::cta.bulk_group [gptr], [sptr], nbytes (+ L2 cache hint)."""
    from cutlass import Int32
    from cutlass._mlir.dialects import nvvm
    policy = _evict_first_policy() if evict_first else None
    nvvm.cp_async_bulk_global_shared_cta(gptr.to_llvm_ptr(), sptr.to_llvm_ptr(),
                                         Int32(nbytes).ir_value(), l2_cache_hint=policy)


class Mxfp4DequantBulkStore:
    def __init__(self, cfg: BulkStoreConfig):
        if cfg.stages not in (1, 2) or cfg.chunks < 1:
            raise ValueError(f"cfg: stages must be 1 or 2 and chunks >= 1, got {cfg}")
        self.cfg = cfg

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        kernel = self.device_kernel()
        span = self.cfg.chunk_words * self.cfg.chunks

        @cute.jit
        def host(mP: cute.Tensor, mS: cute.Tensor, mW: cute.Tensor, stream):
            nwords = mP.shape[0]
            kernel(mP, mS, mW, nwords).launch(grid=[(nwords + span - 1) // span, 1, 1],
                                              block=[self.cfg.threads, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32
        T, U, C, S = self.cfg.threads, self.cfg.units, self.cfg.chunks, self.cfg.stages
        CW = T * U
        evict_first = self.cfg.evict_first
        # chunk c loads chunks LOAD[c][0]..LOAD[c][1]-1 (all at c = 0 with preload, else its own)
        LOAD = [((0, C) if c == 0 else (C, C)) if self.cfg.preload else (c, c + 1) for c in range(C)]

        @cute.kernel
        def kernel(mP: cute.Tensor, mS: cute.Tensor, mW: cute.Tensor, nwords: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.memory.SmemAllocator()
            sOut = smem.allocate_tensor(Int32, cute.make_layout((CODES // 2, CW, S)), 128)
            words = cute.make_rmem_tensor(cute.make_layout((U, C)), Int32)
            exps = cute.make_rmem_tensor(cute.make_layout((U, C)), Int32)
            for c in cutlass.range_constexpr(C):
                cbase = (bidx * C + c) * CW
                for lc in cutlass.range_constexpr(LOAD[c][0], LOAD[c][1]):
                    for j in cutlass.range_constexpr(U):
                        u = (bidx * C + lc) * CW + tidx + j * T
                        if u < nwords:
                            words[j, lc] = mP[u]
                            exps[j, lc] = Int32(mS[u // WORDS_PER_GROUP])
                if cutlass.const_expr(c >= S):              # buffer c % S: its store must have read it
                    if tidx == 0:
                        cute.arch.cp_async_bulk_wait_group(S - 1, read=True)
                    cute.arch.sync_threads()
                for j in cutlass.range_constexpr(U):
                    w = tidx + j * T
                    if cbase + w < nwords:
                        ow = cute.make_rmem_tensor(cute.make_layout(CODES // 2), Int32)
                        _bf16_words(cutlass, cute, Int32, words[j, c], exps[j, c], ow)
                        sOut[None, w, c % S].store(ow.load())
                cute.arch.fence_proxy("async.shared", space="cta")   # st.shared before the async proxy reads
                cute.arch.sync_threads()
                if tidx == 0:
                    n = cutlass.min(nwords - cbase, CW)
                    if n > 0:
                        _bulk_store(mW.iterator + cbase * CODES, sOut[None, None, c % S].iterator,
                                    n * WORD_BYTES, evict_first)
                        cute.arch.cp_async_bulk_commit_group()
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)     # smem must outlive the reads

        return kernel


@runtime.compile_cache("mxfp4_dequant_bulk_store")
def _compile(cfg: BulkStoreConfig):
    op = Mxfp4DequantBulkStore(cfg)
    return runtime.compile_tvm_ffi(
        op.jit_host(),
        runtime.fake_tensor("int32", (runtime.sym_int(),)),
        runtime.fake_tensor("uint8", (runtime.sym_int(),), align=1),
        runtime.fake_tensor("bfloat16", (runtime.sym_int(CODES),)))


def launch(packed, scale, out, cfg: BulkStoreConfig) -> None:
    """packed [O, I/2] uint8, scale [O, I/32] uint8 -> out [O, I] bf16 (contiguous, 16-byte aligned,
    as the bench allocates them; no fix-ups here)."""
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"out: needs contiguous 16-byte-aligned bf16, got {out.dtype} at {out.data_ptr():#x}")
    if packed.shape[0] == 0:
        return
    _compile(cfg)(packed.view(torch.int32).view(-1), scale.view(-1), out.view(-1))
