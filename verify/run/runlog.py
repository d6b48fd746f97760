"""The run log: OUT/run.jsonl, one line per judged case, appended as it comes, keyed by its index in
the plan (OUT/plan.json, written before any case). A killed run loses nothing it finished; `run
--resume` judges only the plan's cases the log lacks, and `merge` joins the logs of a plan's shards.

Lines: {"kind": "start", "plan": id, "shard": [I, N], ...}, {"kind": "case", "index": i, "record":
{...}, "verdict": {...} unless it passed}, {"kind": "shrunk", "index": i, "verdict": {...}} (the
smallest failing form of case i). A line torn by a kill is ignored.
"""
from __future__ import annotations

import json
from pathlib import Path

from verify.model.case import Case
from verify.model.verdict import CaseVerdict, Check

LOG_NAME = "run.jsonl"


def case_record(v: CaseVerdict) -> dict:
    """The small per-case summary kept in the certificate: where it ran and how close it came."""
    rec = {"status": v.status, "stage": v.stage, "seconds": round(v.seconds, 4)}
    if v.case:
        c = Case.from_json(v.case)
        rec.update(seed=c.seed, batch=c.batch, config=c.config, dtype=c.dtype, dist=c.dist, tp=c.tp)
    ratios, errs = {}, {}
    for ch in v.checks:      # one compare per output and launch variant: keep the worst of them
        if ch.name.startswith("compare:") and "ratio" in ch.metrics:
            name = ch.name[8:]
            ratios[name] = max(ratios.get(name, 0.0), ch.metrics["ratio"])
            if ch.metrics.get("max_abs") is not None:
                errs[name] = max(errs.get(name) or 0.0, ch.metrics["max_abs"])
    rec["ratio"], rec["max_abs"] = ratios, errs
    bias = {ch.name[5:]: [ch.metrics["rows_above"], ch.metrics["rows_below"], ch.metrics.get("rows", 0),
                          ch.metrics.get("ulps_sum", 0.0)] for ch in v.checks
            if ch.name.startswith("bias:") and "rows_above" in ch.metrics}
    if bias:        # the pair's bias test sums these over its cases (judge/bias.py), from any log
        rec["bias"] = bias
    if v.reason and v.status != "pass":
        rec["reason"] = v.reason[:300]
    return rec


def verdict_from_dict(d: dict) -> CaseVerdict:
    checks = tuple(Check(c["name"], c["ok"], c.get("detail", ""), c.get("metrics", {}),
                         tuple(tuple(w) if isinstance(w, list) else w for w in c.get("worst", ())))
                   for c in d.get("checks", ()))
    return CaseVerdict(d["op"], d["candidate"], d["case"], d["status"], d.get("stage", ""), d.get("reason", ""),
                       checks, d.get("seconds", 0.0))


def case_verdict_from_line(obj: dict) -> CaseVerdict:
    """The CaseVerdict a case line records. A pass keeps only its record: its comparisons come back
    from the record's ratios, which is all an op verdict summarises of a passing case."""
    if obj.get("verdict"):
        return verdict_from_dict(obj["verdict"])
    rec = obj["record"]
    checks = tuple(Check(f"compare:{name}", True, metrics={"ratio": r, "max_abs": rec.get("max_abs", {}).get(name)})
                   for name, r in rec.get("ratio", {}).items())
    checks += tuple(Check(f"bias:{name}", True, metrics={"rows_above": a, "rows_below": b, "rows": n, "ulps_sum": u})
                    for name, (a, b, n, u) in rec.get("bias", {}).items())
    return CaseVerdict(obj["op"], obj["candidate"], obj["case"], rec["status"], rec.get("stage", ""),
                       rec.get("reason", ""), checks, rec.get("seconds", 0.0))


class RunLog:
    def __init__(self, out_dir: Path, resume: bool = False):
        self.path = Path(out_dir) / LOG_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if resume else "w", buffering=1)

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, default=str, separators=(",", ":")) + "\n")
        self._f.flush()

    def start(self, plan_id: str, shard: tuple[int, int], settings: dict) -> None:
        self._write({"kind": "start", "plan": plan_id, "shard": list(shard), **settings})

    def case(self, index: int, v: CaseVerdict) -> None:
        self._write({"kind": "case", "index": index, "op": v.op, "candidate": v.candidate, "case": v.case,
                     "record": case_record(v), "verdict": v.to_dict() if v.status != "pass" else None})

    def shrunk(self, index: int, v: CaseVerdict) -> None:
        self._write({"kind": "shrunk", "index": index, "verdict": v.to_dict()})

    def close(self) -> None:
        self._f.close()


class LogContents:
    """What a run log holds: the plans its runs started on, case verdicts and shrunk forms by index."""

    def __init__(self):
        self.plans: set[str] = set()
        self.verdicts: dict[int, CaseVerdict] = {}
        self.shrunk: dict[int, CaseVerdict] = {}
        self.torn_lines = 0


def read(path: Path) -> LogContents:
    res = LogContents()
    for line in Path(path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            res.torn_lines += 1
            continue
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: a line is {type(obj).__name__}, not a log record; not a run.jsonl "
                             "this harness wrote")
        kind = obj.get("kind")
        if kind == "start":
            res.plans.add(obj.get("plan"))
        elif kind == "case":
            res.verdicts.setdefault(obj["index"], case_verdict_from_line(obj))
        elif kind == "shrunk":
            res.shrunk.setdefault(obj["index"], verdict_from_dict(obj["verdict"]))
    return res
