"""A static index of the op registry (verify/ops/index.json) for the commands that only read it:
`list` and `describe` answer without importing torch or building any op. The registry is the truth;
property_tests/test_registry.py checks the index equals it, and

    python -m verify.ops.index          # rewrites verify/ops/index.json from the registry
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path

INDEX = Path(__file__).resolve().parent / "index.json"


def entry(op) -> dict:
    """The JSON-able description of an OpDef that `list` and `describe` print."""
    return {"op": op.name, "family": op.family, "reference": op.reference, "fused": op.fused,
            "signature": op.signature, "outputs": list(op.outputs), "state": list(op.state),
            "batch_dims": dict(op.batch_dims), "dtypes": list(op.dtypes), "configs": list(op.configs),
            "dists": list(op.dists), "max_batch": op.max_batch,
            "split": None if op.split is None else {"kind": op.split.kind, "reduction_order": op.split.reduction_order,
                                                    "tp_values": list(op.split.tp_values)},
            "notes": op.notes}


def build() -> dict[str, dict]:
    from verify.ops.registry import all_ops

    return {name: entry(op) for name, op in all_ops().items()}


def load() -> dict[str, dict]:
    return json.loads(INDEX.read_text())


def lookup(name: str) -> dict:
    """The op's entry, or UnknownOpError with the near names (as registry.get_op says it)."""
    from verify.ops.registry import UnknownOpError      # torch-free: registry imports the ops lazily

    ops = load()
    if name not in ops:
        near = difflib.get_close_matches(name, ops, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else f"; known ops: {', '.join(ops)}"
        raise UnknownOpError(f"unknown op {name!r}{hint}")
    return ops[name]


def write() -> Path:
    INDEX.write_text(json.dumps(build(), indent=1) + "\n")
    return INDEX


if __name__ == "__main__":
    print(write())
