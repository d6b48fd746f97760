"""The harness reads as a pipeline: each stage of verify/ imports only the stages below it (at module
level or inside functions), and no module imports itself back through others."""
from __future__ import annotations

import ast
from pathlib import Path

VERIFY = Path(__file__).resolve().parent.parent / "verify"
# lowest first: a stage may import its own and those before it
STAGES = ("model", "ops", "plan", "judge", "run", "record", "bench", "entry")


def _stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return "entry"
    return parts[1] if parts[1] in STAGES else "entry"        # cli, pytest_plugin: the entry points


def _modules() -> dict[str, Path]:
    out = {}
    for p in VERIFY.rglob("*.py"):
        rel = p.relative_to(VERIFY.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = p
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n.startswith("verify"):
                found.add(n)
    return found


def test_each_stage_imports_only_the_stages_below_it():
    mods = _modules()
    bad = []
    for name, path in mods.items():
        mine = STAGES.index(_stage(name))
        for dep in _imports(path, set(mods)):
            if dep != "verify" and STAGES.index(_stage(dep)) > mine:
                bad.append(f"{name} imports {dep}")
    assert not bad, bad


def test_no_import_cycles_between_modules():
    """Module-level imports only (those run at import time): a cycle there breaks on import order."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        deps = set()
        for node in top:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module else []
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != name and n != "verify":
                    deps.add(n)
        graph[name] = deps
    state: dict[str, int] = {}
    cycles = []

    def visit(n, path):
        state[n] = 1
        for d in graph.get(n, ()):
            if state.get(d) == 1 and not n.startswith(d + "."):     # a package's __init__ importing its module
                cycles.append(" -> ".join(path + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles
