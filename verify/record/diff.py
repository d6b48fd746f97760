"""Compare two certificates: new failures, fixed ops, error growth (worst err/tol ratio) per op, and
the judged code that changed between them (source hashes; the files, where both keep per-file hashes).

    verify-kernels diff OLD.json NEW.json [--json]      exit 1 when NEW has a failure OLD did not
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

BAD = ("fail", "unexpected_pass")
GROWTH = 1.25          # report an output whose worst err/tol grew by more than this factor


@dataclass
class Change:
    op: str
    candidate: str
    kind: str            # new_failure | fixed | error_growth | error_shrink | added | removed | status | sources
    old: str = ""
    new: str = ""
    detail: str = ""


@dataclass
class CertDiff:
    changes: list[Change] = field(default_factory=list)
    ratios: dict[str, dict] = field(default_factory=dict)      # "op/candidate" -> {output: [old, new]}

    def of(self, kind: str) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]

    def to_dict(self) -> dict:
        return {"changes": [asdict(c) for c in self.changes], "ratios": self.ratios}


def _worst(v: dict | None) -> dict[str, float]:
    return dict((v or {}).get("worst_ratio") or {})


def diff(old: dict, new: dict) -> CertDiff:
    from verify.record.certificate import op_verdicts

    a, b = op_verdicts(old), op_verdicts(new)
    out = CertDiff()
    for key in sorted(set(a) | set(b)):
        op, cand = key
        va, vb = a.get(key), b.get(key)
        if va is None:
            out.changes.append(Change(op, cand, "new_failure" if vb["status"] in BAD else "added", "", vb["status"],
                                      vb.get("reason", "")))
            continue
        if vb is None:
            out.changes.append(Change(op, cand, "removed", va["status"], ""))
            continue
        sa, sb = va["status"], vb["status"]
        if sb in BAD and sa not in BAD:
            out.changes.append(Change(op, cand, "new_failure", sa, sb, vb.get("reason", "")))
        elif sa in BAD and sb == "skip":      # not run is not fixed: the failure is simply unknown now
            out.changes.append(Change(op, cand, "status", sa, sb, "failed before, not run now: " + vb.get("reason", "")))
        elif sa in BAD and sb not in BAD:
            out.changes.append(Change(op, cand, "fixed", sa, sb))
        elif sa != sb:
            out.changes.append(Change(op, cand, "status", sa, sb, vb.get("reason", "")))
        wa, wb = _worst(va), _worst(vb)
        ratios = {o: [wa.get(o), wb.get(o)] for o in sorted(set(wa) | set(wb))}
        if ratios:
            out.ratios[f"{op}/{cand}"] = ratios
        for o, (ra, rb) in ratios.items():
            if ra and rb and rb > ra * GROWTH:
                out.changes.append(Change(op, cand, "error_growth", f"{ra:.3g}", f"{rb:.3g}",
                                          f"{o}: worst err/tol {ra:.3g} -> {rb:.3g} (x{rb / ra:.2f})"))
            elif ra and rb and ra > rb * GROWTH:
                out.changes.append(Change(op, cand, "error_shrink", f"{ra:.3g}", f"{rb:.3g}",
                                          f"{o}: worst err/tol {ra:.3g} -> {rb:.3g}"))
    for op in sorted(set(old.get("ops", {})) & set(new.get("ops", {}))):
        change = _sources_change(op, old["ops"][op], new["ops"][op])
        if change:
            out.changes.append(change)
    return out


def _sources_change(op: str, ea: dict, eb: dict) -> Change | None:
    """The source groups (reference, fused, spec, registry, harness) whose hashes differ between two
    entries of one op, with the files behind them where both entries keep per-file hashes ('+' a
    file only NEW depends on, '-' one only OLD did)."""
    from verify.record.certificate import source_change

    text = source_change(ea.get("sources") or {}, eb.get("sources") or {}, ea.get("source_files"),
                         eb.get("source_files"))
    return Change(op, "*", "sources", detail="changed: " + text) if text else None


def render_text(d: CertDiff) -> str:
    titles = {"new_failure": "NEW FAILURES", "fixed": "fixed", "error_growth": "error growth (worst err/tol)",
              "error_shrink": "error shrink", "status": "status changes", "added": "added", "removed": "removed",
              "sources": "judged code changed"}
    lines = []
    for kind, title in titles.items():
        rows = d.of(kind)
        if rows:
            lines.append(f"{title} ({len(rows)}):")
            for c in rows:
                if kind == "sources":                  # per op, not per candidate: no old -> new status
                    lines.append(f"  {c.op}: {c.detail}")
                    continue
                lines.append(f"  {c.op} [{c.candidate}]: {c.old or '-'} -> {c.new or '-'}"
                             + (f"  {c.detail}" if c.detail else ""))
    return "\n".join(lines) if lines else "no changes in verdicts or worst err/tol"
