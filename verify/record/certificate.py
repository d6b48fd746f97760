"""Certificates: environment, source hashes per op, verdicts. Written as JSON; read back for diffs."""
from __future__ import annotations

import ast
import datetime as _dt
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from verify.model.opdef import OpDef
from verify.model.specs import SPEC_DIR
from verify.model.verdict import OpVerdict
from verify.record.files import read_text

ROOT = Path(__file__).resolve().parents[2]
FORMAT = "verify-kernels/certificate/v1"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    import torch

    env = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
        "cutlass_dsl": _version("nvidia-cutlass-dsl") or _loaded_cutlass_version(),
        "hypothesis": _version("hypothesis"), "device": device,
        # a checkout copied to a GPU machine names its commit in VERIFY_GIT_COMMIT: the copy may
        # carry no .git, or a stale one whose HEAD is not the tree being judged
        "git_commit": os.environ.get("VERIFY_GIT_COMMIT") or _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def _loaded_cutlass_version() -> str | None:
    """The DSL's version when it was carried unpacked (no dist metadata): its module's, imported here
    when no kernel has yet (the bench writes its environment before the first kernel compiles)."""
    mod = sys.modules.get("cutlass")
    if mod is None:
        import importlib.util

        if importlib.util.find_spec("cutlass") is None:
            return None
        try:
            import cutlass as mod
        except Exception:                        # a broken install: no version to report
            return None
    return getattr(mod, "__version__", None)


