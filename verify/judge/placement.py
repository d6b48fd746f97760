"""Guards around one candidate call: canaries, poisoned outputs, input checksums, aliasing, type checks.

Every tensor handed to a candidate is a view into a larger buffer filled with a canary pattern, so a
write anywhere outside the tensor (past its end, into row padding) is seen. Non-state inputs are
compared bit-for-bit afterwards; outputs must be fresh memory of the exact type, dtype and shape.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verify.model.verdict import Check

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

    def changed_outside(self) -> torch.Tensor:
        """How many elements of the buffer outside the view changed bits since the call, as a 0-d
        tensor on the buffer's device (read with the other checks of a call in one transfer)."""
        diff = _bits(self.buf) != _bits(self.before)     # buf is allocated contiguous: diff shares its strides
        diff.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset() - self.buf.storage_offset()).zero_()
        return diff.sum()

    def outside_changed(self) -> int:
        return int(self.changed_outside())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_int_like(t)) if t.is_floating_point() else t


def _int_like(t: torch.Tensor) -> torch.dtype:
    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]


def place(name: str, value: torch.Tensor, device, strided: bool = False, poison: bool = False,
          offset: int = 0, owned: bool = False) -> Guarded:
    """Copy `value` into a canary-padded buffer on `device`; strided=True pads every row too.
    offset=k starts the view k elements past its usual start (CANARY_PAD elements into a fresh
    buffer: at least 64 bytes, so 16-byte aligned): a base misaligned by k x element_size bytes.
    owned=True: a contiguous tensor that owns its whole storage, no canaries (what an engine's own
    allocations look like: a kernel that takes such an input for a dead temporary writes into it)."""
    if owned:
        view = value.to(device).clone(memory_format=torch.contiguous_format)
        return Guarded(name, view, view, view.clone())
    shape = tuple(value.shape)
    last = shape[-1] if shape else 1
    row_pad = 3 if strided and len(shape) >= 1 else 0
    rows = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
    n = rows * (last + row_pad) if shape else 1
    start = CANARY_PAD + offset
    buf = torch.empty(start + n + CANARY_PAD, dtype=value.dtype, device=device)
    _canary_fill(buf)
    if shape:
        strides, acc = [], 1
        for i, s in enumerate(reversed(shape)):
            strides.append(acc)
            acc *= (s + row_pad) if i == 0 else s
        view = buf.as_strided(shape, tuple(reversed(strides)), start)
    else:
        view = buf.as_strided((), (), start)
    if poison:
        view.fill_(poison_value(value.dtype))
    else:
        view.copy_(value.to(device))
    return Guarded(name, buf, view, buf.clone())


MERGE_PAD = 8            # canary elements closing each row of a merged buffer (its row stride is no sum of widths)


def merge_groups(tensors: dict[str, torch.Tensor], exclude: tuple[str, ...] = ()) -> list[list[str]]:
    """Inputs a merged projection would return side by side: two or more of one dtype and the same
    leading dims (kda_decode's q, k, v, g, beta, z), in signature order; state and 1-d tensors left out."""
    groups: dict[tuple, list[str]] = {}
    for k, v in tensors.items():
        if k not in exclude and v.dim() >= 2:
            groups.setdefault((v.dtype, tuple(v.shape[:-1])), []).append(k)
    return [g for g in groups.values() if len(g) >= 2]


