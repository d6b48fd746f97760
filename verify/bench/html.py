"""The bench section of the HTML report: per op, us against batch for every timed entry, one panel
per (knob set, T), the floor drawn as a dashed line; then the rule's verdicts and the scores.
matplotlib and jinja2 are imported here, never at CLI start-up."""
from __future__ import annotations

import base64
import io

_SECTION = """
<h2>Speed (verify-kernels bench)</h2>
<p class="mono">{{ rec.command }} &mdash; {{ rec.created }} &mdash; {{ rec.environment.get("gpu", rec.environment.get("device")) }}
&mdash; commit {{ (rec.environment.get("git_commit") or "-")[:12] }}</p>
<p>Rule per row: faster than eager, torch.compile and every declared peer; &lt;= 1.25 x the floor (a device copy of
the op's bytes) where the floor is 10 us or more, &lt;= 2 x below.</p>
<table><tr><th>candidate</th><th>shapes</th><th>rule met</th><th>certified, &gt;= 1 / 1.5 / 2 x eager</th>
<th>&gt;= 1 / 1.5 / 2 x best peer</th></tr>
{% for c, s in rec.scores.items() %}<tr><td>{{ c }}</td><td>{{ s.shapes }}</td><td>{{ s.rule_met }}</td>
<td>{{ pct(s.vs_eager) }}</td><td>{{ pct(s.vs_best_peer) }} ({{ s.peer_shapes }} shapes)</td></tr>{% endfor %}</table>
{% if rec.refused %}<h3>Refused (no passing verdict)</h3><table>{% for x in rec.refused %}<tr><td>{{ x.op }}</td>
<td>{{ x.candidate }}</td><td>{{ x.state }}</td><td class="mono">{{ x.reason }}</td></tr>{% endfor %}</table>{% endif %}
{% for reason, shapes in not_reached.items() %}<h3>Not timed, {{ reason }}: {{ shapes|length }} shapes</h3>
<p class="mono">{{ "; ".join(shapes) }}</p>{% endfor %}
{% for title, img in plots %}<h3>{{ title }}</h3><img alt="{{ title }}" src="data:image/png;base64,{{ img }}">{% endfor %}
<h3>Rows</h3><table><tr><th>op</th><th>shape</th><th>floor us</th><th>candidate</th><th>us</th><th>launches</th><th>x floor</th>
<th>verdict</th><th>misses</th></tr>
{% for r in rec.rows %}{% for c, j in r.judged.items() %}<tr><td>{{ r.op }}</td><td>{{ r.shape }}</td>
<td>{{ fmt(r.timings.get("floor")) }}</td><td>{{ c }}</td><td>{{ fmt(r.timings.get(c if c != "reference" else "eager")) }}</td>
<td>{{ launches((r.launches or {}).get(c if c != "reference" else "eager")) }}</td>
<td>{{ j.floor_ratio if j.floor_ratio is not none else "-" }}</td><td class="{{ 'pass' if j.verdict == 'met' else 'fail' }}">{{ j.verdict }}</td>
<td class="mono">{{ "; ".join(j.misses + (["unjudged: " + ", ".join(j.unjudged)] if j.unjudged else [])) }}</td></tr>
{% endfor %}{% endfor %}</table>
{% for op in counted %}<h3>{{ op }}: {{ unit(rec, op) }}, and kernel launches per call</h3>
{% set head, body = table(rec, op) %}<table><tr>{% for h in head if not h.endswith(" rule") %}<th>{{ h }}</th>{% endfor %}</tr>
{% for cells in body %}<tr>{% for h in head %}{% if not h.endswith(" rule") %}<td>{{ cells[loop.index0] }}</td>{% endif %}{% endfor %}</tr>
{% endfor %}</table>{% endfor %}
"""

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>verify-kernels bench</title><style>
body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;
padding:2px 6px;font-size:13px}.pass{background:#dafbe1}.fail{background:#ffebe9}.mono{font-family:monospace}
</style></head><body>{{ section }}</body></html>"""


def _png(fig) -> str:
    """The figure as a base64 PNG of at most 64 colours (a line plot needs no more), so a page that
    embeds one per op stays a few hundred KB and can be kept beside the record."""
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, bbox_inches="tight")
    plt.close(fig)
    small = io.BytesIO()
    Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(colors=64).save(small, format="PNG", optimize=True)
    return base64.b64encode(small.getvalue()).decode()


def plots(rec: dict, cache: dict | None = None) -> list[tuple[str, str]]:
    """(title, base64 PNG) per op: us against batch, one panel per (knobs, T). `cache` (a dict the
    caller keeps) holds each op's plot against its rows, so a record rewritten after every op draws
    only the op that changed."""
    import json

    if cache is None:
        cache = {}
    out = []
    for op in dict.fromkeys(r["op"] for r in rec["rows"]):
        key = json.dumps([r for r in rec["rows"] if r["op"] == op], sort_keys=True, default=str)
        if cache.get(op, (None,))[0] != key:
            cache[op] = (key, _op_plot(rec, op))
        if cache[op][1] is not None:
            out.append(cache[op][1])
    return out


def _op_plot(rec: dict, op: str) -> tuple[str, str] | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    rows = [r for r in rec["rows"] if r["op"] == op and r["timings"]]
    panels = list(dict.fromkeys((tuple(sorted(r["knobs"].items())), r["tp"]) for r in rows))
    if not panels:
        return None
    cols = len(dict.fromkeys(t for _, t in panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (knobs, tp) in zip(axes.flat, panels):
        mine = sorted((r for r in rows if r["tp"] == tp and tuple(sorted(r["knobs"].items())) == knobs),
                      key=lambda r: r["batch"])
        names = list(dict.fromkeys(k for r in mine for k in r["timings"]))
        for name in names:
            pts = [(r["batch"], r["timings"][name]["median_us"]) for r in mine if name in r["timings"]]
            if not pts:
                continue
            xs, ys = zip(*pts)
            style = dict(color="black", ls="--", lw=1.2) if name == "floor" else dict(marker="o", ms=3)
            ax.plot(xs, ys, label=name.replace("peer:", ""), **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(" ".join([f"T={tp}"] + [f"{k}={v}" for k, v in knobs]), fontsize=9)
        ax.set_xlabel("batch B")
        ax.set_ylabel("us per call")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return f"{op}: us against batch (floor dashed)", _png(fig)


def _pct(shares: dict) -> str:
    return " / ".join("-" if v is None else f"{v:.0%}" for v in shares.values())


def _fmt(t: dict | None) -> str:
    return "-" if not t or t.get("median_us") is None else f"{t['median_us']:.2f}"


def section(rec: dict, cache: dict | None = None) -> str:
    import jinja2

    from verify.bench.output import launch_cell, not_reached_by_reason, op_table, unit

    env = jinja2.Environment(autoescape=True)
    counted = list(dict.fromkeys(r["op"] for r in rec["rows"] if r.get("launches")))
    return env.from_string(_SECTION).render(rec=rec, plots=plots(rec, cache), pct=_pct, fmt=_fmt,
                                            not_reached=not_reached_by_reason(rec), launches=launch_cell,
                                            counted=counted, table=op_table, unit=unit)


def page(rec: dict, cache: dict | None = None) -> str:
    import jinja2
    from markupsafe import Markup

    return jinja2.Environment(autoescape=True).from_string(_PAGE).render(section=Markup(section(rec, cache)))
