"""Progress of a run, case by case: a bar on a terminal; in a log (CI, a redirected run) a plain
line when a pair starts, at most every INTERVAL_S seconds while it runs, and when it ends, so a log
never sits silent for minutes. Reads case and op verdicts only."""
from __future__ import annotations

import time

INTERVAL_S = 10.0


class RunProgress:
    """Use as a context manager around a run's pairs: start(op, candidate), case(verdict) per judged
    case, done(op verdict)."""

    def __init__(self, console, pairs: int, interval_s: float = INTERVAL_S):
        self.console, self.pairs, self.interval_s = console, pairs, interval_s
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console, transient=True)
            self.task = self.bar.add_task("certifying", total=pairs)
        self.index, self.name, self.cases, self.failed, self.t0, self.last = 0, "", 0, 0, 0.0, 0.0

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def _text(self) -> str:
        return (f"[{self.index}/{self.pairs}] {self.name}: {self.cases} cases judged, {self.failed} failed, "
                f"{time.monotonic() - self.t0:.0f} s")

    def _show(self, force: bool = False) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=self._text())
        elif force or time.monotonic() - self.last >= self.interval_s:
            self.console.print(self._text(), highlight=False, soft_wrap=True)
            self.last = time.monotonic()

    def start(self, op: str, candidate: str) -> None:
        self.index += 1
        self.name, self.cases, self.failed = f"{op} / {candidate}", 0, 0
        self.t0 = self.last = time.monotonic()
        if self.bar is None:
            self.console.print(f"[{self.index}/{self.pairs}] {self.name}: started", highlight=False, soft_wrap=True)
        self._show()

    def case(self, v) -> None:
        self.cases += 1
        self.failed += v.status in ("fail", "unexpected_pass")
        self._show()

    def done(self, v) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)
        else:
            self.console.print(f"{self._text()}: {v.status}", highlight=False, soft_wrap=True)