def place_merged(names: list[str], tensors: dict[str, torch.Tensor], device) -> dict[str, Guarded]:
    """The tensors `names` as adjacent column slices of one buffer, in order, each row closed by
    MERGE_PAD canary elements: the layout of a merged projection's output (kda_in_proj's q|k|v|g|...)."""
    lead = tuple(tensors[names[0]].shape[:-1])
    widths = [tensors[n].shape[-1] for n in names]
    buf = torch.empty(lead + (sum(widths) + MERGE_PAD,), dtype=tensors[names[0]].dtype, device=device)
    _canary_fill(buf)
    views, off = {}, 0
    for n, w in zip(names, widths):
        views[n] = buf[..., off:off + w]
        views[n].copy_(tensors[n].to(device))
        off += w
    before = buf.clone()
    return {n: Guarded(n, buf, v, before) for n, v in views.items()}


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
    # behave only while judged; the allocator stays a plain function
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
    recheck: Callable[[], list[Check]] | None = None     # the call's input and canary checks, run again


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
        if t.device != want.device:
            problems.append(f"device {t.device} != {want.device}")
        if t.requires_grad and not want.requires_grad:
            problems.append("requires_grad=True (every later op on it records an autograd graph)")
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
    if len(results) == len(names):
        checks.append(_layout_check(results, expected, out_buffers))
    return results, checks


def _layout_check(results: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  out_buffers: dict[str, Guarded] | None = None) -> Check:
    """guard:output_layout: each output laid out as the reference's (contiguous, or its strides), and
    starting 16-byte aligned where the reference's does. A transposed view or a slice of a padded
    workspace holds the right values, but the next fused kernel of the layer reads its data_ptr()
    row-major, and its vector or TMA loads assume the aligned base torch's allocator hands out.
    An out= buffer the harness passed is the caller's layout, not the candidate's."""
    passed = {n: g.view.data_ptr() for n, g in (out_buffers or {}).items()}
    bad = [f"{n}: strides {tuple(t.stride())}, the reference's {tuple(expected[n].stride())}"
           for n, t in results.items()
           if not t.is_contiguous() and _strides(t) != _strides(expected[n])]
    bad += [f"{n}: starts {t.data_ptr() % 16} bytes past a 16-byte boundary (the reference's output is aligned)"
            for n, t in results.items()
            if t.numel() and t.data_ptr() % 16 and expected[n].data_ptr() % 16 == 0 and passed.get(n) != t.data_ptr()]
    return Check("guard:output_layout", not bad, "; ".join(bad) or "outputs laid out as the reference's")


def _strides(t: torch.Tensor) -> tuple:
    return tuple(st for st, sz in zip(t.stride(), t.shape) if sz > 1)


def check_inputs_and_canaries(op, guarded: dict[str, Guarded], originals: dict[str, torch.Tensor],
                              out_buffers: dict[str, Guarded]) -> list[Check]:
    """guard:inputs_unchanged (every non-state input bit-identical to its original after the call) and
    guard:canaries (nothing written outside a tensor). Every count stays on the device until one
    transfer reads them all: a device-wide wait per tensor would serialise runs sharing the GPU."""
    counts: list[tuple[str, str, torch.Tensor]] = []         # (kind, name, count of differing elements)
    mutated = []
    for name, g in guarded.items():
        if name not in op.state:
            orig = originals[name].to(g.view.device)
            if orig.shape != g.view.shape or orig.dtype != g.view.dtype:
                mutated.append(name)
            else:
                counts.append(("mutated", name, (_bits(g.view) != _bits(orig)).sum()))
        counts.append(("stomped", name, g.changed_outside()))
    for name, g in out_buffers.items():
        counts.append(("stomped", f"out {name}", g.changed_outside()))
    read = torch.stack([c.to(torch.int64) for _, _, c in counts]).tolist() if counts else []
    mutated += [name for (kind, name, _), n in zip(counts, read) if kind == "mutated" and n]
    stomped = [f"{name} ({n} elements)" for (kind, name, _), n in zip(counts, read) if kind == "stomped" and n]
    mutated = [n for n in guarded if n in mutated]          # signature order
    return [
        Check("guard:inputs_unchanged", not mutated,
              f"inputs modified in place: {', '.join(mutated)}" if mutated else "all inputs bit-identical after the call"),
        Check("guard:canaries", not stomped,
              f"writes outside the tensors: {', '.join(stomped)}" if stomped else "no writes outside tensors"),
    ]


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
