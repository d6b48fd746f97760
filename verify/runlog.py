"""The run log: every case verdict and every op verdict appended to OUT/run.jsonl as it completes.

A killed run loses nothing that finished; `run --resume` reads the log back and skips the op/candidate
pairs that already have an op verdict. Each line is one JSON object with "kind": "start" | "case" | "op".
Case lines carry a compact record (dtype, T, batch, worst err/tol per output) that the HTML report reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LOG_NAME = "run.jsonl"


def case_record(v) -> dict:
    """The small per-case summary kept in the certificate: where it ran and how close it came."""
    from verify.case import Case

    rec = {"status": v.status, "stage": v.stage, "seconds": round(v.seconds, 4)}
    if v.case:
        c = Case.from_json(v.case)
        rec.update(seed=c.seed, batch=c.batch, config=c.config, dtype=c.dtype, dist=c.dist, tp=c.tp)
    ratios, errs = {}, {}
    for ch in v.checks:
        if ch.name.startswith("compare:") and "ratio" in ch.metrics:
            ratios[ch.name[8:]] = ch.metrics["ratio"]
            errs[ch.name[8:]] = ch.metrics.get("max_abs")
    rec["ratio"], rec["max_abs"] = ratios, errs
    if v.reason and v.status != "pass":
        rec["reason"] = v.reason[:300]
    return rec


def op_verdict_from_dict(d: dict):
    from verify.verdict import OpVerdict
    from verify.worker import verdict_from_dict

    d = dict(d)
    d.pop("carried_from", None)
    if d.get("failure"):
        d["failure"] = verdict_from_dict(d["failure"])
    d["details"] = tuple(d.get("details", ()))
    return OpVerdict(**d)


@dataclass
class Resumed:
    """What a previous (possibly killed) run finished."""
    op_verdicts: dict[tuple[str, str], object] = field(default_factory=dict)    # (op, candidate) -> OpVerdict
    cases: dict[tuple[str, str], list[dict]] = field(default_factory=dict)     # (op, candidate) -> case records
    torn_lines: int = 0


class RunLog:
    def __init__(self, out_dir: Path, resume: bool = False):
        self.path = Path(out_dir) / LOG_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.previous = read(self.path) if resume and self.path.exists() else Resumed()
        self._f = open(self.path, "a" if resume else "w", buffering=1)

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, default=str, separators=(",", ":")) + "\n")
        self._f.flush()

    def start(self, options: dict) -> None:
        self._write({"kind": "start", "options": options})

    def case(self, v) -> None:
        self._write({"kind": "case", "op": v.op, "candidate": v.candidate, "case": v.case,
                     "record": case_record(v), "verdict": v.to_dict() if v.status != "pass" else None})

    def op(self, v) -> None:
        self._write({"kind": "op", "op": v.op, "candidate": v.candidate, "verdict": v.to_dict()})

    def close(self) -> None:
        self._f.close()


def read(path: Path) -> Resumed:
    """Read a log; a line torn by a kill (the last one) is counted and ignored."""
    res = Resumed()
    pending: dict[tuple[str, str], list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            res.torn_lines += 1
            continue
        key = (obj.get("op"), obj.get("candidate"))
        if obj.get("kind") == "case":
            pending.setdefault(key, []).append(obj["record"])
        elif obj.get("kind") == "op":
            res.op_verdicts[key] = op_verdict_from_dict(obj["verdict"])
            res.cases[key] = pending.pop(key, [])
    return res
