"""The floor: a device copy of the bytes an op must read and write (its registry `moved_bytes`),
timed in the same graph setup as the op. Half the bytes are read and half written, so a copy of
nbytes / 2 moves exactly the declared traffic.

Two copies are timed and the faster is the floor (FLOOR_KINDS): torch's `copy_`, which a CUDA graph
records as a memcpy node, and an elementwise kernel on the SMs (`bitwise_not` over 32-bit words,
16-byte vector loads and stores). On the H200 the memcpy node moved 100 MB and more at about 2.7 TB/s,
where a streaming kernel reaches 4 TB/s: a floor of memcpy alone would be one a kernel can beat."""
from __future__ import annotations


def declared_bytes(op, inputs) -> int | None:
    """The op's declared traffic for these inputs, or None when its registry entry declares none."""
    return None if op.moved_bytes is None else int(op.moved_bytes(inputs))


def copy_half(nbytes: int) -> int:
    """Bytes per copy buffer: half the traffic, rounded down to 16 (at least 16)."""
    return max(16, nbytes // 2 // 16 * 16)


FLOOR_KINDS = ("memcpy", "sm_copy")


def floor_launches(nbytes: int, n_sets: int, device: str = "cuda", kind: str = "memcpy") -> list:
    """One device-to-device copy per set, each of its own (src, dst) buffers: `copy_` ("memcpy") or
    an elementwise kernel that reads and writes the same bytes ("sm_copy")."""
    import torch

    half = copy_half(nbytes)
    bufs = [(torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device))
            for _ in range(n_sets)]
    if kind == "memcpy":
        return [(lambda s=s, d=d: d.copy_(s)) for s, d in bufs]
    if kind == "sm_copy":
        return [(lambda s=s.view(torch.int32), d=d.view(torch.int32): torch.bitwise_not(s, out=d)) for s, d in bufs]
    raise ValueError(f"floor kind {kind!r}: one of {', '.join(FLOOR_KINDS)}")


def input_bytes(tensors: dict) -> int:
    """Bytes one input set holds on the device (what rotating sets must spread beyond L2)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
