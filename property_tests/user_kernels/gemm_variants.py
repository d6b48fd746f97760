"""A skinny_gemm whose module declares launch variants (what `verify-kernels bench --variants` times
beside the dispatcher's pick). On the CPU its calls stand for launches under test_bench's FakeClock:
each returns the milliseconds it "takes", so the bench's plumbing can be checked without a GPU."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    name: str
    ms_per_row: float


TILES = (Tile("m1", 0.004), Tile("m8", 0.0015), Tile("m64", 0.002))


def variants(tensors: dict, params: dict) -> list[Tile]:
    """Every tile at every M (as the fused skinny_gemm declares its SIMT tiles)."""
    return list(TILES)


def skinny_gemm(x, w, *, variant: Tile | None = None):
    """The dispatcher picks m1 up to M = 4 and m64 above; its fake time is M x the tile's cost."""
    M = x.shape[0]
    tile = variant or (TILES[0] if M <= 4 else TILES[2])
    return M * tile.ms_per_row
