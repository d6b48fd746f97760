"""Stream-K partition of a GEMM's (column block, k-tile) pairs over a fixed grid of G CTAs.

Pure integer math (+, -, *, // on non-negative values, and the min/max passed in), so one source
serves the wgmma kernel (CTA and block indices are Int32 at run time; min/max are cutlass.min/max)
and its CPU tests (Python ints, builtin min/max).

The T = blocks x KT tiles are numbered block-major (the KT k-tiles of block 0, then those of block 1,
...) and cut into G contiguous ranges: CTA c takes tiles [c*T//G, (c+1)*T//G). With T >= G no range
is empty. A CTA's piece of one block is a segment; the CTAs meeting block b are consecutive,
first(b) .. first(b) + count(b) - 1, and in k order (contributor j = c - first(b) covers the k-tiles
just before those of contributor j + 1). A segment that is not a whole block writes its fp32 partial
to workspace slot b + c: the slots of block b are contiguous and in contributor order, and no two
(block, CTA) pairs share one (a later CTA never meets an earlier block), so `slots` = G + blocks - 1
suffice. Everything here is a function of (blocks, KT, G) only.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamK:
    blocks: int          # column blocks (N / rows)
    kt: int              # k-tiles per block (K / 64)
    ctas: int            # G: the grid

    @property
    def tiles(self) -> int:
        return self.blocks * self.kt

    @property
    def slots(self) -> int:
        """Workspace partials needed: the largest slot b + c is (blocks - 1) + (G - 1)."""
        return self.ctas + self.blocks - 1

    def problem(self) -> str | None:
        """Why this partition cannot run, or None."""
        if self.tiles < self.ctas:
            return f"{self.tiles} tiles (blocks x K/64) < {self.ctas} CTAs: some CTA would get none"
        if self.tiles * self.ctas >= 2 ** 31:
            return f"tiles x CTAs = {self.tiles * self.ctas} overflows the kernel's int32 index math"
        return None

    def span(self, c):
        """Tiles [lo, hi) of CTA c."""
        return (c * self.tiles) // self.ctas, ((c + 1) * self.tiles) // self.ctas

    def owner(self, t):
        """The CTA whose range holds tile t: the largest c with c*T//G <= t."""
        return ((t + 1) * self.ctas - 1) // self.tiles

    def contributors(self, b):
        """(first CTA, count) of the CTAs whose ranges meet block b, in k order."""
        first = self.owner(b * self.kt)
        return first, self.owner(b * self.kt + self.kt - 1) - first + 1

    def segments(self, lo, hi):
        """(first block, number of blocks) met by the tile range [lo, hi)."""
        return lo // self.kt, (hi - 1) // self.kt - lo // self.kt + 1

    def k_range(self, b, lo, hi, smin=min, smax=max):
        """k-tiles [k0, k1) of block b inside the tile range [lo, hi)."""
        return smax(lo, b * self.kt) - b * self.kt, smin(hi, b * self.kt + self.kt) - b * self.kt

    @staticmethod
    def slot(b, c):
        """Workspace slot of CTA c's partial of block b."""
        return b + c
