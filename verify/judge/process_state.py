"""Process-wide state a candidate could change and leave changed, read before and after every call.

Each entry alters every later computation of the process: the reference's own runs in the working
dtype (which the tolerances are measured against: TF32 matmuls or flushed denormals loosen them),
the next cases' candidate calls, or where work is queued (the current stream). Changed settings are
put back; what cannot be put back (a kernel registered over one of torch's own) taints the process,
and a worker that reports it is replaced (`UNDOABLE` in the check's detail).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import random
import sys
import warnings
from operator import attrgetter

import torch
import torch.utils.deterministic  # fill_uninitialized_memory below

from verify.model.verdict import Check

UNDOABLE = "cannot be undone in this process"


def _flushes_denormals() -> bool:
    """Whether this thread flushes float32 denormals to zero (torch.set_flush_denormal has no getter)."""
    return torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() == 0.0


def _torch_flag(path: str) -> tuple[str, object, object]:
    """(name, read, restore) of a flag attribute under torch, e.g. 'backends.cudnn.benchmark'."""
    owner, _, attr = path.rpartition(".")
    return (f"torch.{path}", lambda: getattr(attrgetter(owner)(torch), attr),
            lambda v: setattr(attrgetter(owner)(torch), attr, v))


def _has_flag(path: str) -> bool:
    owner, _, attr = path.rpartition(".")
    try:
        return hasattr(attrgetter(owner)(torch), attr)
    except AttributeError:
        return False


# The per-backend fp32 precision settings (torch 2.9+: "ieee", "tf32", "bf16", "none"). Setting one
# (e.g. torch.backends.mkldnn.matmul.fp32_precision = "bf16": every later fp32 matmul on an AMX CPU runs
# in bf16) makes the legacy getter raise, which would turn into a harness error that would
# fail every later pair in the process, correct ones included. Read and restored before the legacy
# entry, so once they are back the legacy value reads as before.
_FP32_PRECISION = [_torch_flag(p) for p in (
    "backends.fp32_precision", "backends.cuda.matmul.fp32_precision", "backends.cudnn.fp32_precision",
    "backends.cudnn.conv.fp32_precision", "backends.cudnn.rnn.fp32_precision", "backends.mkldnn.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision", "backends.mkldnn.conv.fp32_precision",
    "backends.mkldnn.rnn.fp32_precision") if _has_flag(p)]
_MIXED = "<unreadable: legacy and per-backend precision APIs mixed>"


def _legacy_matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return _MIXED


def _set_legacy_matmul_precision(v: str) -> None:
    if v != _MIXED:
        torch.set_float32_matmul_precision(v)


class _Opaque:
    """A state compared by value and shown by a digest (a generator's state is kilobytes)."""

    def __init__(self, value, key: bytes):
        self.value, self.key = value, key

    def __eq__(self, other) -> bool:
        return isinstance(other, _Opaque) and self.key == other.key

    def __repr__(self) -> str:
        return f"<state {hashlib.sha1(self.key).hexdigest()[:8]}>"


def _torch_rng(get, set_) -> tuple:
    return lambda: _Opaque(s := get(), s.cpu().numpy().tobytes()), lambda v: set_(v.value)


def _pickled_rng(get, set_) -> tuple:
    return lambda: _Opaque(s := get(), pickle.dumps(s)), lambda v: set_(v.value)


def _numpy_rng() -> list:
    try:
        import numpy as np
    except ImportError:
        return []
    return [("numpy.random global state (numpy.random.seed / draws)", *_pickled_rng(np.random.get_state, np.random.set_state))]


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _listing(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


class _Surface:
    """The callables of torch's namespaces (module and class dicts), compared by identity: a candidate
    that monkeypatches torch.matmul or Tensor.softmax changes the reference it is judged against.
    Names that appear later (torch imports submodules lazily) are not a change."""

    def __init__(self):
        self.values = [list(map(vars(owner).get, keys)) for _, owner, keys in _surface_keys()]
        self.key = hash(tuple(id(v) for vals in self.values for v in vals))

    def changed(self, other: "_Surface") -> list[str]:
        return [f"{label}.{k}" for (label, _, keys), mine, now in zip(_surface_keys(), self.values, other.values)
                for k, a, b in zip(keys, mine, now) if a is not b and not _torch_wrapper(b, a)]

    def __eq__(self, other) -> bool:
        return isinstance(other, _Surface) and (self.key == other.key or not self.changed(other))

    def __repr__(self) -> str:
        return f"<{sum(map(len, self.values))} torch callables>"

    def describe(self, now: "_Surface") -> str:
        return "replaced: " + _listing(self.changed(now))

    def restore(self) -> None:
        for (_, owner, keys), vals in zip(_surface_keys(), self.values):
            for k, v in zip(keys, vals):
                if vars(owner).get(k) is not v:
                    setattr(owner, k, v)


_SURFACE: list = []
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torch_wrapper(new, old) -> bool:
    """torch wrapping its own function as it initialises lazily (dynamo replaces torch.manual_seed by
    a dynamo-disabled wrapper of it on first import, seen on the H200): the new object
    unwraps to the old one and its code lives in torch's package."""
    import inspect

    try:
        code = getattr(new, "__code__", None)
        return inspect.unwrap(new) is old and code is not None and code.co_filename.startswith(_TORCH_DIR)
    except ValueError:
        return False


def _surface_keys() -> list:
    """(label, owner, names of its callables) for torch's main namespaces, fixed at the first read."""
    if not _SURFACE:
        import torch.nn.functional as F
        for label, owner in (("torch", torch), ("torch.nn.functional", F), ("torch.linalg", torch.linalg),
                             ("torch.special", torch.special), ("torch.Tensor", torch.Tensor),
                             ("torch._C.TensorBase", torch._C.TensorBase)):
            _SURFACE.append((label, owner, tuple(k for k, v in list(vars(owner).items()) if callable(v))))
    return _SURFACE


class _Overrides:
    """Kernels registered from Python over torch's own operators (aten / prims) at a key that runs them
    (torch registers Meta kernels itself; a candidate's own library registers its own namespace).
    Compared whole first: the filtered sets are built only when a registration happened."""

    def __init__(self):
        import torch.library
        self.all = frozenset(torch.library._impls)      # a C-level copy; filtered only when it differs
        self.defs = frozenset(torch.library._defs)      # operators defined from Python, by qualified name

    @property
    def kernels(self) -> frozenset[str]:
        return frozenset(i for i in self.all if i.startswith(("aten/", "prims/")) and not i.endswith(("/Meta", "/Fake")))

    def over_existing(self, now: "_Overrides") -> list[str]:
        """Kernels registered since this reading over operators that existed at it. An operator defined
        since (torch._inductor defines prims ops as it loads, which any module-level torch.compile
        triggers) and its kernels are new, not an override: nothing the reference calls changed."""
        new_ops = {_base_op(d) for d in now.defs - self.defs}
        return sorted(k for k in now.kernels - self.kernels if _base_op(k) not in new_ops)

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Overrides):
            return False
        early, late = (self, other) if self.defs <= other.defs else (other, self)   # definitions only grow
        return self.all == other.all or not (early.over_existing(late) or early.kernels - late.kernels)

    def __repr__(self) -> str:
        return f"<{len(self.all)} torch.library kernels>"

    def describe(self, now: "_Overrides") -> str:
        gone = sorted(self.kernels - now.kernels)
        return "; ".join(x for x in ("registered: " + _listing(self.over_existing(now)) if self.over_existing(now) else "",
                                     "removed: " + _listing(gone) if gone else "") if x)


def _base_op(name: str) -> str:
    """'prims::foo', 'prims::foo.out' or a torch.library._impls key 'prims/foo.out/CPU' -> 'prims::foo'."""
    if "::" not in name:
        name = "::".join(name.split("/")[:2])
    return name.split(".", 1)[0]


def _default_device():
    ctx = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return None if ctx is None else ctx.device


def _pop_modes(v: tuple[int, int]) -> None:
    while torch._C._len_torch_function_stack() > v[0]:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > v[1]:
        torch._C._pop_torch_dispatch_stack()


_CONFIGS: dict[bytes, dict] = {}     # config hash -> the config it hashes (to put one back)


class _IfLoaded:
    """A config module's hash, read only where the module is loaded: one imported during the call is
    not a change."""

    def __init__(self, module: str):
        mod = sys.modules.get(module)
        self.key = None if mod is None else mod.get_hash()
        if self.key is not None and self.key not in _CONFIGS:
            _CONFIGS[self.key] = mod.get_config_copy()

    def __eq__(self, other) -> bool:
        return isinstance(other, _IfLoaded) and (self.key is None or other.key is None or self.key == other.key)

    def __repr__(self) -> str:
        return "<not loaded>" if self.key is None else f"<config {self.key.hex()[:8]}>"


def _config(module: str) -> tuple:
    def restore(v):
        if v.key is not None and module in sys.modules:
            sys.modules[module].load_config(_CONFIGS[v.key])
    return (f"{module} (changed by the call)", lambda: _IfLoaded(module), restore)


def _sdp(name: str) -> tuple:
    get = getattr(torch.backends.cuda, f"{name}_sdp_enabled")
    return (f"torch.backends.cuda.{name}_sdp_enabled()", get, getattr(torch.backends.cuda, f"enable_{name}_sdp"))


class _Environ:
    """os.environ's variables as they were: one changed or removed is a change; a new one is not
    (inductor and other libraries export private variables as they initialise lazily)."""

    def __init__(self):
        self.vars = dict(os.environ)

    def changed(self, other: "_Environ") -> list[str]:
        return sorted(k for k, v in self.vars.items() if other.vars.get(k) != v)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Environ) and not self.changed(other)

    def __repr__(self) -> str:
        return f"<{len(self.vars)} variables>"

    def describe(self, now: "_Environ") -> str:
        return "changed: " + _listing(self.changed(now), 8)

    def restore(self) -> None:
        os.environ.update(self.vars)


