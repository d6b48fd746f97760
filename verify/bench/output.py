"""bench.json (the record: environment, command, gate, rows, scores) and the terminal table."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

FORMAT = "verify-kernels/bench/v1"
FILE = "bench.json"


def record(env: dict, argv: list[str], options: dict, gate, result: dict, scores: dict) -> dict:
    return {"format": FORMAT, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": env, "command": "verify-kernels " + " ".join(argv), "options": options,
            "certificate": gate.certificate, "refused": gate.refused, "absent": gate.absent,
            "rows": result["rows"], "not_reached": result["not_reached"], "notes": result["notes"],
            "scores": scores}


def write(rec: dict, out_dir: str | Path) -> Path:
    p = Path(out_dir) / FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, default=str))
    tmp.replace(p)
    return p


def load(path: str | Path) -> dict:
    p = Path(path)
    try:
        rec = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"bench record {p}: cannot read it: {e}") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ValueError(f"bench record {p}: format {rec.get('format') if isinstance(rec, dict) else None!r} "
                         f"is not {FORMAT!r}")
    if not isinstance(rec.get("rows"), list):
        raise ValueError(f"bench record {p}: 'rows' must be a list")
    return rec


def is_bench(path: str | Path) -> bool:
    """True when the file is a bench record (by its format field), so `diff` can tell it from a certificate."""
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _us(t: dict | None) -> str:
    if not t or t.get("median_us") is None:
        return "-"
    return f"{t['median_us']:.2f}" + ("*" if t.get("method") == "stream" else "")


def _speedups(sp: dict) -> str:
    """How many times faster than eager / compiled / the best (fastest) peer (> 1: faster)."""
    peers = [v for k, v in sp.items() if k.startswith("peer:")]
    cells = [sp.get("eager"), sp.get("compiled"), min(peers) if peers else None]
    return "/".join("-" if v is None else f"{v:.2f}" for v in cells)


def tables(rec: dict):
    """One rich Table per op: us per entry (median; * = not capturable, timed from Python), the
    floor, and each candidate's floor ratio and verdict."""
    from rich.table import Table

    out = []
    for op in dict.fromkeys(r["op"] for r in rec["rows"]):
        rows = [r for r in rec["rows"] if r["op"] == op]
        names = list(dict.fromkeys(k for r in rows for k in r["timings"] if k != "floor"))
        cands = list(dict.fromkeys(c for r in rows for c in r["judged"]))
        t = Table(title=f"{op}: us per call (median of CUDA-graph replays)", title_justify="left")
        t.add_column("shape")
        t.add_column("MB", justify="right")
        t.add_column("floor", justify="right")
        for n in names:
            t.add_column(n.replace("peer:", ""), justify="right")
        for c in cands:
            t.add_column(f"{c}/floor", justify="right")
            t.add_column(f"{c} x eager/compiled/peer", justify="right")
            t.add_column(f"{c} rule")
        for r in rows:
            cells = [r["shape"], "-" if not r.get("bytes") else f"{r['bytes'] / 1e6:.3g}", _us(r["timings"].get("floor"))]
            cells += [_us(r["timings"].get(n)) for n in names]
            for c in cands:
                j = r["judged"].get(c)
                if j is None:
                    cells += ["-", "-", "[yellow]not timed[/]" if c in r["candidates"] else "-"]
                    continue
                ratio = "-" if j["floor_ratio"] is None else f"{j['floor_ratio']:.2f}x"
                color = {"met": "green", "miss": "bold red"}.get(j["verdict"], "yellow")
                cells += [ratio, _speedups(j["speedup"]), f"[{color}]{j['verdict']}[/]"]
            t.add_row(*cells)
        out.append(t)
    return out


def print_report(console, rec: dict, out_path) -> None:
    """Tables, then what went wrong (errors, refusals, budget), then the scores; one line per item."""
    for t in tables(rec):
        console.print(t)
    errors: dict[tuple, list[str]] = {}
    for r in rec["rows"]:
        for name, err in r.get("errors", {}).items():
            errors.setdefault((r["op"], name, err), []).append(r["shape"])
    for r in rec["rows"]:
        for name, note in r.get("peer_checks", {}).items():
            if not note.startswith("ok"):
                errors.setdefault((r["op"], name, "against the reference: " + note), []).append(r["shape"])
    for (op, name, err), where in errors.items():
        shown = where[0] if len(where) == 1 else f"{len(where)} shapes"
        console.print(f"[yellow]{op} {name} ({shown}): {err}[/]")
    for r in rec["rows"]:
        for c, j in r["judged"].items():
            if j["verdict"] == "miss":
                console.print(f"miss {r['op']} {r['shape']} {c}: " + "; ".join(j["misses"]))
    for x in rec["refused"]:
        console.print(f"[bold red]refused[/] {x['op']} / {x['candidate']}: {x['state']}: {x['reason']}")
    for x in rec["absent"]:
        console.print(f"not run {x['op']} / {x['candidate']}: {x['reason']}")
    if rec["not_reached"]:
        console.print(f"[yellow]time budget: {len(rec['not_reached'])} shapes not reached[/]")
    for c, s in rec["scores"].items():
        eager = ", ".join(f">= {p}x {'-' if v is None else f'{v:.0%}'}" for p, v in s["vs_eager"].items())
        peer = ", ".join(f">= {p}x {'-' if v is None else f'{v:.0%}'}" for p, v in s["vs_best_peer"].items())
        console.print(f"score {c}: {s['rule_met']} of {s['shapes']} shapes meet the rule; certified and faster than "
                      f"eager {eager}; than the best peer ({s['peer_shapes']} shapes) {peer}")
    console.print(f"bench record: {out_path}")
