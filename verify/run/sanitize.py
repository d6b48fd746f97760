"""Sanitizer mode: each op's GPU cases in a subprocess under NVIDIA compute-sanitizer.

    verify-kernels run --sanitize memcheck|racecheck|synccheck|initcheck [--ops ...] [--candidate fused]

Per op: the cases are written as worker requests; one plain run compiles the kernels (the compile cache
is on disk, so the sanitized run does not time the compiler), then the same requests run under
`compute-sanitizer --tool T --report-api-errors no`. Its report is parsed into the op's verdict: any
reported error fails the op, with the first messages as the reason. Without compute-sanitizer or a CUDA
device the run stops with exit 2 and says which is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
_SUMMARY = re.compile(r"=+ (?:ERROR|RACECHECK) SUMMARY: (\d+) (?:errors?|hazards?)")
_ERROR_LINE = re.compile(r"^=+ (Invalid .*|Program hit .*|.*[Hh]azard.*|Race reported.*|Uninitialized .*|"
                         r"Barrier error.*|.*error detected.*|Malloc/Free error.*|Leaked .*)$")


def find_sanitizer() -> str | None:
    exe = shutil.which("compute-sanitizer")
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "compute-sanitizer").exists():
            return str(Path(root, "bin", "compute-sanitizer"))
    return None


def unavailable_reason() -> str | None:
    if find_sanitizer() is None:
        return "compute-sanitizer not found (not on PATH, not in $CUDA_HOME/bin or /usr/local/cuda/bin); install the CUDA toolkit"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA device: compute-sanitizer checks GPU kernels and this machine has none"
    return None


def parse_report(text: str) -> tuple[int, list[str]]:
    """(number of errors or hazards, the first distinct messages) from compute-sanitizer output."""
    total, messages = 0, []
    for line in text.splitlines():
        m = _SUMMARY.search(line)
        if m:
            total += int(m.group(1))
            continue
        e = _ERROR_LINE.match(line.strip())
        if e and e.group(1) not in messages:
            messages.append(e.group(1))
    if total == 0 and messages:
        total = len(messages)
    return total, messages[:5]


def sanitize_cases(op, seed: int, n: int = 2) -> list:
    from verify.model.case import Case
    from verify.model.profile import CONFIG_ORDER

    config = next(c for c in CONFIG_ORDER if c in op.configs)
    return [Case(op.name, seed + i, min(3 + 2 * i, op.max_batch), config, op.dtypes[0], op.dists[i % len(op.dists)])
            for i in range(n)]


def sanitize_op(op, candidate: str, tool: str, seed: int = 0, timeout: float = 600.0, n_cases: int = 2):
    from verify.model.verdict import FAIL, PASS, SKIP, OpVerdict

    if tool not in TOOLS:
        raise ValueError(f"--sanitize {tool!r}: choose one of {', '.join(TOOLS)}")
    label = f"{candidate}/{tool}"
    cases = sanitize_cases(op, seed, n_cases)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vk-sanitize-") as tmp:
        req = Path(tmp, "requests.jsonl")
        req.write_text("".join(json.dumps({"candidate": candidate, "device": "cuda", "case": c.to_json()}) + "\n"
                               for c in cases))
        worker = [sys.executable, "-m", "verify.run.worker", "--batch", str(req)]
        try:
            warm = subprocess.run(worker, capture_output=True, text=True, timeout=timeout)
            run = subprocess.run([find_sanitizer(), "--tool", tool, "--report-api-errors", "no", "--print-limit", "50",
                                  *worker], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return OpVerdict(op.name, label, FAIL, reason=f"sanitizer run timed out after {timeout:g} s",
                             seconds=time.perf_counter() - t0)
    verdicts = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]
    if warm.returncode and not verdicts:
        return OpVerdict(op.name, label, FAIL, reason=f"plain run failed before sanitizing: {warm.stderr[-300:]}")
    if verdicts and all(v["status"] == SKIP for v in verdicts):
        return OpVerdict(op.name, label, SKIP, reason=verdicts[0]["reason"])
    n, messages = parse_report(run.stdout + "\n" + run.stderr)
    bad = [v for v in verdicts if v["status"] == FAIL]
    common = dict(cases_run=len(verdicts), cases_passed=sum(v["status"] == PASS for v in verdicts),
                  seconds=time.perf_counter() - t0, details=tuple(messages))
    if n:
        return OpVerdict(op.name, label, FAIL, reason=f"{tool}: {n} error(s): " + "; ".join(messages[:2]), **common)
    if bad or len(verdicts) < len(cases):
        why = bad[0]["reason"] if bad else f"process exited {run.returncode} after {len(verdicts)} of {len(cases)} cases"
        return OpVerdict(op.name, label, FAIL, reason=f"under {tool}: {why}", **common)
    return OpVerdict(op.name, label, PASS, **common)