_GENERIC_WARNINGS = (Warning, UserWarning, RuntimeWarning, DeprecationWarning, FutureWarning)


def _is_blanket(f: tuple) -> bool:
    """A filter over every message of every module for a generic category (warnings.simplefilter):
    libraries imported lazily add filters for their own categories or modules, which are not a change."""
    return f[1] is None and f[3] is None and f[2] in _GENERIC_WARNINGS


def _blanket_filters() -> tuple:
    return tuple(f for f in warnings.filters if _is_blanket(f))


def _warnings_restore(v: tuple) -> None:
    warnings.filters[:] = list(v) + [f for f in warnings.filters if not _is_blanket(f)]
    if hasattr(warnings, "_filters_mutated"):
        warnings._filters_mutated()


# Random generators: a decode kernel draws nothing, and one that reseeds or draws from a global generator
# moves the serving process's sampling (torch.manual_seed in a kernel makes every later sample repeat).
_RNG_STATE = [
    ("torch CPU RNG state (torch.manual_seed / draws)", *_torch_rng(torch.get_rng_state, torch.set_rng_state)),
    ("python random state (random.seed / draws)", *_pickled_rng(random.getstate, random.setstate)),
    *_numpy_rng(),
]

_LOAD_TIME = [
    _config("torch._inductor.config"),
    _config("torch._dynamo.config"),
    ("warnings filters (warnings.simplefilter)", _blanket_filters, _warnings_restore),
    ("os.environ (a variable changed or removed)", _Environ, lambda v: v.restore()),
    ("working directory (os.chdir)", os.getcwd, os.chdir),
    *_RNG_STATE,
]

