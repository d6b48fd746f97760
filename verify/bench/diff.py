"""Speed changes between two bench records: per (op, shape, entry) timed in both, a regression when
the new median is more than THRESHOLD slower and the new p10 is above the old p90 (outside both runs'
spread), an improvement the other way round; and every row whose rule verdict changed."""
from __future__ import annotations

from dataclasses import asdict, dataclass

THRESHOLD = 0.05


@dataclass(frozen=True)
class SpeedChange:
    op: str
    shape: str
    entry: str
    kind: str              # regression | improvement | verdict
    old: str
    new: str
    detail: str = ""


def _timings(rec: dict) -> dict[tuple[str, str, str], dict]:
    return {(r["op"], r["shape"], name): t for r in rec.get("rows", []) for name, t in r.get("timings", {}).items()
            if t and t.get("median_us") is not None}


def _verdicts(rec: dict) -> dict[tuple[str, str, str], str]:
    return {(r["op"], r["shape"], c): j["verdict"] for r in rec.get("rows", []) for c, j in r.get("judged", {}).items()}


def speed_diff(old: dict, new: dict, threshold: float = THRESHOLD) -> list[SpeedChange]:
    a, b = _timings(old), _timings(new)
    out = []
    for key in sorted(set(a) & set(b)):
        ta, tb = a[key], b[key]
        ma, mb = ta["median_us"], tb["median_us"]
        detail = f"{ma:.2f} -> {mb:.2f} us ({mb / ma:.2f}x)"
        if mb > ma * (1 + threshold) and tb["p10_us"] > ta["p90_us"]:
            out.append(SpeedChange(*key, "regression", f"{ma:.2f}", f"{mb:.2f}", detail))
        elif ma > mb * (1 + threshold) and ta["p10_us"] > tb["p90_us"]:
            out.append(SpeedChange(*key, "improvement", f"{ma:.2f}", f"{mb:.2f}", detail))
    va, vb = _verdicts(old), _verdicts(new)
    for key in sorted(set(va) & set(vb)):
        if va[key] != vb[key]:
            out.append(SpeedChange(*key, "verdict", va[key], vb[key], "speed rule"))
    return out


def regressions(changes: list[SpeedChange], entries: set[str] | None = None) -> list[SpeedChange]:
    """Regressions of the candidates (entries), or of everything timed when entries is None."""
    return [c for c in changes if c.kind == "regression" and (entries is None or c.entry in entries)]


def candidates_of(rec: dict) -> set[str]:
    return {c for r in rec.get("rows", []) for c in r.get("candidates", [])}


def render_text(changes: list[SpeedChange]) -> str:
    titles = {"regression": "SPEED REGRESSIONS", "verdict": "speed rule verdict changes", "improvement": "speed-ups"}
    lines = []
    for kind, title in titles.items():
        rows = [c for c in changes if c.kind == kind]
        if rows:
            lines.append(f"{title} ({len(rows)}):")
            lines += [f"  {c.op} {c.shape} [{c.entry}]: " + (c.detail if kind != "verdict" else f"{c.old} -> {c.new}")
                      for c in rows]
    return "\n".join(lines) if lines else "no speed changes beyond the runs' spread"


def to_dict(changes: list[SpeedChange]) -> list[dict]:
    return [asdict(c) for c in changes]
