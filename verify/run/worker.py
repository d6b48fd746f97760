"""Fault isolation: candidates run in a worker subprocess that speaks JSON lines.

Only small records cross the pipe: the parent sends {op, candidate, device, case}; the worker rebuilds
every input from the case record, runs the whole pipeline (verify.judge.pipeline) and answers with the case
verdict. A candidate that raises gives an ordinary failing verdict; one that hangs past the per-case
timeout, exits the process (os._exit, SIGSEGV) or leaves a sticky CUDA error gets a failing verdict
naming that, and the worker is restarted for the next case.

    python -m verify.run.worker            # serve requests on stdin (used by IsolatedRunner)
    python -m verify.run.worker --batch F  # evaluate the JSONL requests in F, verdicts on stdout (sanitizer)
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

CUDA_STICKY = ("cuda error", "illegal memory access", "cudaerror", "device-side assert", "unspecified launch failure",
               "misaligned address", "cuda_error")
READY_TIMEOUT_S = 180.0


def _serve_one(req: dict) -> dict:
    """Evaluate one request inside the worker; never raises."""
    from verify.model.case import Case
    from verify.judge.candidates import Candidate, CandidateUnavailable
    from verify.judge.pipeline import judge_case
    from verify.ops.registry import get_op
    from verify.model.specs import load_spec
    from verify.model.verdict import FAIL, SKIP, CaseVerdict

    case = Case.from_json(req["case"])
    label, device = req["candidate"], req.get("device", "cpu")
    if req.get("threads"):               # the plan's intra-op thread count (CPU BLAS bits depend on it)
        import torch

        torch.set_num_threads(req["threads"])
    try:
        op = get_op(case.op)
        fn = Candidate(label).resolve(op, device)
        v = judge_case(op, case, fn, label, device, load_spec(op.name), req.get("strided_run", True),
                       req.get("warmup", False))
    except CandidateUnavailable as e:
        v = CaseVerdict(case.op, label, req["case"], SKIP, "candidate", str(e))
    except BaseException as e:  # SystemExit from a candidate, or import failures: a verdict, not a dead worker
        v = CaseVerdict(case.op, label, req["case"], FAIL, "candidate",
                        f"{type(e).__name__}: {str(e)[:300]} (raised outside the guarded call)")
    return v.to_dict()


def serve() -> None:
    # Protocol on a private copy of stdout; anything the candidate prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    # Ctrl-C reaches the whole process group: the parent stops the run (its log kept) and kills this
    # worker; here it would end a case as a failing verdict that the log would keep
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401  (warm the import before saying ready)

    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        proto.write(json.dumps({"verdict": _serve_one(req)}, default=str) + "\n")


def batch(path: str) -> None:
    for line in open(path):
        if line.strip():
            print(json.dumps(_serve_one(json.loads(line)), default=str), flush=True)


def _signal_name(rc: int) -> str:
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return name + (" (segmentation fault)" if name == "SIGSEGV" else "")


class _Worker:
    """Runs cases in a worker subprocess; restarts it after a hang, a crash or a sticky CUDA error."""

    def __init__(self, case_timeout: float = 120.0, env: dict | None = None, threads: int = 0):
        self.case_timeout = float(case_timeout)
        self.env, self.threads = env, threads
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self._err = None
        self.restarts = 0

    # -- process management -------------------------------------------------------------------
    def _start(self) -> None:
        self._err = tempfile.TemporaryFile()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", "verify.run.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, env=env)
        self._buf = b""
        msg = self._read_line(READY_TIMEOUT_S)
        if not isinstance(msg, dict) or "ready" not in msg:
            tail = self._stderr_tail()
            self.close()
            raise RuntimeError(f"verify worker did not start: {msg!r}; stderr: {tail}")

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.proc = None

    def _restart(self) -> None:
        self.close()
        self.restarts += 1

    def _stderr_tail(self, n: int = 400) -> str:
        if self._err is None:
            return ""
        self._err.seek(0, 2)
        size = self._err.tell()
        self._err.seek(max(0, size - n))
        text = self._err.read().decode(errors="replace").strip().splitlines()
        return " | ".join(text[-3:])

    def _read_line(self, timeout: float):
        """One JSON message, 'timeout', or 'eof'."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "eof"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    # -- one case -------------------------------------------------------------------------------
    def evaluate(self, op, case, label: str, device: str, strided_run: bool = True, warmup: bool = False):
        from verify.model.verdict import FAIL, CaseVerdict

        op_name = getattr(op, "name", op)
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        t0 = time.perf_counter()
        req = {"op": op_name, "candidate": label, "device": device, "case": case.to_json(),
               "strided_run": strided_run, "warmup": warmup, "threads": self.threads}
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            msg = self._read_line(self.case_timeout)
        except BrokenPipeError:
            msg = "eof"

        def fail(stage, reason):
            return CaseVerdict(op_name, label, case.to_json(), FAIL, stage, reason, (), time.perf_counter() - t0)

        if msg == "timeout":
            self._restart()
            return fail("timeout", f"candidate hung: no result within the per-case timeout of "
                                   f"{self.case_timeout:g} s (--case-timeout); worker killed and restarted")
        if msg == "eof":
            rc = self.proc.wait(timeout=30)
            tail = self._stderr_tail()
            how = f"killed by {_signal_name(rc)}" if rc < 0 else f"exited with status {rc} (os._exit or exit in the candidate?)"
            self._restart()
            return fail("crash", f"worker process {how} while running the candidate; restarted"
                                 + (f"; stderr: {tail}" if tail else ""))
        from verify.run.runlog import verdict_from_dict

        v = verdict_from_dict(msg["verdict"])
        if v.status == FAIL and any(s in v.reason.lower() for s in CUDA_STICKY):
            self._restart()     # a CUDA error poisons the context: later cases need a fresh process
            v = CaseVerdict(v.op, v.candidate, v.case, v.status, v.stage,
                            v.reason + " [CUDA error: worker restarted]", v.checks, v.seconds)
        return v

class IsolatedRunner:
    """One worker subprocess per candidate, so that nothing one candidate does to its process (a kernel
    registered over one of torch's, a changed config) reaches another's reference runs; a worker whose
    candidate changed what cannot be put back is replaced before its next case."""

    def __init__(self, case_timeout: float = 120.0, env: dict | None = None, threads: int = 0):
        self.case_timeout, self.env, self.threads = float(case_timeout), env, threads
        self.workers: dict[str, _Worker] = {}

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers.values())

    def evaluate(self, op, case, label: str, device: str, strided_run: bool = True, warmup: bool = False):
        from verify.judge.process_state import UNDOABLE
        from verify.model.verdict import CaseVerdict

        worker = self.workers.setdefault(label, _Worker(self.case_timeout, self.env, self.threads))
        v = worker.evaluate(op, case, label, device, strided_run, warmup)
        if UNDOABLE in v.reason or any(UNDOABLE in c.detail for c in v.checks):
            worker._restart()
            v = CaseVerdict(v.op, v.candidate, v.case, v.status, v.stage,
                            v.reason + " [process tainted: worker restarted]", v.checks, v.seconds)
        return v

    def close(self) -> None:
        for w in self.workers.values():
            w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--batch"] and len(argv) == 2:
        batch(argv[1])
        return 0
    if argv:
        print("usage: python -m verify.run.worker [--batch REQUESTS.jsonl]", file=sys.stderr)
        return 2
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