_PROCESS_STATE = [
    ("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
    ("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
    *_FP32_PRECISION,
    ("torch.get_float32_matmul_precision()", _legacy_matmul_precision, _set_legacy_matmul_precision),
    *[_torch_flag(path) for path in (
        "backends.cuda.matmul.allow_tf32", "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        "backends.cuda.matmul.allow_bf16_reduced_precision_reduction", "backends.cudnn.allow_tf32",
        "backends.cudnn.deterministic", "backends.cudnn.benchmark")],
    ("torch deterministic algorithms (enabled, warn_only)", _deterministic,
     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    ("torch.utils.deterministic.fill_uninitialized_memory", lambda: torch.utils.deterministic.fill_uninitialized_memory,
     lambda v: setattr(torch.utils.deterministic, "fill_uninitialized_memory", v)),
    ("autograd anomaly mode (enabled, check_nan)", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda v: torch.set_anomaly_enabled(*v)),
    ("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ("flush denormals (torch.set_flush_denormal)", _flushes_denormals, torch.set_flush_denormal),
    ("torch.is_autocast_enabled('cpu')", lambda: torch.is_autocast_enabled("cpu"),
     lambda v: torch.set_autocast_enabled("cpu", v)),
    ("torch.get_autocast_dtype('cpu')", lambda: torch.get_autocast_dtype("cpu"),
     lambda v: torch.set_autocast_dtype("cpu", v)),
    # set_default_device pushes a torch-function mode: restored before the mode stacks are read
    ("torch.get_default_device() (torch.set_default_device)", _default_device, torch.set_default_device),
    ("torch function / dispatch mode stacks (modes entered and left on)",
     lambda: (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()), _pop_modes),
    ("torch functions and Tensor methods (monkeypatched)", _Surface, lambda v: v.restore()),
    (f"torch.library kernels over aten / prims operators ({UNDOABLE})", _Overrides, lambda v: None),
    *[_torch_flag(path) for path in ("backends.mkldnn.enabled", "backends.opt_einsum.enabled",
                                     "backends.opt_einsum.strategy") if _has_flag(path)],
    *[_sdp(n) for n in ("flash", "mem_efficient", "math", "cudnn") if hasattr(torch.backends.cuda, f"{n}_sdp_enabled")],
    *_LOAD_TIME,
]
# Settings a library may legitimately set while it loads (CuTe DSL pins its arch in os.environ) or that
# do not reach the reference's numbers: not judged at a candidate's import; a call's change still is.
_LOAD_TIME_OK = frozenset(name for name, _, _ in _LOAD_TIME)
_CUDA_STATE = [
    ("torch.is_autocast_enabled('cuda')", lambda: torch.is_autocast_enabled("cuda"),
     lambda v: torch.set_autocast_enabled("cuda", v)),
    ("torch.get_autocast_dtype('cuda')", lambda: torch.get_autocast_dtype("cuda"),
     lambda v: torch.set_autocast_dtype("cuda", v)),
    ("torch.cuda.current_device()", torch.cuda.current_device, torch.cuda.set_device),
    ("torch.cuda.current_stream()", torch.cuda.current_stream, torch.cuda.set_stream),
    ("torch CUDA RNG state of the current device", *_torch_rng(torch.cuda.get_rng_state, torch.cuda.set_rng_state)),
]


def _state_table(device) -> list:
    return _PROCESS_STATE + (_CUDA_STATE if str(device).startswith("cuda") else [])


def process_state(device) -> dict[str, object]:
    """The process-wide settings and generator states of _PROCESS_STATE (and the CUDA ones on a CUDA device), now."""
    return {name: read() for name, read, _ in _state_table(device)}


def _show(before, now) -> str:
    """'old -> new', or what differs where the state is a large table (its own describe)."""
    if hasattr(before, "describe"):
        return before.describe(now)
    if isinstance(before, tuple) and before and isinstance(before[0], tuple):
        return f"{len(before)} -> {len(now)} entries, first now {now[0] if now else None}"
    return f"{before} -> {now}"


def _changes(before: dict[str, object], device) -> list[tuple[str, str]]:
    """(name, what changed) of every setting that differs from `before`, each put back where it can be."""
    changed = []
    for name, read, restore in _state_table(device):
        now = read()
        if not before[name] == now:        # before's side decides: a name or variable that is new is no change
            changed.append((name, _show(before[name], now)))
            restore(before[name])
    return changed


def restore_process_state(before: dict[str, object], device) -> list[str]:
    """Put back every setting that differs from `before`; returns them as 'name: what changed'."""
    return [f"{name}: {what}" for name, what in _changes(before, device)]


def process_state_check(changed: list[str]) -> Check:
    return Check("guard:process_state", not changed,
                 "the call left process-wide settings or random generators changed (restored for the rest of the run "
                 "where they can be): " + "; ".join(changed) if changed else "no process-wide torch setting changed")


def dispatcher_overrides() -> frozenset[tuple[str, str]]:
    """(operator, dispatch key) of every torch operator whose kernel at that key was registered over
    (the dispatcher keeps the replaced one as '(inactive)'), from C++ or Python: ~0.3 s, so it is
    read around a candidate's import, not around every call."""
    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith(("aten::", "prims::")):
            for line in torch._C._dispatch_dump(name).splitlines():
                key, sep, _ = line.partition(" (inactive)")
                if sep and key != "Meta":
                    out.add((name, key))
    return frozenset(out)


def import_changes(before: dict[str, object], overrides_before: frozenset, device) -> list[str]:
    """What a candidate module's import changed of the process the reference runs in (restored where it
    can be), but for _LOAD_TIME_OK; a kernel registered over one of torch's own is named and cannot be
    undone."""
    changed = [f"{name}: {what}" for name, what in _changes(before, device) if name not in _LOAD_TIME_OK]
    new = dispatcher_overrides() - overrides_before
    if new:
        changed.append(f"torch kernels registered over ({UNDOABLE}): "
                       + ", ".join(f"{op} at {key}" for op, key in sorted(new)[:6]))
    return changed