def _git(*args, cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd or ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _module_file(path: str | None) -> Path | None:
    if not path:
        return None
    spec = importlib.util.find_spec(path.split(":")[0])
    return Path(spec.origin) if spec and spec.origin else None


def sha256_file(path: Path | None) -> str | None:
    if path is None or not path.exists():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _project_imports(path: Path, packages: tuple[str, ...] = ("fused", "references"),
                     named: bool = False) -> set[str]:
    """Module names this file imports from `packages` (by default the kernel and reference ones; a
    dotted entry such as "verify.ops" names a subpackage); with `named`, also the modules of the
    'module:attr' strings it holds (a layer's table of the kernels it resolves by name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}       # `from fused import runtime`
        elif named and isinstance(node, ast.Constant) and isinstance(node.value, str):
            mod, colon, attr = node.value.partition(":")
            if colon and attr.isidentifier() and all(part.isidentifier() for part in mod.split(".")):
                names.add(mod)
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in packages)}


def closure_files(path: Path | None, root: Path = ROOT,
                  packages: tuple[str, ...] = ("fused", "references"), named: bool = False) -> dict[Path, bytes]:
    """A module and every project module of `packages` it imports, transitively (at module level or
    inside functions), with their bytes; {} for a missing module. `named`: _project_imports'."""
    seen: dict[Path, bytes] = {}
    todo = [path] if path is not None and path.exists() else []
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen[p] = p.read_bytes()
        for name in _project_imports(p, packages, named):
            base = root.joinpath(*name.split("."))
            for f in (base.with_suffix(".py"), base / "__init__.py"):
                if f.is_file():
                    todo.append(f)
    return seen


def sha256_closure(path: Path | None, root: Path = ROOT,
                   packages: tuple[str, ...] = ("fused", "references")) -> str | None:
    """Hash of a module and every project module of `packages` it imports (`closure_files`): a kernel
    whose code lives in a helper module (skinny_gemm -> skinny_gemm_wgmma, runtime) is a new kernel
    when the helper changes, and its verdict is not carried forward."""
    seen = closure_files(path, root, packages)
    if not seen:
        return None
    h = hashlib.sha256()
    for name, p in sorted((_name(q, root), q) for q in seen):
        h.update(name.encode() + b"\0" + hashlib.sha256(seen[p]).digest())
    return h.hexdigest()


def _name(p: Path, root: Path) -> str:
    """A module's name in a hash: its path under root, or its absolute path where it sits elsewhere (a
    project package imported from another checkout than the harness's)."""
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


# A candidate named by import path ('module:attr', 'path/to/file.py:attr') is code the op's sources do
# not cover: its verdict holds only while its own module and the project modules it imports are
# unchanged. The built-in candidates are covered by the op's sources (fused kernel, reference).
BUILTIN_CANDIDATES = ("fused", "compiled", "reference")
CANDIDATE_PACKAGES = ("fused", "references", "stock", "property_tests")


def _candidate_module(label: str) -> tuple[Path | None, Path]:
    """(the candidate's module file, the directory its top-level package sits in), or (None, ROOT)
    where it names no file this process can find."""
    mod = label.rpartition(":")[0]
    if mod.endswith(".py"):
        file = Path(mod).resolve()
        return (file, ROOT if file.is_relative_to(ROOT) else file.parent) if file.is_file() else (None, ROOT)
    try:
        spec = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        return None, ROOT
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None, ROOT
    file = Path(spec.origin).resolve()
    depth = len(mod.split(".")) - (0 if file.name == "__init__.py" else 1)
    return file, file.parents[depth]


def candidate_sources(label: str) -> dict | None:
    """None for a built-in candidate; else {"hash": the sha256 closure of its module (None where the
    module cannot be found), "files": {file: sha256}}: the module and the modules it imports, or names
    as 'module:attr' (kernels resolved by name), from its own top-level package and the project's
    (CANDIDATE_PACKAGES), resolved from where it sits."""
    if label in BUILTIN_CANDIDATES:
        return None
    file, root = _candidate_module(label)
    if file is None:
        return {"hash": None, "files": {}}
    mod = label.rpartition(":")[0]
    packages = CANDIDATE_PACKAGES if mod.endswith(".py") else (mod.split(".")[0], *CANDIDATE_PACKAGES)
    seen = closure_files(file, root, packages, named=True)
    h = hashlib.sha256()
    names = {}
    for q in sorted(seen, key=str):
        name = _name(q, root)
        names[name] = hashlib.sha256(seen[q]).hexdigest()
        h.update(name.encode() + b"\0" + bytes.fromhex(names[name]))
    return {"hash": h.hexdigest(), "files": names}


def candidate_holds(entry: dict, label: str, now: dict | None) -> str:
    """'' where the op entry's verdict of `label` was judged on the candidate's sources of now (always,
    for a built-in candidate); else why not."""
    if now is None:
        return ""
    then = (entry.get("candidate_sources") or {}).get(label)
    if then is None:
        return "the certificate does not record the candidate's own sources (module:attr); judge it again"
    if now["hash"] is None:
        return f"the candidate's module cannot be found here ({label})"
    if then.get("hash") != now["hash"]:
        files = file_changes(then.get("files") or {}, now["files"])
        return "candidate (" + ", ".join(files or ["its module"]) + ")"
    return ""


# The harness: the stages that draw cases, build inputs, judge and run them (verify/model, plan,
# judge, run). A verdict from another version of any of their modules is not carried forward. The
# registry entries (verify/ops/) are hashed per op family instead; the recording side (record/, cli)
# is not part of it.
HARNESS_PACKAGES = ("model", "plan", "judge", "run")


def harness_files() -> list[Path]:
    """Every module of the harness stages (HARNESS_PACKAGES), sorted."""
    return sorted(p for pkg in HARNESS_PACKAGES for p in (ROOT / "verify" / pkg).rglob("*.py"))


def harness_hash() -> str:
    h = hashlib.sha256()
    for p in harness_files():
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


# An op's registry entry is its family module and the verify/ops helpers it imports (common_splits,
# moe_splits, mxfp4's weight draws): they draw the op's inputs and shard its splits, so a change to common_splits.py (the inputs of
# attn_res, moe, gemm and mxfp4) stales their verdicts.
REGISTRY_PACKAGES = ("verify.ops",)


def _registry_file(op: OpDef) -> Path | None:
    return _module_file(f"verify.ops.{op.family}") if op.family else None


def op_sources(op: OpDef) -> dict[str, str | None]:
    """The sources a verdict depends on: reference, fused kernel, spec, the registry entry, and the
    harness that judged it."""
    return {
        "reference": sha256_closure(_module_file(op.reference)),
        "fused": sha256_closure(_module_file(op.fused)),
        "spec": sha256_file(SPEC_DIR / f"{op.name}.toml"),
        "registry": sha256_closure(_registry_file(op), packages=REGISTRY_PACKAGES),
        "harness": harness_hash(),
    }


def source_files(op: OpDef) -> dict[str, str]:
    """Every file behind `op_sources(op)`, by path from the repository root, with its sha256: kept
    beside the source hashes in a certificate so that `check` can name the files a stale verdict
    was judged without."""
    files: dict[Path, bytes] = {}
    for mod in (op.reference, op.fused):
        files.update(closure_files(_module_file(mod)))
    files.update(closure_files(_registry_file(op), packages=REGISTRY_PACKAGES))
    for p in (SPEC_DIR / f"{op.name}.toml", *harness_files()):
        if p is not None and p.exists():
            files[p] = p.read_bytes()
    return {_relative(p): hashlib.sha256(b).hexdigest() for p, b in sorted(files.items())}


def _relative(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def source_change(old: dict, new: dict, old_files: dict | None = None, new_files: dict | None = None) -> str:
    """'fused, harness (file, ...)': the source groups whose hashes differ between two `op_sources`
    maps, and, where both per-file hash maps are given, the files behind them (`file_changes`)."""
    groups = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    files = file_changes(old_files, new_files) if old_files is not None and new_files is not None else []
    return ", ".join(groups) + (f" ({', '.join(files)})" if files else "")


def file_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Files whose hash differs between two per-file hash maps, then '+' the files only `new` has,
    then '-' the files only `old` had, each sorted."""
    return (sorted(f for f in new if f in old and old[f] != new[f]) + sorted(f"+{f}" for f in new if f not in old)
            + sorted(f"-{f}" for f in old if f not in new))


def changed_files_since(commit: str | None, op: OpDef, root: Path | None = None) -> list[str] | None:
    """`git diff --name-only COMMIT` over the op's source files (in the repository at `root`, by
    default this one): for certificates without file hashes; None where git cannot tell."""
    if not commit:
        return None
    out = _git("diff", "--name-only", commit, "--", *source_files(op), cwd=root)
    return None if out is None else sorted(f for f in out.splitlines() if f)


def _waivers(op_name: str) -> list[dict]:
    from verify.model.specs import SpecError, load_spec

    try:
        return [w.model_dump() for w in load_spec(op_name).waivers]
    except SpecError:
        return []


def build(verdicts: list[OpVerdict], ops: dict[str, OpDef], options: dict, device: str,
          cases: dict | None = None, carried: dict | None = None) -> dict:
    """cases: (op, candidate) -> compact case records (runlog.case_record); carried: op -> the old
    certificate's entry for an op whose sources did not change (kept, marked carried_from)."""
    per_op: dict[str, dict] = {}
    for v in verdicts:
        entry = per_op.setdefault(v.op, {"sources": op_sources(ops[v.op]), "source_files": source_files(ops[v.op]),
                                         "verdicts": {}, "cases": {}, "waivers": _waivers(v.op)})
        entry["verdicts"][v.candidate] = asdict(v)
        own = candidate_sources(v.candidate)
        if own is not None:
            entry.setdefault("candidate_sources", {})[v.candidate] = own
        entry["cases"][v.candidate] = list((cases or {}).get((v.op, v.candidate), []))
    for name, old in (carried or {}).items():
        per_op[name] = old
    return {"format": FORMAT, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment(device), "options": options, "ops": per_op}


def carry_forward(old: dict, ops: dict[str, OpDef], candidates: list[str]) -> tuple[dict, list[str]]:
    """Split ops into carried (sources unchanged since `old`, every candidate has a verdict there, judged
    on the candidate's sources of now) and changed. Returns (carried entries marked with carried_from, names to certify)."""
    origin = {"created": old.get("created"), "git_commit": old.get("environment", {}).get("git_commit")}
    carried, changed = {}, []
    for name, op in ops.items():
        prev = old.get("ops", {}).get(name)
        if (prev and prev.get("sources") == op_sources(op) and all(c in prev.get("verdicts", {}) for c in candidates)
                and not any(candidate_holds(prev, c, candidate_sources(c)) for c in candidates)):
            entry = json.loads(json.dumps(prev))
            entry.setdefault("source_files", source_files(op))      # same sources, so the same files now
            for v in entry["verdicts"].values():
                v.setdefault("carried_from", origin)
            carried[name] = entry
        else:
            changed.append(name)
    return carried, changed


def op_verdicts(cert: dict) -> dict[tuple[str, str], dict]:
    return {(name, cand): v for name, e in cert.get("ops", {}).items() for cand, v in e.get("verdicts", {}).items()}


def write(cert: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "certificate.json"
    path.write_text(json.dumps(cert, indent=1, sort_keys=True, default=str))
    return path


def load(path: str | Path) -> dict:
    p = Path(path)
    try:
        cert = json.loads(read_text(p))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"certificate {p}: cannot read it: {e}") from None
    if not isinstance(cert, dict):
        raise ValueError(f"certificate {p}: a JSON object is expected, not {type(cert).__name__}")
    if cert.get("format") != FORMAT:
        raise ValueError(f"certificate {p}: format {cert.get('format')!r} is not {FORMAT!r}")
    _check_shape(p, cert)
    return cert


_ENTRY_FIELDS = {key: (dict, "an object") for key in ("sources", "source_files", "verdicts", "cases")}
_ENTRY_FIELDS["waivers"] = ((dict, list), "an object or a list")


def _check_shape(p: Path, cert: dict) -> None:
    """The fields `check`, `report`, `diff` and `--changed-since` read, of the types `build` writes: a
    hand-edited or truncated certificate is named, not a traceback from deep inside the gate."""
    def need(ok: bool, where: str, what: str) -> None:
        if not ok:
            raise ValueError(f"certificate {p}: {where} must be {what}")
    need(isinstance(cert.get("created"), str), "'created'", "a timestamp string")
    for key in ("environment", "options"):
        need(isinstance(cert.get(key, {}), dict), f"'{key}'", "an object")
    ops = cert.get("ops")
    need(isinstance(ops, dict), "'ops'", "an object of op entries")
    for name, entry in ops.items():
        need(isinstance(entry, dict), f"ops.{name}", "an object")
        for key, (types, what) in _ENTRY_FIELDS.items():
            if key in entry:
                need(isinstance(entry[key], types), f"ops.{name}.{key}", what)
        for label, v in entry.get("verdicts", {}).items():
            need(isinstance(v, dict), f"ops.{name}.verdicts.{label}", "an object")
