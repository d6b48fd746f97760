"""Terminal report: a summary table and, for each failure, the worst elements and a repro line."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from verify.model.verdict import FAIL, PASS, SKIP, VACUOUS, WAIVED, XPASS, CaseVerdict, OpVerdict

STYLE = {PASS: "green", FAIL: "bold red", SKIP: "yellow", WAIVED: "cyan", XPASS: "bold magenta"}
WORD = {PASS: "certified", FAIL: "FAILED", SKIP: "skipped", WAIVED: "waived", XPASS: "waiver stale"}


def summary_table(verdicts: list[OpVerdict]) -> Table:
    t = Table(title="verify-kernels", show_lines=False)
    for col in ("op", "candidate", "verdict", "cases", "worst err/tol", "s", "reason"):
        t.add_column(col, overflow="fold")
    for v in verdicts:
        worst = max(v.worst_ratio.values(), default=None)
        word = WORD.get(v.status, v.status)
        if v.failure is not None and v.failure.stage.startswith("invariance:"):
            word = "NOT INVARIANT"      # right values, a broken bitwise claim (verify/judge/invariance.py)
        t.add_row(v.op, v.candidate, f"[{STYLE.get(v.status, '')}]{word}[/]",
                  f"{v.cases_passed}/{v.cases_run}" + (f" (+{v.cases_vacuous} vacuous)" if v.cases_vacuous else ""),
                  "" if worst is None else f"{worst:.3g}", f"{v.seconds:.1f}", v.reason[:160])
    return t


def print_failure(console: Console, v: OpVerdict) -> None:
    console.print(f"[bold red]FAIL[/] {v.op} ({v.candidate}): {v.reason}")
    if v.failure is not None:
        print_case(console, v.failure)
    if v.repro:
        console.print(f"  repro: {v.repro}", soft_wrap=True)


def print_case(console: Console, cv: CaseVerdict) -> None:
    console.print(f"  case: {cv.case}", soft_wrap=True)
    params = drawn_params(cv.case)
    if params:
        console.print(f"  params: {params}", soft_wrap=True)
    console.print(f"  status: {cv.status}  stage: {cv.stage}  reason: {cv.reason}", soft_wrap=True)
    for c in cv.checks:
        if c.ok:
            continue
        console.print(f"  [red]x[/] {c.name}: {c.detail}", soft_wrap=True)
        if c.worst:
            header, rows = worst_rows(c.worst)
            console.print(f"    worst elements ({header}):")
            for row in rows:
                console.print(f"      {row}")


def drawn_params(case_json: str) -> str:
    """The static parameters the case ran with ("l2_eps=1e-05, ..."): most are drawn from the seed
    (verify/ops/common_splits.scalar_param), so the case's JSON alone does not show them, and a
    failure that only one value of an eps causes would otherwise read as a failure at the config's
    value. Rebuilt from the case (drawing its inputs: under 2 s on one CPU at the tiny and small
    configs, minutes for a K3 layer, so not at k3); "" where it is not (a report never fails for
    want of it)."""
    try:
        from verify.model.case import Case
        from verify.ops.registry import get_op

        case = Case.from_json(case_json)
        if case.config == "k3":
            return ""
        params = get_op(case.op).make_inputs(case).params
    except Exception:
        return ""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def worst_rows(worst: tuple) -> tuple[str, list[tuple]]:
    """(what a row holds, the rows) of a Check's worst elements: (index, candidate, oracle, baseline)
    from a derived comparison; (index, candidate, expected) from a bitwise one or a guard's
    comparison of two runs (baseline None; expected = the reference's or the first run's bits); one
    (row, why) from an ids check. A single row arrives unwrapped."""
    rows = [tuple(worst)] if len(worst) == 4 and not isinstance(worst[1], (tuple, list)) else [tuple(r) for r in worst]
    if all(len(r) == 4 and r[3] is None for r in rows):
        if all(r[2] is None for r in rows):
            return "row, why", [r[:2] for r in rows]
        return "index, candidate, expected", [r[:3] for r in rows]
    return "index, candidate, oracle, baseline", rows


def print_skips(console: Console, verdicts: list[OpVerdict]) -> None:
    skips = [v for v in verdicts if v.status == SKIP]
    if skips:
        console.print(f"[yellow]Skipped {len(skips)} op/candidate pairs (not counted as passed):[/]")
        reasons: dict[str, list[str]] = {}
        for v in skips:
            reasons.setdefault(f"{v.candidate}: {v.reason}", []).append(v.op)
        for why, ops in reasons.items():
            console.print(f"  - {why} -> {', '.join(ops)}")


__all__ = ["summary_table", "print_failure", "print_case", "print_skips", "worst_rows", "drawn_params", "VACUOUS"]
