"""--profile-kernels: where one run's time goes, kernel by kernel.

torch: after an entry is timed, one more pass over its launches runs under torch.profiler and the
kernels' device times go to OUT/profile/<op>/<shape>/<entry>.txt; beside it, <entry>.overlap.txt says
which stream each kernel ran on and how much of it another stream's work covered (verify/bench/overlap.py:
a side stream's shared experts under the routed experts, an L2 prefetch under a gather).
ncu: the bench command runs again under Nsight Compute (`ncu`), which profiles every kernel launched
inside the NVTX range each entry's first timed pass opens (VERIFY_BENCH_NVTX=1 in the child); the
report is OUT/profile/bench.ncu-rep and its text OUT/profile/bench.txt. Times under ncu are
meaningless (it replays each kernel); the child's bench.json goes to OUT/profile/.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

NVTX_ENV = "VERIFY_BENCH_NVTX"
RANGE = "verify-bench"
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats",
            "SchedulerStats", "SourceCounters")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)


def torch_profiler(out_dir: str | Path):
    """A profile hook for run.bench_shape: one profiled pass per entry, its kernel table written."""
    def profile(op: str, shape: str, name: str, launches: list) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for launch in launches:
                launch()
            torch.cuda.synchronize()
        p = Path(out_dir) / "profile" / _safe(op) / _safe(shape) / f"{_safe(name)}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        p.with_suffix(".overlap.txt").write_text(stream_overlap(prof))
    return profile


def stream_overlap(prof) -> str:
    """The overlap summary (verify/bench/overlap.py) of a finished torch.profiler run's device work."""
    from verify.bench.overlap import format_summary, summarize

    return format_summary(summarize(profiled_intervals(prof)))


def profiled_intervals(prof) -> list:
    """The device work of a finished torch.profiler run (verify.bench.overlap.Interval, start order)."""
    import json
    import tempfile

    from verify.bench.overlap import device_intervals

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return device_intervals(json.loads(path.read_text()))


def nvtx_marker():
    """A profile hook marking one pass of each entry with an NVTX range (for the ncu child)."""
    def profile(op: str, shape: str, name: str, launches: list) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(RANGE)
        torch.cuda.nvtx.range_push(f"{op} {shape} {name}")
        for launch in launches[:1]:
            launch()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()
    return profile


def run_under_ncu(argv: list[str], out_dir: str | Path) -> int:
    """Run the same `verify-kernels bench` under ncu (NVTX_ENV set: the child marks, it does not re-run
    itself), its record under OUT/profile; 2 when ncu is missing."""
    ncu = shutil.which("ncu")
    if ncu is None:
        print("verify-kernels bench: --profile-kernels ncu needs Nsight Compute's `ncu` on PATH", file=sys.stderr)
        return 2
    prof = Path(out_dir) / "profile"
    prof.mkdir(parents=True, exist_ok=True)
    child = _with_out(argv, str(prof))        # keeps --profile-kernels ncu: the child marks its NVTX ranges
    cmd = [ncu, "--nvtx", "--nvtx-include", f"{RANGE}/", *sum((["--section", s] for s in SECTIONS), []),
           "-f", "-o", str(prof / "bench"), sys.executable, "-m", "verify.cli", *child]
    rc = subprocess.run(cmd, env={**os.environ, NVTX_ENV: "1"}).returncode
    rep = prof / "bench.ncu-rep"
    if rep.exists():
        with open(prof / "bench.txt", "w") as f:
            subprocess.run([ncu, "--import", str(rep), "--page", "details"], stdout=f)
    return rc


def _with_out(argv: list[str], out: str) -> list[str]:
    res, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        res.append(a)
    return res + ["--out", out]
