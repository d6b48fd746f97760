"""A cache keyed by tensor identity, as a kernel module keyed on its parameter tensors would keep
one (the planted stale-cache bugs use it)."""
from __future__ import annotations

import weakref


class TensorKeyed:
    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t):
        hit = self._entries.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def put(self, t, value) -> None:
        self._entries[id(t)] = (weakref.ref(t), value)
