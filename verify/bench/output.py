"""bench.json (the record: environment, command, gate, rows, scores) and the terminal table."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from verify.record.files import read_text

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
        rec = json.loads(read_text(p))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
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
        return json.loads(read_text(path)).get("format") == FORMAT
    except (OSError, EOFError, ValueError, AttributeError):
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


def launch_cell(count: dict | None) -> str:
    """Kernel launches per call: the count ("*": from the profiler, the call was not capturable),
    "error" where it could not be counted, "-" where not counted."""
    if not count:
        return "-"
    if count.get("kernels") is None:
        return "error"
    return f"{count['kernels']}" + ("*" if count.get("method") == "profiler_kernels" else "")


def is_step_table(rows: list[dict]) -> bool:
    """Rows of one decode step per call (a layer op benched at knob steps=1)."""
    return bool(rows) and all(r.get("knobs", {}).get("steps") == 1 for r in rows)


def unit(rec: dict, op: str) -> str:
    rows = [r for r in rec["rows"] if r["op"] == op]
    if is_step_table(rows):
        return ("us per layer step (one decode step per call, knob steps=1); floor: a device copy of the step's "
                "weight and state bytes (the roofline)")
    return "us per call"


def count_errors(rec: dict) -> dict[tuple, list[str]]:
    """(op, "ENTRY launches", error) -> the shapes where the entry's launches could not be counted."""
    out: dict[tuple, list[str]] = {}
    for r in rec["rows"]:
        for name, count in r.get("launches", {}).items():
            if count.get("error"):
                out.setdefault((r["op"], f"{name} launches", count["error"]), []).append(r["shape"])
    return out


def op_table(rec: dict, op: str) -> tuple[list[str], list[list[str]]]:
    """One op's table, shared by the terminal and markdown forms: the header and the rows' cells (a
    candidate's "rule" column holds its verdict, "not timed" or "-"); where the rows count launches,
    a "launches" column per entry after the times."""
    rows = [r for r in rec["rows"] if r["op"] == op]
    names = list(dict.fromkeys(k for r in rows for k in r["timings"] if k != "floor"))
    cands = list(dict.fromkeys(c for r in rows for c in r["judged"]))
    counted = [n for n in names if any(n in r.get("launches", {}) for r in rows)]
    head = ["shape", "MB", "floor"] + [n.replace("peer:", "") for n in names]
    head += [f"{n.replace('peer:', '')} launches" for n in counted]
    for c in cands:
        head += [f"{c} / floor", f"{c} x eager/compiled/peer", f"{c} rule"]
    body = []
    for r in rows:
        cells = [r["shape"], "-" if not r.get("bytes") else f"{r['bytes'] / 1e6:.3g}", _us(r["timings"].get("floor"))]
        cells += [_us(r["timings"].get(n)) for n in names]
        cells += [launch_cell(r.get("launches", {}).get(n)) for n in counted]
        for c in cands:
            j = r["judged"].get(c)
            if j is None:
                cells += ["-", "-", "not timed" if c in r["candidates"] else "-"]
                continue
            cells += ["-" if j["floor_ratio"] is None else f"{j['floor_ratio']:.2f}x", _speedups(j["speedup"]),
                      j["verdict"]]
        body.append(cells)
    return head, body


def tables(rec: dict):
    """One rich Table per op: us per entry (median; * = not capturable, timed from Python), the
    floor, and each candidate's floor ratio and verdict."""
    from rich.table import Table

    colors = {"met": "green", "miss": "bold red", "-": ""}
    out = []
    for op in dict.fromkeys(r["op"] for r in rec["rows"]):
        head, body = op_table(rec, op)
        t = Table(title=f"{op}: {unit(rec, op)} (median of CUDA-graph replays)", title_justify="left")
        rule = [k for k, name in enumerate(head) if name.endswith(" rule")]
        for k, name in enumerate(head):
            t.add_column(name, justify="left" if k == 0 or k in rule else "right")
        for cells in body:
            for k in rule:
                color = colors.get(cells[k], "yellow")
                cells[k] = f"[{color}]{cells[k]}[/]" if color else cells[k]
            t.add_row(*cells)
        out.append(t)
    return out


