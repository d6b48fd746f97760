"""A planted bug in the fused l2_prefetch kernel (GPU only, so not in the CPU catalogue): the kernel of
fused/l2_prefetch.py that, besides its prefetches, stores into the first line it prefetches of each span
(the bitwise NOT of the line's first byte, so the write always changes the bits). The harness must
reject it: the weights are declared state and judged bitwise after the call."""
from __future__ import annotations

from fused import l2_prefetch as fl
from fused import runtime


class L2PrefetchStoresFirstLine(fl.L2Prefetch):
    def issue(self, c, a, size) -> None:
        super().issue(c, a, size)
        _, cute = runtime.cutlass_modules()
        cute.arch.inline_ptx("{\n.reg .u64 pfg;\n.reg .b16 pfb;\n.reg .pred pfp;\nsetp.eq.s32 pfp, {$r1}, 0;\n"
                             "cvta.to.global.u64 pfg, {$r0};\n@pfp ld.global.u8 pfb, [pfg];\n"
                             "not.b16 pfb, pfb;\n@pfp st.global.u8 [pfg], pfb;\n}",
                             read_only_args=[a, c])


_compiled: dict = {}


def compile_planted(cfg: fl.L2PrefetchConfig):
    """The planted kernel for `cfg`, compiled once (its own cache, not the project's)."""
    if cfg not in _compiled:
        _compiled[cfg] = fl.build(cfg, L2PrefetchStoresFirstLine)
    return _compiled[cfg]


def l2_prefetch_stores_first_line(*weights, **named_weights):
    """The fused prefetch, with one store into the first prefetched line of every weight."""
    tensors = list(weights) + list(named_weights.values())
    if tensors:
        fl.launch(tensors, fl.default_budget(tensors[0].device), fl.BULK, compile_planted(fl.BULK))
    return None
