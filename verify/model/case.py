"""A case: the small serialisable record from which every input is rebuilt bit-for-bit."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Case:
    op: str
    seed: int
    batch: int
    config: str = "small"        # references.config name: tiny | small | k3
    dtype: str = "bfloat16"      # working dtype of the activations
    dist: str = "normal"         # verify.model.values distribution name
    tp: int = 1                  # tensor-parallel degree for split cases (1 = unsplit)
    extra: tuple = field(default=())   # op-specific knobs as sorted (key, value) pairs

    def knob(self, key: str, default=None):
        return dict(self.extra).get(key, default)

    def to_json(self) -> str:
        d = asdict(self)
        d["extra"] = [list(kv) for kv in self.extra]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        d = json.loads(text)
        d["extra"] = tuple(tuple(kv) for kv in d.get("extra", ()))
        return cls(**d)

    def short(self) -> str:
        x = "".join(f",{k}={v}" for k, v in self.extra)
        return f"{self.op}[seed={self.seed},B={self.batch},{self.config},{self.dtype},{self.dist},T={self.tp}{x}]"
