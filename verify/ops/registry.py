"""The op registry: one OpDef per op of shared/OPS.md, collected from verify/ops/<family>.py."""
from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil

from typing import TYPE_CHECKING

if TYPE_CHECKING:         # the registry is read by torch-free commands (list, describe) through it
    from verify.model.opdef import OpDef


class UnknownOpError(ValueError):
    pass


@functools.lru_cache(maxsize=1)
def all_ops() -> dict[str, OpDef]:
    import verify.ops as ops_pkg

    ops: dict[str, OpDef] = {}
    for mod in sorted(pkgutil.iter_modules(ops_pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"verify.ops.{mod.name}")
        for op in getattr(module, "OPS", []):
            if op.name in ops:
                raise RuntimeError(f"op {op.name!r} is registered twice (verify/ops/{mod.name}.py)")
            ops[op.name] = op
    return dict(sorted(ops.items()))


def get_op(name: str) -> OpDef:
    ops = all_ops()
    if name not in ops:
        near = difflib.get_close_matches(name, ops, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else f"; known ops: {', '.join(ops)}"
        raise UnknownOpError(f"unknown op {name!r}{hint}")
    return ops[name]


def select_ops(names: str | None) -> list[OpDef]:
    if not names:
        return list(all_ops().values())
    return [get_op(n.strip()) for n in names.split(",") if n.strip()]


def import_callable(path: str):
    """Import 'module:attr' (attr may be dotted). Raises ImportError with one clear line."""
    if ":" not in path:
        raise ImportError(f"candidate {path!r} is not of the form 'module:attr'")
    mod_name, attr = path.split(":", 1)
    try:
        obj = importlib.import_module(mod_name)
    except (Exception, SystemExit) as e:  # any import-time failure of a user's module, sys.exit() included
        raise ImportError(f"cannot import module {mod_name!r} for {path!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ImportError(f"{path!r} is not callable (it is a {type(obj).__name__})")
    return obj
