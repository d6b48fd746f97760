"""One self-contained HTML page from a certificate: verdicts, a pass/fail matrix op x dtype x T, and
matplotlib plots embedded as base64 PNG (error per op against its tolerance, error against batch and T).

Reads only the certificate (per-case records: dtype, T, batch, worst err/tol per output). matplotlib
is imported here, never at CLI start-up.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates"


def _rows(cert: dict) -> list[dict]:
    rows = []
    for op, e in sorted(cert.get("ops", {}).items()):
        for cand, v in sorted(e.get("verdicts", {}).items()):
            worst = max((v.get("worst_ratio") or {}).values(), default=None)
            rows.append({"op": op, "candidate": cand, "status": v["status"], "carried": "carried_from" in v,
                         "cases": f"{v.get('cases_passed', 0)}/{v.get('cases_run', 0)}",
                         "worst": "" if worst is None else f"{worst:.3g}", "reason": v.get("reason", ""),
                         "repro": v.get("repro", "")})
    return rows


def _records(cert: dict):
    for op, e in sorted(cert.get("ops", {}).items()):
        for cand, recs in sorted(e.get("cases", {}).items()):
            for r in recs:
                yield op, cand, r


def _matrix(cert: dict) -> dict:
    cells: dict[tuple[str, str], dict] = {}
    cols = set()
    for op, cand, r in _records(cert):
        if r.get("status") in ("vacuous", "skip") or "dtype" not in r:
            continue
        col = f"{r['dtype']} T={r.get('tp', 1)}"
        cols.add(col)
        c = cells.setdefault((f"{op} / {cand}", col), {"run": 0, "ok": 0, "worst": 0.0})
        c["run"] += 1
        c["ok"] += r["status"] == "pass"
        c["worst"] = max([c["worst"], *[x for x in r.get("ratio", {}).values() if x is not None]])
    order = sorted(cols, key=lambda s: (s.split()[0], int(s.split("=")[1])))
    names = sorted({k[0] for k in cells})
    rows = []
    for name in names:
        row = []
        for col in order:
            c = cells.get((name, col))
            if c is None:
                row.append({"cls": "none", "text": "-"})
            else:
                w = f" [{c['worst']:.2g}]" if c["worst"] else ""
                row.append({"cls": "pass" if c["ok"] == c["run"] else "fail", "text": f"{c['ok']}/{c['run']}{w}"})
        rows.append((name, row))
    return {"cols": order, "rows": rows}


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plots(cert: dict) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[float]] = {}
    by_batch: dict[str, list[tuple[int, float]]] = {}
    by_tp: dict[str, list[tuple[int, float]]] = {}
    for op, cand, r in _records(cert):
        for out, ratio in (r.get("ratio") or {}).items():
            if ratio is None:
                continue
            key = f"{op}.{out}"
            series.setdefault(key, []).append(max(ratio, 1e-6))
            by_batch.setdefault(op, []).append((r.get("batch", 0), max(ratio, 1e-6)))
            by_tp.setdefault(op, []).append((r.get("tp", 1), max(ratio, 1e-6)))
    if not series:
        return []
    plots = []
    keys = sorted(series)
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.28 * len(keys) + 1)))
    ax.boxplot([series[k] for k in keys], orientation="horizontal", whis=(0, 100), widths=0.6)
    for i, k in enumerate(keys, start=1):
        ax.scatter(series[k], [i] * len(series[k]), s=8, alpha=0.5, color="#0969da")
    ax.set_yticks(range(1, len(keys) + 1), keys, fontsize=8)
    ax.set_xscale("log")
    ax.axvline(1.0, color="#cf222e", lw=1.5, label="tolerance (err/tol = 1)")
    ax.set_xlabel("per-case worst error / tolerance (k x baseline error + floor); right of the red line fails")
    ax.legend(loc="lower right", fontsize=8)
    plots.append(("Error distribution per output against its tolerance", _png(fig)))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, data, xlabel in ((axes[0], by_batch, "batch B (tokens)"), (axes[1], by_tp, "tensor-parallel degree T")):
        for op in sorted(data):
            xs, ys = zip(*data[op])
            jitter = [x * (1 + 0.04 * ((hash(op) % 7) - 3)) for x in xs]
            ax.scatter(jitter, ys, s=12, alpha=0.7, label=op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="#cf222e", lw=1.2)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel("worst error / tolerance")
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    plots.append(("Error against batch size and T", _png(fig)))
    return plots


def render(cert: dict, sections: list[str] = ()) -> str:
    """The page; `sections`: HTML blocks appended after the certificate's own (the bench section)."""
    import jinja2

    env_j = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True)
    rows = _rows(cert)
    totals = {"pairs": len(rows), "pass": sum(r["status"] == "pass" for r in rows),
              "fail": sum(r["status"] in ("fail", "unexpected_pass") for r in rows),
              "skip": sum(r["status"] == "skip" for r in rows), "carried": sum(r["carried"] for r in rows)}
    waivers = [dict(w, op=op) for op, e in sorted(cert.get("ops", {}).items()) for w in e.get("waivers", [])]
    launches = [dict(c, op=op, candidate=cand) for op, e in sorted(cert.get("ops", {}).items())
                for cand, c in sorted(e.get("launches", {}).items())]
    sources = [(op, e.get("sources", {})) for op, e in sorted(cert.get("ops", {}).items())]
    env = sorted((k, v) for k, v in cert.get("environment", {}).items() if v not in (None, ""))
    return env_j.get_template("report.html.j2").render(cert=cert, rows=rows, totals=totals, matrix=_matrix(cert),
                                                         plots=_plots(cert), waivers=waivers, sources=sources, env=env,
                                                         launches=launches,
                                                         sections=list(sections))


def write_report(cert: dict, path: str | Path, sections: list[str] = ()) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render(cert, sections))
    return p
