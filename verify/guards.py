"""Guards around one candidate call: canaries, poisoned outputs, input checksums, aliasing, type checks.

Every tensor handed to a candidate is a view into a larger buffer filled with a canary pattern, so a
write anywhere outside the tensor (past its end, into row padding) is seen. Non-state inputs are
compared bit-for-bit afterwards; outputs must be fresh memory of the exact type, dtype and shape.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import pickle
import random
from dataclasses import dataclass, field
from operator import attrgetter

import torch
import torch.utils.deterministic  # fill_uninitialized_memory below

from verify.verdict import Check

CANARY_PAD = 64          # elements of canary on each side of every tensor


def _canary_fill(buf: torch.Tensor) -> None:
    if buf.is_floating_point():
        buf.fill_(-3.0e4 if buf.dtype == torch.float16 else 1.2345e20)   # big, finite, odd bits
    elif buf.dtype == torch.bool:
        buf.fill_(True)
    else:
        buf.fill_(0x5A if buf.dtype == torch.uint8 else -0x5A5A5A5)


def poison_value(dtype: torch.dtype):
    """NaN for floats; for integers a value no index or count takes (0xAB for bytes, the type's min)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    if dtype == torch.uint8:
        return 0xAB
    return torch.iinfo(dtype).min if dtype.is_signed else 0xAB


@dataclass
class Guarded:
    """A tensor placed inside a canary buffer; `view` is what the candidate sees."""
    name: str
    buf: torch.Tensor
    view: torch.Tensor
    before: torch.Tensor      # the whole buffer's bits before the call

    def outside_changed(self) -> int:
        after = self.buf.clone()
        before = self.before.clone()
        for t in (after, before):
            t.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset()).zero_()
        if after.is_floating_point():
            return int((after.view(_int_like(after)) != before.view(_int_like(before))).sum())
        return int((after != before).sum())


def _int_like(t: torch.Tensor) -> torch.dtype:
    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]


def place(name: str, value: torch.Tensor, device, strided: bool = False, poison: bool = False) -> Guarded:
    """Copy `value` into a canary-padded buffer on `device`; strided=True pads every row too."""
    shape = tuple(value.shape)
    last = shape[-1] if shape else 1
    row_pad = 3 if strided and len(shape) >= 1 else 0
    rows = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
    n = rows * (last + row_pad) if shape else 1
    buf = torch.empty(CANARY_PAD + n + CANARY_PAD, dtype=value.dtype, device=device)
    _canary_fill(buf)
    if shape:
        strides, acc = [], 1
        for i, s in enumerate(reversed(shape)):
            strides.append(acc)
            acc *= (s + row_pad) if i == 0 else s
        view = buf.as_strided(shape, tuple(reversed(strides)), CANARY_PAD)
    else:
        view = buf.as_strided((), (), CANARY_PAD)
    if poison:
        view.fill_(poison_value(value.dtype))
    else:
        view.copy_(value.to(device))
    return Guarded(name, buf, view, buf.clone())


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = storage_span(a), storage_span(b)
    return a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1)


def elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if two views share an element. Disjoint slices of one buffer (a merged GEMM's q, k, v
    columns) are legitimate outputs; the same element reachable from two outputs is not."""
    if not overlaps(a, b):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.element_size() != b.element_size():
        return True
    return bool(torch.isin(_element_offsets(a), _element_offsets(b)).any())


def accepts_out(fn) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def poison_allocator(like: list[torch.Tensor], device) -> None:
    """Leave freed blocks of exactly the outputs' byte sizes, filled with NaN (or -1), in the
    allocator, so torch.empty in a candidate gets poison back, not zeros or a stale copy of the
    answer, where it forgets to write (the CUDA caching allocator and glibc both reuse them)."""
    junk = []
    for t in like:
        for size in (t.numel(), t.numel() + 16):
            buf = torch.empty(size, dtype=t.dtype, device=device)
            buf.fill_(poison_value(t.dtype))
            junk.append(buf)
    del junk


def _poisoning(fn):
    def alloc(*args, **kwargs):
        t = fn(*args, **kwargs)
        # Only real memory: not while torch.compile traces or compiles, not fake or meta tensors.
        if (type(t) is torch.Tensor and t.numel() and t.device.type != "meta"
                and not torch.compiler.is_compiling()):
            t.fill_(poison_value(t.dtype))
        return t

    # no __wrapped__ (functools' mark of a wrapper): a candidate could test torch.empty for it and
    # behave only while judged (session 18's probe); the allocator stays a plain function
    return alloc


# Created once so their identity is stable (torch.compile guards on the functions it sees).
_EMPTY = {name: _poisoning(getattr(torch, name)) for name in ("empty", "empty_like", "empty_strided")}
_NEW_EMPTY = _poisoning(torch.Tensor.new_empty)


@contextlib.contextmanager
def poisoned_empty():
    """While the candidate runs, torch.empty & co. hand out poisoned memory (NaN, 0xAB, -0x1234567),
    so an output element the candidate never writes shows as poison on any allocator, CPU included."""
    saved = {name: getattr(torch, name) for name in _EMPTY}
    saved_new = torch.Tensor.new_empty
    try:
        for name, fn in _EMPTY.items():
            setattr(torch, name, fn)
        torch.Tensor.new_empty = _NEW_EMPTY
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
        torch.Tensor.new_empty = saved_new


@dataclass
class CallResult:
    results: dict[str, torch.Tensor] = field(default_factory=dict)   # outputs and state after the call
    checks: list[Check] = field(default_factory=list)
    error: str | None = None


def check_outputs(op, returned, expected: dict[str, torch.Tensor], inputs_guarded: dict[str, Guarded],
                  out_buffers: dict[str, Guarded]) -> tuple[dict[str, torch.Tensor], list[Check]]:
    """Match what the candidate returned to op.outputs: count, exact type, dtype, shape, device, aliasing."""
    names = op.outputs
    if not names:
        got = ()
        if returned is not None and not (isinstance(returned, tuple) and len(returned) == 0):
            return {}, [Check("guard:output_type", False, f"op {op.name} returns nothing, candidate returned "
                              f"{type(returned).__name__}")]
    elif len(names) == 1:
        got = (returned,) if not isinstance(returned, (tuple, list)) else tuple(returned)
    else:
        got = tuple(returned) if isinstance(returned, (tuple, list)) else (returned,)
    if out_buffers and returned is None:
        got = tuple(out_buffers[n].view for n in names)
    if len(got) != len(names):
        return {}, [Check("guard:output_type", False, f"expected {len(names)} outputs {names}, got {len(got)}")]
    checks, results = [], {}
    for name, t in zip(names, got):
        want = expected[name]
        if type(t) is not torch.Tensor:
            checks.append(Check("guard:output_type", False, f"output {name}: expected exactly torch.Tensor, got "
                                f"{type(t).__module__}.{type(t).__name__}"))
            continue
        problems = []
        if t.dtype != want.dtype:
            problems.append(f"dtype {t.dtype} != {want.dtype}")
        if tuple(t.shape) != tuple(want.shape):
            problems.append(f"shape {tuple(t.shape)} != {tuple(want.shape)}")
        if t.device.type != want.device.type:
            problems.append(f"device {t.device} != {want.device}")
        if problems:
            checks.append(Check("guard:output_type", False, f"output {name}: " + "; ".join(problems)))
            continue
        results[name] = t
    if len(results) == len(names):
        checks.append(Check("guard:output_type", True, "exact type, dtype, shape and device"))
    alias = []
    for name, t in results.items():
        for gname, g in inputs_guarded.items():
            if overlaps(t, g.buf):
                alias.append(f"output {name} aliases input {gname}")
        for other, u in results.items():
            if other < name and elements_overlap(t, u) and not (name in out_buffers and other in out_buffers):
                alias.append(f"outputs {other} and {name} share memory")
    checks.append(Check("guard:no_aliasing", not alias, "; ".join(alias) or "outputs are fresh memory"))
    return results, checks


def check_inputs_and_canaries(op, guarded: dict[str, Guarded], originals: dict[str, torch.Tensor],
                              out_buffers: dict[str, Guarded]) -> list[Check]:
    mutated, stomped = [], []
    for name, g in guarded.items():
        if name not in op.state:
            orig = originals[name].to(g.view.device)
            same = torch.equal(g.view.view(_int_like(g.view)) if g.view.is_floating_point() else g.view,
                               orig.view(_int_like(orig)) if orig.is_floating_point() else orig)
            if not same:
                mutated.append(name)
        n = g.outside_changed()
        if n:
            stomped.append(f"{name} ({n} elements)")
    for name, g in out_buffers.items():
        n = g.outside_changed()
        if n:
            stomped.append(f"out {name} ({n} elements)")
    return [
        Check("guard:inputs_unchanged", not mutated,
              f"inputs modified in place: {', '.join(mutated)}" if mutated else "all inputs bit-identical after the call"),
        Check("guard:canaries", not stomped,
              f"writes outside the tensors: {', '.join(stomped)}" if stomped else "no writes outside tensors"),
    ]


def _flushes_denormals() -> bool:
    """Whether this thread flushes float32 denormals to zero (torch.set_flush_denormal has no getter)."""
    return torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() == 0.0


def _torch_flag(path: str) -> tuple[str, object, object]:
    """(name, read, restore) of a flag attribute under torch, e.g. 'backends.cudnn.benchmark'."""
    owner, _, attr = path.rpartition(".")
    return (f"torch.{path}", lambda: getattr(attrgetter(owner)(torch), attr),
            lambda v: setattr(attrgetter(owner)(torch), attr, v))


# Process-wide settings a candidate could change and leave changed: (name, read, restore). Each alters
# every later computation in the process: the reference's own runs in the working dtype (which the
# tolerances are measured against: TF32 matmuls or flushed denormals loosen them), the next cases'
# candidate calls, or where work is queued (the current stream).
def _has_flag(path: str) -> bool:
    owner, _, attr = path.rpartition(".")
    try:
        return hasattr(attrgetter(owner)(torch), attr)
    except AttributeError:
        return False


# The per-backend fp32 precision settings (torch 2.9+: "ieee", "tf32", "bf16", "none"). Setting one
# (e.g. torch.backends.mkldnn.matmul.fp32_precision = "bf16": every later fp32 matmul on an AMX CPU runs
# in bf16) makes the legacy getter raise, which session 18's probe turned into a harness error that
# failed every later pair in the process, correct ones included. Read and restored before the legacy
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


# Random generators: a decode kernel draws nothing, and one that reseeds or draws from a global generator
# moves the serving process's sampling (torch.manual_seed in a kernel makes every later sample repeat).
_RNG_STATE = [
    ("torch CPU RNG state (torch.manual_seed / draws)", *_torch_rng(torch.get_rng_state, torch.set_rng_state)),
    ("python random state (random.seed / draws)", *_pickled_rng(random.getstate, random.setstate)),
    *_numpy_rng(),
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
    *_RNG_STATE,
]
_CUDA_STATE = [
    ("torch.is_autocast_enabled('cuda')", lambda: torch.is_autocast_enabled("cuda"),
     lambda v: torch.set_autocast_enabled("cuda", v)),
    ("torch.cuda.current_device()", torch.cuda.current_device, torch.cuda.set_device),
    ("torch.cuda.current_stream()", torch.cuda.current_stream, torch.cuda.set_stream),
    ("torch CUDA RNG state of the current device", *_torch_rng(torch.cuda.get_rng_state, torch.cuda.set_rng_state)),
]


def _state_table(device) -> list:
    return _PROCESS_STATE + (_CUDA_STATE if str(device).startswith("cuda") else [])


def process_state(device) -> dict[str, object]:
    """The process-wide settings and generator states of _PROCESS_STATE (and the CUDA ones on a CUDA device), now."""
    return {name: read() for name, read, _ in _state_table(device)}


def restore_process_state(before: dict[str, object], device) -> list[str]:
    """Put back every setting that differs from `before`; returns them as 'name: old -> new'."""
    changed = []
    for name, read, restore in _state_table(device):
        now = read()
        if now != before[name]:
            changed.append(f"{name}: {before[name]} -> {now}")
            restore(before[name])
    return changed


def process_state_check(changed: list[str]) -> Check:
    return Check("guard:process_state", not changed,
                 "the call left process-wide settings or random generators changed (restored for the rest of the run): "
                 + "; ".join(changed) if changed else "no process-wide torch setting changed")


def check_unwritten(results: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> Check:
    """Poison left in an output where the reference is finite means the candidate never wrote it."""
    bad = []
    for name, t in results.items():
        if not t.is_floating_point():
            continue
        ref = reference[name].to(t.device)
        hole = torch.isnan(t) & torch.isfinite(ref)
        if hole.any():
            idx = torch.nonzero(hole)[0].tolist()
            bad.append(f"{name}: {int(hole.sum())} elements unwritten or NaN (first at {tuple(idx)})")
    return Check("guard:outputs_written", not bad, "; ".join(bad) or "every output element written")
