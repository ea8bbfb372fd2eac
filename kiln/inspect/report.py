"""A self-contained HTML report of an engine description: one page, inline CSS, a small inline vanilla-JS table
sorter and inline SVG charts; no external URL of any kind. Sections: a summary, the layer table (sortable by
clicking a header), time by layer type and by precision (layer counts when there is no profile, labelled so), the
lint findings, the ONNX nodes (each one's layer, precision and time share, `kiln.inspect.by_onnx`), and the graph (an SVG from kiln.inspect.render, inlined) or a note saying why it is missing.
Every name taken from the engine is escaped with html.escape."""
from __future__ import annotations

import re
from html import escape

from kiln.fileio import atomic_write_text
from kiln.inspect.by_onnx import by_onnx
from kiln.inspect.onnx_nodes import ModelNodes
from kiln.inspect.lint import Finding
from kiln.trt.records import EngineInfo, LayerRecord, Profile
from kiln.inspect.render import PRECISION_COLOURS

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 6px;vertical-align:top}
th{background:#f3f3f3;text-align:left}table.sortable th{cursor:pointer;user-select:none}
table.sortable th.asc:after{content:" \\25B2"}table.sortable th.desc:after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.name{max-width:44em;word-break:break-all}
#findings{width:100%;table-layout:fixed}#findings td{overflow-wrap:anywhere}
#findings th:nth-child(1){width:6em}#findings th:nth-child(2){width:13em}#findings th:nth-child(3){width:22%}
.sev-error{color:#b00020;font-weight:bold}.sev-warning{color:#a65e00;font-weight:bold}.sev-info{color:#555}
.charts{display:flex;flex-wrap:wrap;gap:32px}.note{color:#666;font-style:italic}
.graph{overflow:auto;border:1px solid #ddd;max-height:90vh}.chip{display:inline-block;width:10px;height:10px}
"""

JS = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var asc = !th.classList.contains("asc"), num = th.dataset.type === "num";
      table.querySelectorAll("th").forEach(function (h) { h.classList.remove("asc", "desc"); });
      th.classList.add(asc ? "asc" : "desc");
      function key(row) {
        var cell = row.cells[col], v = cell.dataset.v !== undefined ? cell.dataset.v : cell.textContent;
        return num ? (v === "" ? -Infinity : parseFloat(v)) : v.toLowerCase();
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""

_XML_PROLOG = re.compile(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<!--.*?-->",
                         re.IGNORECASE | re.DOTALL)
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')


def inline_svg(svg: str) -> str:
    """Graphviz SVG for inlining in HTML: without the XML prolog, DOCTYPE, comments and namespace URLs."""
    return _XMLNS.sub("", _XML_PROLOG.sub("", svg)).strip()


def _avg_times(profile: Profile | None) -> dict[str, float]:
    return {r.name: r.average_ms for r in profile.records} if profile else {}


def _fmt_dims(layer: LayerRecord) -> tuple[str, str]:
    dims = "; ".join("x".join(str(d) for d in t.dims) if t.dims is not None else "?" for t in layer.outputs)
    fmts = "; ".join(t.format or "?" for t in layer.outputs)
    return dims, fmts


def summary_section(engine: EngineInfo, profile: Profile | None) -> str:
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{escape(k)}: {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))

    rows = [("Source", escape(engine.source)), ("Verbosity", escape(engine.verbosity)),
            ("Layers", str(len(engine.layers))), ("Layer types", counts(engine.layer_types)),
            ("Precisions", counts(engine.precisions)),
            ("Bindings", escape(", ".join(engine.bindings)) or "<span class=note>none recorded</span>")]
    if profile:
        runs = f" over {profile.count} runs" if profile.count else ""
        rows.append(("Total average time", f"{profile.total_average_ms:.4f} ms{runs}"))
    else:
        rows.append(("Total average time", "<span class=note>no profile given</span>"))
    rows += [("Note", escape(n)) for n in engine.notes]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<h2>Summary</h2><table>{body}</table>"


def layer_table(engine: EngineInfo, profile: Profile | None) -> str:
    times = _avg_times(profile)
    total = profile.total_average_ms if profile else 0.0
    heads = [("#", "num"), ("Name", "str"), ("Type", "str"), ("Precision", "str"), ("Tactic", "str"),
             ("Output dims", "str"), ("Output format", "str"), ("Avg ms", "num"), ("% time", "num")]
    head = "".join(f'<th data-type="{t}">{escape(h)}</th>' for h, t in heads)
    rows = []
    for i, layer in enumerate(engine.layers):
        avg = times.get(layer.name)
        pct = 100.0 * avg / total if avg is not None and total > 0 else None
        dims, fmts = _fmt_dims(layer)
        kind = layer.layer_type or layer.parameter_type or ""
        tactic = layer.tactic_name or layer.tactic_value or ""
        region = f"<br><small>region: {escape(layer.region)}</small>" if layer.region else ""
        cells = [f'<td class=num data-v="{i}">{i}</td>', f"<td class=name>{escape(layer.name)}{region}</td>",
                 f"<td>{escape(kind)}</td>", f"<td>{escape(layer.precision or 'unknown')}</td>",
                 f"<td class=name>{escape(tactic)}</td>", f"<td>{escape(dims)}</td>", f"<td>{escape(fmts)}</td>",
                 _num_cell(avg, 4), _num_cell(pct, 2)]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    hint = "" if profile else "<p class=note>No profile: times are empty (pass --profile).</p>"
    return (f"<h2>Layers</h2><p class=note>Click a column header to sort.</p>{hint}"
            f'<table class="sortable" id="layers"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
            "</table>")


def _num_cell(value: float | None, digits: int) -> str:
    return '<td class=num data-v=""></td>' if value is None else \
        f'<td class=num data-v="{value:.6g}">{value:.{digits}f}</td>'


def bar_chart(title: str, items: list[tuple[str, float]], unit: str, colours: dict[str, str] | None = None) -> str:
    """A horizontal bar chart as inline SVG: one labelled bar per item, scaled to the largest value."""
    items = sorted(items, key=lambda kv: -kv[1])
    label_w, bar_w, row_h = 210, 300, 22
    height = row_h * max(len(items), 1) + 10
    biggest = max((v for _, v in items), default=0) or 1.0
    parts = [f'<svg width="{label_w + bar_w + 120}" height="{height}" role="img" aria-label="{escape(title)}">']
    for i, (name, value) in enumerate(items):
        y, w = 5 + i * row_h, max(1.0, bar_w * value / biggest)
        fill = (colours or {}).get(name, "#6baed6")
        text = f"{value:.4f} {unit}" if unit == "ms" else f"{value:g} {unit}"
        short = name if len(name) <= 30 else name[:29] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end" font-size="12">'
                     f"<title>{escape(name)}</title>{escape(short)}</text>"
                     f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}" fill="{fill}"/>'
                     f'<text x="{label_w + w + 6:.1f}" y="{y + 15}" font-size="12">{escape(text)}</text>')
    parts.append("</svg>")
    return f"<div><h3>{escape(title)}</h3>{''.join(parts)}</div>"


def charts_section(engine: EngineInfo, profile: Profile | None) -> str:
    """Time by layer type and by precision (from the profile), else layer counts, labelled as such."""
    if profile and profile.records:
        by_name = {layer.name: layer for layer in engine.layers}
        by_type: dict[str, float] = {}
        by_prec: dict[str, float] = {}
        for r in profile.records:
            layer = by_name.get(r.name)
            kind = (layer.layer_type or layer.parameter_type or "unknown") if layer else "(not in engine)"
            prec = (layer.precision or "unknown") if layer else "(not in engine)"
            by_type[kind] = by_type.get(kind, 0.0) + r.average_ms
            by_prec[prec] = by_prec.get(prec, 0.0) + r.average_ms
        charts = [bar_chart("Time by layer type (average ms)", list(by_type.items()), "ms"),
                  bar_chart("Time by precision (average ms)", list(by_prec.items()), "ms", PRECISION_COLOURS)]
        note = ""
    else:
        charts = [bar_chart("Layer count by type (no profile)", list(engine.layer_types.items()), "layers"),
                  bar_chart("Layer count by precision (no profile)", list(engine.precisions.items()), "layers",
                            PRECISION_COLOURS)]
        note = "<p class=note>No profile given: the charts count layers instead of time.</p>"
    return f"<h2>Time breakdown</h2>{note}<div class=charts>{''.join(charts)}</div>"


def findings_section(findings: list[Finding] | None) -> str:
    if findings is None:
        return "<h2>Lint findings</h2><p class=note>Lint was not run.</p>"
    if not findings:
        return "<h2>Lint findings</h2><p>No findings.</p>"
    heads = "".join(f"<th>{h}</th>" for h in ("Severity", "Rule", "Layer", "Hazard", "Mitigation"))
    rows = "".join(f"<tr><td class=sev-{escape(f.severity)}>{escape(f.severity)}</td><td>{escape(f.rule_id)}</td>"
                   f"<td class=name>{escape(f.layer or '(engine)')}</td><td>{escape(f.hazard)}</td>"
                   f"<td>{escape(f.mitigation)}</td></tr>" for f in findings)
    return (f'<h2>Lint findings ({len(findings)})</h2><table class="sortable" id="findings"><thead><tr>{heads}'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def onnx_nodes_section(engine: EngineInfo, profile: Profile | None, model: ModelNodes | None = None) -> str:
    """Each ONNX node: the layer it lives in, that layer's type and precision, the node's share of its time."""
    result = by_onnx(engine, profile, model=model)
    heads = [("ONNX node", "str"), ("Layer", "str"), ("Type", "str"), ("Precision", "str"), ("Share %", "num"),
             ("Avg ms", "num")]
    head = "".join(f'<th data-type="{t}">{escape(h)}</th>' for h, t in heads)
    rows = []
    for row in result.rows:
        s = row.a.primary
        more = f"<br><small>and {len(row.a.shares) - 1} more layer(s)</small>" if len(row.a.shares) > 1 else ""
        rows.append(f"<tr><td class=name>{escape(row.onnx_node)}</td><td class=name>{escape(s.layer)}{more}</td>"
                    f"<td>{escape(s.layer_type or '')}</td><td>{escape(s.precision or 'unknown')}</td>"
                    f"{_num_cell(100.0 * s.share, 1)}{_num_cell(row.a.time_ms, 4)}</tr>")
    notes = "".join(f"<p class=note>{escape(n)}</p>" for n in result.notes)
    return (f"<h2>By ONNX node ({len(result.rows)})</h2><p class=note>Time inside a layer holding several ONNX nodes "
            f"is split {escape(result.split)}.</p>{notes}"
            f'<table class="sortable" id="by-onnx"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody>'
            "</table>")


def graph_section(svg: str | None, note: str | None) -> str:
    if svg:
        return f"<h2>Graph</h2><div class=graph>{inline_svg(svg)}</div>"
    return f"<h2>Graph</h2><p class=note>{escape(note or 'No graph included.')}</p>"


def html_report(engine: EngineInfo, profile: Profile | None = None, findings: list[Finding] | None = None,
                svg: str | None = None, title: str = "kiln engine report", graph_note: str | None = None,
                model: ModelNodes | None = None) -> str:
    """The whole page as one string (see the module docstring); `graph_note` explains a missing graph; `model`
    (the ONNX model's nodes) resolves ForeignNode ranges and splits fused layers' time by FLOPs."""
    profile = profile or engine.profile
    body = [f"<h1>{escape(title)}</h1>", summary_section(engine, profile), charts_section(engine, profile),
            findings_section(findings), layer_table(engine, profile), onnx_nodes_section(engine, profile, model),
            graph_section(svg, graph_note)]
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body) +
            f"\n<script>{JS}</script>\n</body></html>\n")


def write_report(path, engine: EngineInfo, **kwargs) -> None:
    """html_report(engine, **kwargs) written atomically to `path`."""
    atomic_write_text(path, html_report(engine, **kwargs))
