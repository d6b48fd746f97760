"""Candidates: the reference itself, torch.compile of it, our fused kernels, or any 'module:attr'."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verify.model.opdef import OpDef
from verify.ops.registry import import_callable

BUILTIN = ("reference", "compiled", "fused")


class CandidateUnavailable(Exception):
    """The candidate cannot run here (no GPU, no fused kernel for this op): a skip with this reason."""


class CandidateImportError(Exception):
    """The candidate named by the user cannot be imported: bad usage, one clear line."""


@dataclass(frozen=True)
class Candidate:
    label: str

    def resolve(self, op: OpDef, device: str):
        if self.label == "reference":
            return reference_fn(op)
        if self.label == "compiled":
            return compiled_fn(op.name)
        if self.label == "fused":
            if op.fused is None:
                raise CandidateUnavailable(f"op {op.name} has no fused kernel yet")
            if device != "cuda":
                raise CandidateUnavailable("needs a CUDA device (fused CuTe DSL kernels run on sm_90); "
                                           "CI compiles them for sm_90a instead")
            try:
                return import_checked(op.fused, device)
            except ImportError as e:
                raise CandidateUnavailable(f"fused kernel unavailable: {e}") from None
        return import_checked(self.label, device)


# What importing a candidate's module changed of this process, by module: every later resolve of it
# fails the same way (the import ran once; the reference would be judged on the candidate's torch).
_IMPORT_TAINT: dict[str, str] = {}


def is_tainted(path: str) -> bool:
    return path.split(":", 1)[0] in _IMPORT_TAINT


def import_checked(path: str, device: str):
    """import_callable, refusing a module whose import changed the torch the reference runs on:
    a kernel registered over one of torch's own (aten::mm's CPU kernel, as vendor packages install
    theirs), a torch function or Tensor method replaced, a mode left entered, a default changed."""
    import sys

    from verify.judge import process_state as ps

    mod = path.split(":", 1)[0]
    if mod in _IMPORT_TAINT:
        raise CandidateImportError(_IMPORT_TAINT[mod])
    if mod in sys.modules:         # imported already (by the harness, or a module of the stdlib)
        try:
            return _import_path(path)
        except ImportError as e:
            raise CandidateImportError(str(e)) from None
    before, overrides = ps.process_state(device), ps.dispatcher_overrides()
    try:
        fn = _import_path(path)
    except ImportError as e:
        raise CandidateImportError(str(e)) from None
    changed = ps.import_changes(before, overrides, device)
    if changed:
        _IMPORT_TAINT[mod] = (f"importing {mod!r} changed the process the reference runs in, so no verdict "
                              f"on it can be trusted: {'; '.join(changed)}")
        raise CandidateImportError(_IMPORT_TAINT[mod])
    return fn


def _import_path(path: str):
    """import_callable, also for 'path/to/file.py:attr' (a file not importable by module name: a test
    file, a script), loaded once per file under a private module name so its DTYPES / PARAMS /
    variants() are found as for any candidate module."""
    mod, _, attr = path.partition(":")
    if not mod.endswith(".py"):
        return import_callable(path)
    import importlib.util
    import os
    import sys

    file = os.path.abspath(mod)
    if not os.path.isfile(file):
        raise ImportError(f"candidate {path!r}: no file {file}")
    name = "vk_file_" + "".join(c if c.isalnum() else "_" for c in file)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            del sys.modules[name]
            raise ImportError(f"cannot import {file} for {path!r}: {type(e).__name__}: {e}") from None
    return import_callable(f"{name}:{attr}")


def callable_label(fn) -> tuple[str, bool]:
    """A candidate label naming `fn` for a fresh process, and whether one exists. A function at the top
    of an installed module: 'module:qualname'. One at the top of any other file (a test file, which
    pytest imported through a sys.path entry a shell does not have): 'path/to/file.py:qualname',
    loadable from any directory. A lambda or a function defined inside another: no process can reach
    it by name ('module:qualname', False)."""
    import inspect
    import sys

    mod, qual = getattr(fn, "__module__", None) or "?", getattr(fn, "__qualname__", None) or repr(fn)
    module = sys.modules.get(mod)
    obj = module
    for part in qual.split(".") if "<" not in qual else ["<"]:
        obj = getattr(obj, part, None)
    if obj is not fn:                   # <lambda>, f.<locals>.g, or not reachable from its module
        return f"{mod}:{qual}", False
    try:
        file = inspect.getsourcefile(fn)
    except TypeError:
        file = None
    if not file or "site-packages" in file or "dist-packages" in file:
        return f"{mod}:{qual}", True
    return f"{file}:{qual}", True


def parse_candidate(text: str) -> Candidate:
    if text in BUILTIN or ":" in text:
        return Candidate(text)
    raise CandidateImportError(f"--candidate {text!r}: expected one of {', '.join(BUILTIN)} or 'module:attr'")


def reference_fn(op: OpDef):
    return import_callable(op.reference)


@functools.lru_cache(maxsize=None)
def compiled_fn(op_name: str):
    """torch.compile of the reference: a fused implementation nobody here wrote (inductor on CPU)."""
    import torch._inductor.config as inductor_config

    from verify.ops.registry import get_op

    # Keep every bf16/fp16 rounding the reference writes (e.g. prefix + delta, then a fold): by
    # default inductor fuses through them in fp32, which no bitwise-class output can survive.
    inductor_config.emulate_precision_casts = True
    inductor_config.compile_threads = 1            # no worker pool: it costs more than it saves on 2 cores
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)   # never fall back to eager
    dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, 512)
    fx_config.use_duck_shape = False               # equal sizes by coincidence must not add guards
    return torch.compile(reference_fn(get_op(op_name)), dynamic=True, fullgraph=False)
