"""The run log: every case verdict and every op verdict appended to OUT/run.jsonl as it completes.

A killed run loses nothing that finished; `run --resume` reads the log back, skips the op/candidate
pairs that already have an op verdict and hands the case verdicts of a cut pair back to `certify_op`,
which replays them from its memo instead of evaluating them again. Each line is one JSON object with
"kind": "start" | "case" | "op". Case lines carry a compact record (dtype, T, batch, worst err/tol per
output) that the HTML report reads, and the whole verdict unless it passed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LOG_NAME = "run.jsonl"
# start options that decide which cases a pair draws and how they are judged: a resume must match them
RESUME_SETTINGS = ("device", "profile", "configs", "dtypes", "seed", "examples", "tp", "distributed", "sanitize",
                   "harness")    # the judging code's hash: one certificate, one version of the guards


def case_record(v) -> dict:
    """The small per-case summary kept in the certificate: where it ran and how close it came."""
    from verify.case import Case

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
    if bias:        # the pair's bias test sums these over its cases (verify/bias.py), resumed ones too
        rec["bias"] = bias
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
    d["scope"] = tuple(d.get("scope", ()))        # a candidate's declared scope (verify/scope.py)
    return OpVerdict(**d)


def case_verdict_from_line(obj: dict):
    """The CaseVerdict a case line records. A pass keeps only its record: its comparisons come back
    from the record's ratios, which is all an op verdict summarises of a passing case."""
    from verify.verdict import CaseVerdict, Check
    from verify.worker import verdict_from_dict

    if obj.get("verdict"):
        return verdict_from_dict(obj["verdict"])
    rec = obj["record"]
    checks = tuple(Check(f"compare:{name}", True, metrics={"ratio": r, "max_abs": rec.get("max_abs", {}).get(name)})
                   for name, r in rec.get("ratio", {}).items())
    checks += tuple(Check(f"bias:{name}", True, metrics={"rows_above": a, "rows_below": b, "rows": n, "ulps_sum": u})
                    for name, (a, b, n, u) in rec.get("bias", {}).items())
    return CaseVerdict(obj["op"], obj["candidate"], obj["case"], rec["status"], rec.get("stage", ""),
                       rec.get("reason", ""), checks, rec.get("seconds", 0.0))


@dataclass
class Resumed:
    """What a previous (possibly killed) run finished, and what it had judged of the pairs it cut."""
    op_verdicts: dict[tuple[str, str], object] = field(default_factory=dict)    # (op, candidate) -> OpVerdict
    cases: dict[tuple[str, str], list[dict]] = field(default_factory=dict)     # (op, candidate) -> case records
    partial: dict[tuple[str, str], list] = field(default_factory=dict)   # cut pair -> its CaseVerdicts, in order
    options: dict | None = None           # the options of the run that began the log
    torn_lines: int = 0
    repeated_lines: int = 0               # case lines of a case already logged (shards of two deals)


def settings_mismatch(previous: dict | None, options: dict) -> str:
    """'' when a run with `options` may resume a log begun with `previous`, else what differs."""
    if previous is None:
        return ""
    now = json.loads(json.dumps(options, default=str))
    diffs = [f"{k} {_shown(previous[k])} -> {_shown(now.get(k))}" if k in previous else f"{k} not recorded"
             for k in RESUME_SETTINGS if k not in previous or previous[k] != now.get(k)]
    return ", ".join(diffs)


def _shown(value) -> str:
    return "default" if value is None else ",".join(map(str, value)) if isinstance(value, list) else str(value)


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


def _fails(line: dict) -> bool:
    return line["record"]["status"] in ("fail", "xpass")


def read(path: Path) -> Resumed:
    """Read a log; a line torn by a kill (the last one) is counted and ignored. A case logged twice
    (two shards of different deals judged it) counts once, in its first place; where the two verdicts
    differ, the failing one stands."""
    res = Resumed()
    pending: dict[tuple[str, str], dict[str, dict]] = {}     # pair -> case -> its line
    for line in Path(path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            res.torn_lines += 1
            continue
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: a line is {type(obj).__name__}, not a log record; not a run.jsonl "
                             "this harness wrote")
        key = (obj.get("op"), obj.get("candidate"))
        if obj.get("kind") == "start" and res.options is None:
            res.options = obj.get("options")
        elif obj.get("kind") == "case":
            lines = pending.setdefault(key, {})
            seen = lines.get(obj["case"])
            res.repeated_lines += seen is not None
            if seen is None or (_fails(obj) and not _fails(seen)):
                lines[obj["case"]] = obj
        elif obj.get("kind") == "op":
            res.op_verdicts[key] = op_verdict_from_dict(obj["verdict"])
            res.cases[key] = [line["record"] for line in pending.pop(key, {}).values()]
    res.partial = {key: [case_verdict_from_line(line) for line in lines.values()] for key, lines in pending.items()}
    return res
