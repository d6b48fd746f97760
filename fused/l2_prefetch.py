"""l2_prefetch: the bytes of the given weight tensors brought into L2, nothing written.

Each weight is taken as the byte span of storage it covers (from its first element to its last, so a
strided or expanded view prefetches the storage between them; any dtype, any layout: a prefetch reads
no values, so a gap between strided elements costs bandwidth only, and refusing such views would buy
nothing), widened to whole 128-byte lines. The L2 keeps lines, so the widening is what the hardware
would fetch anyway, and a line holding one byte of an allocation lies inside that allocation's mapped
pages, never past them.

Launch: up to SLOTS spans per launch, one grid row (blockIdx.y) per span; the CTAs of a row stride
over the span's chunks, one chunk per thread per step. Two variants:
- "bulk": one `cp.async.bulk.prefetch.L2.global [a], n` per 4 KiB chunk (Hopper's TMA engine fetches
  the chunk into L2; no destination, no completion to wait for), 32 threads per CTA.
- "lines": one `prefetch.global.L2 [a]` per 128-byte line, 128 threads per CTA.
Both bring the lines in at normal eviction priority: evict_last lines would outlive the next op's read
and hold L2 against every later op's traffic (an effect on timings the caller did not ask for).
Neither instruction writes memory or registers; the kernel has no store. Spans, chunk counts and the
grid are runtime values: one compile per variant serves every tensor count and size.

Budget: the spans are taken in call order (positional weights, then named ones) until `max_bytes`
is reached; the span that crosses it is cut there, later ones are skipped. The default is three
quarters of the device's L2 as CUDA reports it (H200: 37.5 of 50 MiB): bytes past the L2's capacity
evict the first bytes the prefetch brought, and the quarter left keeps what runs beside the prefetch
(the all-reduce's buffers, the activations) in L2. Spans are 32-bit sized in the kernel: max_bytes < 2^31.

Launched on the caller's current stream (the serving layer puts it on a side stream during the
all-reduce); no host sync, no allocation, so a CUDA graph can capture it.
"""
import threading
from dataclasses import dataclass

import torch

from fused import runtime

SLOTS = 4              # spans per launch (one grid row each); more spans take more launches
LINE = 128             # L2 line bytes: spans are widened to whole lines
L2_SHARE = (3, 4)      # default budget: 3/4 of the device's L2
CTAS_PER_SM = 2        # cap on the CTAs of one grid row: enough to spread the requests over every SM


@dataclass(frozen=True)
class L2PrefetchConfig:
    mode: str = "bulk"     # "bulk" (cp.async.bulk.prefetch.L2) or "lines" (prefetch.global.L2)
    chunk: int = 4096      # bytes per request; "lines" issues one 128-byte line per request
    threads: int = 32

    @property
    def name(self) -> str:
        return f"{self.mode}{self.chunk}"


BULK = L2PrefetchConfig("bulk", 4096, 32)
LINES = L2PrefetchConfig("lines", LINE, 128)


def all_configs() -> list[L2PrefetchConfig]:
    return [BULK, LINES]


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs."""
    return all_configs()


class L2Prefetch:
    def __init__(self, cfg: L2PrefetchConfig):
        lines_ok = cfg.mode == "lines" and cfg.chunk == LINE
        if not (lines_ok or cfg.mode == "bulk" and cfg.chunk > 0 and cfg.chunk % LINE == 0):
            raise ValueError(f"variant: {cfg} is not a prefetch variant; expected one of {all_configs()}")
        self.cfg = cfg

    def jit_host(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32

        kernel = self.device_kernel()
        threads = self.cfg.threads

        @cute.jit
        def host(s0: cute.Tensor, s1: cute.Tensor, s2: cute.Tensor, s3: cute.Tensor, spans: Int32,
                 ctas: Int32, stream):
            kernel(s0, s1, s2, s3).launch(grid=[ctas, spans, 1], block=[threads, 1, 1], stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Int32, Int64

        chunk, threads = self.cfg.chunk, self.cfg.threads

        @cute.kernel
        def kernel(s0: cute.Tensor, s1: cute.Tensor, s2: cute.Tensor, s3: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, bidy, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            addr = s0.iterator.toint()
            n = Int64(s0.shape[0])
            if bidy == 1:
                addr = s1.iterator.toint()
                n = Int64(s1.shape[0])
            if bidy == 2:
                addr = s2.iterator.toint()
                n = Int64(s2.shape[0])
            if bidy == 3:
                addr = s3.iterator.toint()
                n = Int64(s3.shape[0])
            lo = addr & Int64(-LINE)
            hi = (addr + n + Int64(LINE - 1)) & Int64(-LINE)
            chunks = Int32((hi - lo + Int64(chunk - 1)) // Int64(chunk))
            for c in cutlass.range(bidx * threads + tidx, chunks, gdim * threads):
                a = lo + Int64(c) * Int64(chunk)
                size = Int32(chunk)
                if hi - a < Int64(chunk):
                    size = Int32(hi - a)
                self.issue(c, a, size)

        return kernel

    def issue(self, c, a, size) -> None:
        """Inside the kernel: the prefetch of chunk c, `size` bytes (a multiple of 16) at the global
        address `a` (128-byte aligned). Neither instruction writes memory or a register."""
        _, cute = runtime.cutlass_modules()
        to_global = "{\n.reg .u64 pfg;\ncvta.to.global.u64 pfg, {$r0};\n"
        if self.cfg.mode == "bulk":
            cute.arch.inline_ptx(to_global + "cp.async.bulk.prefetch.L2.global [pfg], {$r1};\n}",
                                 read_only_args=[a, size])
        else:
            cute.arch.inline_ptx(to_global + "prefetch.global.L2 [pfg];\n}", read_only_args=[a])


def build(cfg: L2PrefetchConfig, kernel_class=L2Prefetch):
    """cute.compile of `kernel_class`'s launch for `cfg`: four 1-D uint8 spans of any size and base."""
    from cutlass import Int32

    span = lambda: runtime.fake_tensor("uint8", (runtime.sym_int(),), align=1)
    return runtime.compile_tvm_ffi(kernel_class(cfg).jit_host(), *(span() for _ in range(SLOTS)),
                                   Int32(1), Int32(1))


