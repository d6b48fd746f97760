"""The floor: a device copy of the bytes an op must read and write (its registry `moved_bytes`),
timed in the same graph setup as the op. Half the bytes are read and half written, so a copy of
nbytes / 2 moves exactly the declared traffic."""
from __future__ import annotations


def declared_bytes(op, inputs) -> int | None:
    """The op's declared traffic for these inputs, or None when its registry entry declares none."""
    return None if op.moved_bytes is None else int(op.moved_bytes(inputs))


def copy_half(nbytes: int) -> int:
    """Bytes per copy buffer: half the traffic, rounded down to 16 (at least 16)."""
    return max(16, nbytes // 2 // 16 * 16)


def floor_launches(nbytes: int, n_sets: int, device: str = "cuda") -> list:
    """One device-to-device copy per set, each of its own (src, dst) buffers."""
    import torch

    half = copy_half(nbytes)
    bufs = [(torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device))
            for _ in range(n_sets)]
    return [(lambda s=s, d=d: d.copy_(s)) for s, d in bufs]


def input_bytes(tensors: dict) -> int:
    """Bytes one input set holds on the device (what rotating sets must spread beyond L2)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
