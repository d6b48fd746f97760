"""Rerun one case of a failure in Python, with the candidate itself: the repro of a kernel that no
command line can name (a lambda, a function defined inside a test), printed by vk_certify's failure.

    from verify.repro import repro
    repro('{"op": "skinny_gemm", "seed": 3, ...}', my_kernel)      # prints the worst elements
"""
from __future__ import annotations


def repro(case_json: str, fn, device: str | None = None):
    """Judge `fn` on the case (a case record as printed with a failure); print and return its verdict."""
    import torch
    from rich.console import Console

    from verify.model.case import Case
    from verify.judge.pipeline import judge_case
    from verify.ops.registry import get_op
    from verify.record.reporters.terminal import print_case
    from verify.model.specs import load_spec

    case = Case.from_json(case_json)
    op = get_op(case.op)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    label = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    v = judge_case(op, case, fn, label, device, load_spec(op.name))
    print_case(Console(), v)
    return v


def repro_text(op_name: str, case_json: str, fn, command: str) -> str:
    """What a failure of `fn` prints to be rerun: the command where the candidate can be named from a
    shell (`command`: certify's repro line), else the case and the Python call that reruns it."""
    from verify.judge.candidates import callable_label

    label, loadable = callable_label(fn)
    if loadable:
        return command
    return (f"{label} cannot be named on a command line (a lambda or a function defined inside another); "
            f"rerun the case with the same function object:\n"
            f"    from verify.repro import repro; repro({case_json!r}, <the {op_name} function>)")