@runtime.compile_cache("l2_prefetch")
def _compile(cfg: L2PrefetchConfig):
    return build(cfg)


def byte_span(t: torch.Tensor) -> torch.Tensor | None:
    """The uint8 view of the storage `t` covers, from its first element to its last (None if empty).
    Strides are non-negative in torch, so the first element is at t's storage offset."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return torch.as_strided(t.detach(), (extent,), (1,)).view(torch.uint8)


def default_budget(device) -> int:
    """Three quarters of the device's L2, in bytes."""
    l2 = torch.cuda.get_device_properties(torch.device(device)).L2_cache_size
    return l2 * L2_SHARE[0] // L2_SHARE[1]


def budget_spans(weights: list, max_bytes: int) -> list[torch.Tensor]:
    """The byte spans of `weights` in call order, the one that crosses `max_bytes` cut there, the rest
    dropped (empty weights have no span)."""
    spans, left = [], max_bytes
    for w in weights:
        s = byte_span(w)
        if s is None or left <= 0:
            continue
        spans.append(s[:left])
        left -= spans[-1].numel()
    return spans


def chunks(span: torch.Tensor, chunk: int) -> int:
    """Requests the kernel issues for `span`: its whole 128-byte lines in `chunk`-byte pieces."""
    lo, hi = span.data_ptr() // LINE * LINE, -(-(span.data_ptr() + span.numel()) // LINE) * LINE
    return -(-(hi - lo) // chunk)


def launch(weights: list, max_bytes: int, variant: L2PrefetchConfig | None = None, compiled=None) -> None:
    """The byte spans of `weights`, cut to `max_bytes` in call order, prefetched SLOTS at a time by a
    launch of `compiled` (default: this module's kernel for the variant) on the current stream."""
    cfg = variant or BULK
    spans = budget_spans(weights, max_bytes)
    if not spans:
        return
    fn = compiled or _compile(cfg)
    cap = CTAS_PER_SM * runtime.sm_count(spans[0].device)
    for i in range(0, len(spans), SLOTS):
        group = spans[i:i + SLOTS]
        ctas = min(cap, -(-max(chunks(s, cfg.chunk) for s in group) // cfg.threads))
        padded = group + [group[0]] * (SLOTS - len(group))      # rows past len(group) are not launched
        fn(*padded, len(group), ctas)


def _check(weights: list, names: list, max_bytes) -> None:
    device = None
    for name, w in zip(names, weights):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        runtime.require_cuda(name, w)
        if device is None:
            device = w.device
        elif w.device != device:
            raise ValueError(f"{name}: on {w.device}, the other weights on {device}; "
                             "one launch prefetches one device")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or not 0 <= max_bytes < 2**31):
        raise ValueError(f"max_bytes: expected an int in [0, 2^31), got {max_bytes!r}")


_op = None
_op_lock = threading.Lock()


def _custom_op():
    global _op
    with _op_lock:
        if _op is not None:
            return _op
        @runtime.register_op("l2_prefetch", mutates_args=())
        def l2_prefetch_(weights: list[torch.Tensor], max_bytes: int) -> None:
            launch(weights, max_bytes)

        # no output and nothing mutated: without this mark torch.compile would drop the call as dead
        torch.fx.node.has_side_effect(torch.ops.verify_kernels.l2_prefetch.default)
        _op = l2_prefetch_
        return _op


def l2_prefetch(*weights: torch.Tensor, max_bytes: int | None = None, variant=None,
                **named_weights: torch.Tensor) -> None:
    """Fused replacement of references.moe.l2_prefetch (same signature; no output, no write).

    max_bytes: prefetch at most this many bytes, taken in call order (default: 3/4 of the device's L2).
    variant: an L2PrefetchConfig (the harness certifies each of all_configs())."""
    tensors = list(weights) + list(named_weights.values())
    names = [f"weights[{i}]" for i in range(len(weights))] + list(named_weights)
    _check(tensors, names, max_bytes)
    if variant is not None and not isinstance(variant, L2PrefetchConfig):
        raise ValueError(f"variant: expected an L2PrefetchConfig, got {type(variant).__name__}")
    if not tensors:
        return None
    budget = default_budget(tensors[0].device) if max_bytes is None else max_bytes
    if variant is not None:
        launch(tensors, budget, variant)
    else:
        _custom_op()(tensors, budget)
    return None