def not_reached_by_reason(rec: dict) -> dict[str, list[str]]:
    """reason (time budget, pending, interrupted ...) -> "op T=.. B=.. knobs" of each shape not timed."""
    out: dict[str, list[str]] = {}
    for d in rec.get("not_reached", []):
        knobs = " ".join(f"{k}={v}" for k, v in sorted(d.get("knobs", {}).items()))
        label = " ".join(x for x in (d.get("op", "?"), f"T={d.get('tp')}", f"B={d.get('batch')}", knobs) if x)
        out.setdefault(d.get("reason", "time budget"), []).append(label)
    return out


SLOWER_PICK = 1.05       # a dispatcher's pick this much slower than the fastest declared variant is listed


def variant_rows(rec: dict) -> list[tuple[str, str, str, dict]]:
    """(op, shape, candidate, summary) of every row timed with --variants (run.fastest_variants)."""
    return [(r["op"], r["shape"], c, v) for r in rec["rows"] for c, v in r.get("variants", {}).items()]


def _variant_cells(v: dict) -> tuple[str, str]:
    """(the dispatcher's us, its ratio to the fastest variant), "-" where not timed."""
    return ("-" if v["dispatcher_us"] is None else f"{v['dispatcher_us']:.2f}",
            "-" if v["dispatcher_over_fastest"] is None else f"{v['dispatcher_over_fastest']:.2f}x")


def _variant_line(op, shape, c, v) -> str:
    pick, ratio = _variant_cells(v)
    return (f"{op} {shape} {c}: dispatcher {pick} us, fastest of {v['timed']} variants {v['fastest']} "
            f"{v['fastest_us']:.2f} us" + ("" if ratio == "-" else f" ({ratio})"))


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
    for key, where in count_errors(rec).items():
        errors.setdefault(key, []).extend(where)
    for (op, name, err), where in errors.items():
        shown = where[0] if len(where) == 1 else f"{len(where)} shapes"
        console.print(f"[yellow]{op} {name} ({shown}): {err}[/]")
    for r in rec["rows"]:
        for c, j in r["judged"].items():
            if j["verdict"] == "miss":
                console.print(f"miss {r['op']} {r['shape']} {c}: " + "; ".join(j["misses"]))
    vrows = variant_rows(rec)
    slow = [x for x in vrows if (x[3]["dispatcher_over_fastest"] or 0) > SLOWER_PICK]
    for x in slow:
        console.print("variant " + _variant_line(*x))
    if vrows:
        console.print(f"variants: at {len(vrows) - len(slow)} of {len(vrows)} shapes the dispatcher's pick is within "
                      f"{SLOWER_PICK:g}x of the fastest declared variant")
    for x in rec["refused"]:
        console.print(f"[bold red]refused[/] {x['op']} / {x['candidate']}: {x['state']}: {x['reason']}")
    for x in rec["absent"]:
        console.print(f"not run {x['op']} / {x['candidate']}: {x['reason']}")
    for reason, shapes in not_reached_by_reason(rec).items():
        console.print(f"[yellow]not timed, {reason}: {len(shapes)} shapes: {'; '.join(shapes)}[/]")
    for op, lines in rec.get("notes", {}).items():
        for line in lines:
            console.print(f"[yellow]{line}[/]" if op == "run" else f"note {op}: {line}")
    for c, s in rec["scores"].items():
        eager = ", ".join(f">= {p}x {'-' if v is None else f'{v:.0%}'}" for p, v in s["vs_eager"].items())
        peer = ", ".join(f">= {p}x {'-' if v is None else f'{v:.0%}'}" for p, v in s["vs_best_peer"].items())
        console.print(f"score {c}: {s['rule_met']} of {s['shapes']} shapes meet the rule; certified and faster than "
                      f"eager {eager}; than the best peer ({s['peer_shapes']} shapes) {peer}")
    console.print(f"bench record: {out_path}")


