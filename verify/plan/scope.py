"""A candidate's declared scope: the part of an op's contract its module says it implements.

Third-party kernels often implement part of an op's contract (fla-core's KDA kernel fixes the q/k
L2-norm eps at 1e-6, where `kda_decode` takes `l2_eps` as a parameter). A candidate's module declares

    DTYPES = ("bfloat16", "float16")        # the working dtypes it implements
    PARAMS = {"l2_eps": (1e-6,)}             # the values it supports of a parameter of the op

and the draw keeps inside them: the other dtypes are not drawn, and every case pins each declared
parameter to one of its values (the case's knob, so a repro replays it). The verdict names the scope
("scope: l2_eps = 1e-6 only"), never a silent pass, and `check --full-scope` (the release gate)
refuses a verdict with one.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from verify.model.case import Case


class ScopeError(ValueError):
    """A declaration the op cannot honour (a parameter it does not take, a value it does not pin)."""


@dataclass(frozen=True)
class Scope:
    profile: object | None                  # the profile narrowed to the declared dtypes; None: nothing to draw
    notes: tuple[str, ...] = ()             # "scope: ..." lines for the verdict
    params: dict[str, tuple] = field(default_factory=dict)
    skip_reason: str = ""

    def apply(self, case: Case) -> Case:
        return pin(case, self.params)


def pin(case: Case, params: dict) -> Case:
    """The case with each declared parameter pinned to one of its values (by the case's seed)."""
    if not params:
        return case
    extra = dict(case.extra)
    for name, values in params.items():
        if extra.get(name) not in values:
            extra[name] = values[case.seed % len(values)]
    return replace(case, extra=tuple(sorted(extra.items())))


def _module(fn):
    return sys.modules.get(getattr(fn, "__module__", ""), None)


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def declared_params(op, fn, profile) -> dict[str, tuple]:
    """The module's PARAMS, checked against the op: every name a parameter the op's cases carry, and
    a pinned value what the op's input builder then passes. Raises ScopeError naming the problem."""
    declared = getattr(_module(fn), "PARAMS", None)
    if declared is None:
        return {}
    mod = fn.__module__
    if not isinstance(declared, dict) or not declared:
        raise ScopeError(f"{mod}.PARAMS must be a non-empty dict: parameter name -> tuple of supported values")
    from verify.model.profile import CONFIG_ORDER, drawn_dtypes

    config = next((c for c in CONFIG_ORDER if c in op.configs and c in profile.configs), op.configs[0])
    probe = Case(op.name, 0, 1, config, drawn_dtypes(op, profile)[0], op.dists[0])
    takes = sorted(op.make_inputs(probe).params)
    out = {}
    for name, values in declared.items():
        values = tuple(values) if isinstance(values, (tuple, list)) else (values,)
        if name not in takes:
            raise ScopeError(f"{mod}.PARAMS names {name!r}, which op {op.name} does not take "
                             f"(its parameters: {', '.join(takes) or 'none'})")
        if not values:
            raise ScopeError(f"{mod}.PARAMS[{name!r}] lists no value")
        for v in values:
            got = op.make_inputs(replace(probe, extra=((name, v),))).params.get(name)
            if got != v:
                raise ScopeError(f"{mod}.PARAMS[{name!r}] = {values}: op {op.name} does not take {name} from a "
                                 f"declaration (a case pinned to {v!r} gave {got!r}); it cannot be scoped")
        out[name] = values
    return out


def candidate_scope(op, fn, profile) -> Scope:
    """The candidate's declared scope for this op and profile (DTYPES, PARAMS of its module)."""
    notes: list[str] = []
    declared = getattr(_module(fn), "DTYPES", None)
    if declared is not None:
        from verify.model.profile import drawn_dtypes

        drawn = drawn_dtypes(op, profile)
        keep = [d for d in drawn if d in declared]
        left = [d for d in drawn if d not in declared]
        why = f"{fn.__module__} declares DTYPES = {', '.join(declared)}"
        if not keep:
            return Scope(None, skip_reason=f"not drawn: {', '.join(left)} ({why})")
        if left:
            profile = replace(profile, dtypes=tuple(keep))
            notes.append(f"scope: {', '.join(left)} not drawn ({why})")
    params = declared_params(op, fn, profile)
    if params:
        each = "; ".join(f"{n} = {', '.join(map(_fmt, vs))} only" for n, vs in params.items())
        notes.append(f"scope: {each} ({fn.__module__} declares PARAMS)")
    return Scope(profile, tuple(notes), params)
