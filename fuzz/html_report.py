"""A campaign's report as one self-contained HTML page (`kvfuzz run --html FILE`): inline SVG
plots and a few lines of script, nothing fetched from the network.

Built from the JSON report (`kvfuzz.fuzz.report.campaign_report` and the totals), so a saved
`--json` file holds everything the page shows: the warnings, coverage and behaviours over time,
the findings on that timeline, the examples per pair, and the behaviours each pair reached.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

WIDTH, HEIGHT, PAD = 640, 180, 40

_STYLE = """
body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:2em}
.warning{background:#fff3cd;border-left:4px solid #e0a800;padding:.4em .8em;margin:.3em 0}
table{border-collapse:collapse} td,th{padding:2px 8px;border-bottom:1px solid #ddd}
td.yes{background:#d4edda} td.never{background:#f8d7da} td.na{color:#aaa}
svg{background:#fafafa;border:1px solid #ddd} .axis{stroke:#888} text{font-size:11px}
"""

_SCRIPT = """
document.getElementById('gaps-only').addEventListener('change', function (e) {
  for (const row of document.querySelectorAll('#behaviours tbody tr')) {
    row.hidden = e.target.checked && row.dataset.never === '0';
  }
});
document.body.dataset.ready = '1';
"""


def _scale(values: list[float], size: float) -> tuple[float, float]:
    top = max(values, default=0.0) or 1.0
    return top, size / top


def _line_plot(pid: str, title: str, points: list[dict[str, Any]], series: list[str],
               marks: list[tuple[float, str]]) -> str:
    """A line per series over `seconds`, and a labelled marker per (seconds, label)."""
    xs = [p["seconds"] for p in points] + [t for t, _ in marks]
    xmax, xk = _scale(xs, WIDTH - 2 * PAD)
    colours = ("#1f77b4", "#2ca02c", "#9467bd")
    parts = [f'<line class="axis" x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" '
             f'y2="{HEIGHT - PAD}"/>',
             f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" text-anchor="end">'
             f'{xmax:.1f} s</text>']
    for i, name in enumerate(series):
        ymax, yk = _scale([p[name] for p in points], HEIGHT - 2 * PAD)
        coords = " ".join(f"{PAD + p['seconds'] * xk:.1f},{HEIGHT - PAD - p[name] * yk:.1f}"
                          for p in points)
        parts.append(f'<polyline class="series" data-series="{name}" fill="none" '
                     f'stroke="{colours[i % 3]}" stroke-width="2" points="{coords}">'
                     f'<title>{escape(name)} (max {ymax:g})</title></polyline>')
        parts.append(f'<text x="{PAD + 4}" y="{14 + 13 * i}" fill="{colours[i % 3]}">'
                     f'{escape(name)} (max {ymax:g})</text>')
    for t, label in marks:
        x = PAD + t * xk
        parts.append(f'<circle class="finding" cx="{x:.1f}" cy="{HEIGHT - PAD}" r="5" '
                     f'fill="#d62728"><title>{escape(label)}</title></circle>')
    return (f'<svg id="{pid}" width="{WIDTH}" height="{HEIGHT}" role="img" '
            f'aria-label="{escape(title)}">{"".join(parts)}</svg>')


def _bars(pid: str, rows: list[dict[str, Any]]) -> str:
    """Examples per pair, one horizontal bar each."""
    height = 16 * len(rows) + 10
    top, k = _scale([r["examples"] for r in rows], WIDTH - 260)
    parts = []
    for i, r in enumerate(rows):
        name = escape(f"{r['level']}/{r['config']}")
        y = 5 + 16 * i
        parts.append(f'<text x="4" y="{y + 11}">{name}</text>'
                     f'<rect class="bar" x="200" y="{y}" height="12" '
                     f'width="{max(r["examples"] * k, 1):.1f}" fill="#1f77b4">'
                     f'<title>{name}: {r["examples"]} examples, {r["operations"]} operations'
                     f'</title></rect><text x="{204 + r["examples"] * k:.1f}" y="{y + 11}">'
                     f'{r["examples"]}</text>')
    return f'<svg id="{pid}" width="{WIDTH}" height="{height}">{"".join(parts)}</svg>'


def _behaviour_table(report: dict[str, Any]) -> str:
    names = list(report["behaviours"])
    first = report.get("first_reached", {})
    head = "".join(f'<th title="{escape(t)}">{escape(n)}</th>'
                   for n, t in report["behaviours"].items())
    rows = []
    for r in report["by_config"]:
        pair = f"{r['level']}/{r['config']}"
        cells = []
        for n in names:
            if n not in r["applies"]:
                cells.append('<td class="na">n/a</td>')
            elif n in r["reached"]:
                at = first.get(pair, {}).get(n)
                cells.append(f'<td class="yes">yes{"" if at is None else f" ({at:.1f} s)"}</td>')
            else:
                cells.append('<td class="never">never</td>')
        rows.append(f'<tr data-never="{len(r["never"])}"><td>{escape(pair)}</td>'
                    f'<td>{r["examples"]}</td><td>{r["operations"]}</td>'
                    f'<td>{r["findings"]}</td>{"".join(cells)}</tr>')
    return ('<label><input type="checkbox" id="gaps-only"> only pairs that missed a behaviour'
            '</label><table id="behaviours"><thead><tr><th>pair</th><th>examples</th>'
            f'<th>operations</th><th>findings</th>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def render(report: dict[str, Any]) -> str:
    """The page for a JSON report of `kvfuzz run`."""
    findings = report.get("findings", [])
    marks = [(f["found_after_s"], f"[{f['check']}] {f['level']}/{f['config']}: {f['message']}")
             for f in findings]
    points = report.get("timeline") or [{"seconds": 0, "coverage": 0, "behaviours": 0,
                                         "examples": 0}]
    warned = "".join(f'<div class="warning">{escape(w)}</div>' for w in report["warnings"])
    listed = "".join(f"<li>[{escape(f['check'])}] {escape(f['level'])}/{escape(f['config'])} "
                     f"after {f['found_after_s']:.1f} s on {escape(f['target'])}: "
                     f"{escape(f['message'])} <code>{escape(f['file'])}</code></li>"
                     for f in findings)
    title = (f"kvfuzz run: target {report['target']}, {len(report['by_config'])} pairs, "
             f"started {report['started']}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{_STYLE}</style></head><body>
<h1>{escape(title)}</h1>
<p id="totals">{report['examples']} examples, {report['operations']} operations,
{report['invariant_checks']} invariant checks, coverage {report['coverage']},
{len(findings)} finding(s) in {report['seconds']} s, seed {report['seed']}
{"(interrupted)" if report.get("interrupted") else ""}</p>
<h2>Warnings</h2><div id="warnings">{warned or "<p>none</p>"}</div>
<h2>Coverage and behaviours over time, findings as red dots</h2>
{_line_plot("coverage-plot", "coverage over time", points, ["coverage", "behaviours"], marks)}
<h2>Examples over time</h2>
{_line_plot("examples-plot", "examples over time", points, ["examples"], [])}
<h2>Findings</h2><ul id="findings">{listed or "<li>none</li>"}</ul>
<h2>Examples per pair</h2>
{_bars("pairs-plot", report["by_config"])}
<h2>Behaviours per pair (first reached, seconds into the run)</h2>
{_behaviour_table(report)}
<script>{_SCRIPT}</script>
</body></html>
"""


def write_html(path: Path, report: dict[str, Any]) -> None:
    """Write the page for `report` to `path`, atomically."""
    from kvfuzz.core.trace import write_atomic

    write_atomic(path, render(report))