def markdown(rec: dict) -> str:
    """The record as markdown for results/: where and how it was measured, one table per op (us per
    entry, each candidate's floor ratio, speedups and verdict), the misses, what was not timed, the
    scores."""
    env = rec.get("environment", {})
    libs = [f"CuTe DSL {env.get('cutlass_dsl') or '-'}", f"triton {env.get('triton') or '-'}",
            f"fla-core {env.get('fla_core') or 'not installed'}"]
    libs += [f"{name} {env[key][:width]}" for key, name, width in
             (("flashmla", "FlashMLA", 12), ("flashinfer_mla", "FlashInfer", 18)) if env.get(key)]
    lines = [f"## Speed: verify-kernels bench ({(rec.get('created') or '?')[:10]})", "",
             f"Measured {rec.get('created', '?')} on {env.get('gpu') or env.get('device', '?')} "
             f"(driver {env.get('driver') or '-'}, CUDA {env.get('cuda') or '-'}, torch {env.get('torch', '-')}, "
             f"{', '.join(libs)}); commit `{(env.get('git_commit') or '-')[:12]}`"
             + (" (dirty tree)" if env.get("git_dirty") else "") + ".",
             "", f"Command: `{rec.get('command', '')}`", "",
             "Times: us per call, median of CUDA-graph replays (`*`: not capturable, launched from Python); "
             "x eager / compiled / peer: how many times faster the candidate is (> 1 is faster); launches: "
             "kernel launches per call (CUDA graph nodes; `*`: the profiler's kernels of one eager call).", ""]
    for op in dict.fromkeys(r["op"] for r in rec["rows"]):
        head, body = op_table(rec, op)
        step = is_step_table([r for r in rec["rows"] if r["op"] == op])
        lines += [f"### {op}", ""] + ([f"Times: {unit(rec, op)}.", ""] if step else [])
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        lines.append("")
    vrows = variant_rows(rec)
    if vrows:
        lines += ["Launch variants (`--variants`): the dispatcher's pick against the fastest variant the module "
                  "declares at each shape.", "", "| op | shape | candidate | dispatcher us | fastest variant | us | "
                  "dispatcher / fastest |", "|---|---|---|---|---|---|---|"]
        lines += ["| {} | {} | {} | {} | {} | {:.2f} | {} |".format(op, shape, c, _variant_cells(v)[0], v["fastest"],
                                                                  v["fastest_us"], _variant_cells(v)[1])
                  for op, shape, c, v in vrows]
        lines.append("")
    misses = [f"- {r['op']} {r['shape']} {c}: " + "; ".join(j["misses"])
              for r in rec["rows"] for c, j in r["judged"].items() if j["verdict"] == "miss"]
    if misses:
        lines += ["Misses of the speed rule:", ""] + misses + [""]
    errors: dict[tuple, list[str]] = {}
    for r in rec["rows"]:
        for name, err in r.get("errors", {}).items():
            errors.setdefault((r["op"], name, err), []).append(r["shape"])
    for title, found in (("Entries not timed:", errors), ("Launches not counted:", count_errors(rec))):
        if found:
            lines += [title, ""] + [
                f"- {op} {name} ({where[0] if len(where) == 1 else f'{len(where)} shapes'}): {err}"
                for (op, name, err), where in found.items()] + [""]
    for reason, shapes in not_reached_by_reason(rec).items():
        lines += [f"Shapes not timed, {reason} ({len(shapes)}): " + "; ".join(shapes), ""]
    notes = [f"- {op}: {line}" if op != "run" else f"- {line}"
             for op, ls in rec.get("notes", {}).items() for line in ls]
    if notes:
        lines += ["Notes:", ""] + notes + [""]
    for x in rec.get("refused", []):
        lines += [f"Refused {x['op']} / {x['candidate']}: {x['state']}: {x['reason']}", ""]
    for c, s in rec.get("scores", {}).items():
        eager = ", ".join(f">= {p}x {'-' if v is None else f'{v:.0%}'}" for p, v in s["vs_eager"].items())
        peer = ", ".join(f">= {p}x {'-' if v is None else f'{v:.0%}'}" for p, v in s["vs_best_peer"].items())
        lines += [f"Score {c}: {s['rule_met']} of {s['shapes']} shapes meet the rule; certified and faster than eager "
                  f"{eager}; than the best peer ({s['peer_shapes']} shapes) {peer}.", ""]
    return "\n".join(lines)
