"""Exporting a trace as a standalone pytest regression test."""

from __future__ import annotations

from pathlib import Path

from kvfuzz.core.trace import Trace, write_atomic

_TEMPLATE = '''"""Regression test exported by `kvfuzz export` from {source}.

It replays the trace below on target {target!r} with every invariant{data_doc} and the
reference model in lockstep; it fails while the bug it records ({check}) is present.
It imports {plugins_doc}.
"""

import json

from kvfuzz.testing import replay_trace

PLUGINS = {plugins!r}
"""The plugins passed to `kvfuzz export --plugin`; the trace's meta.plugins is only a record."""
TRACE = json.loads(r"""
{trace_json}""")


def test_{name}():
    replay_trace(TRACE, {target!r}, plugins=PLUGINS, data={data!r})
'''


def export_pytest(trace: Trace, target: str, out: Path, source: str = "a kvfuzz trace",
                  plugins: tuple[str, ...] = ()) -> Path:
    """Write a pytest module replaying `trace` on `target` after importing exactly `plugins`
    (those passed at export time, never those the trace's meta records); returns its path."""
    check = str(trace.meta.get("check", "a finding"))
    name = "".join(c if c.isalnum() else "_" for c in f"replay_{check}_{out.stem}").lower()
    data = trace.meta.get("data")
    data_doc = f" and the data checks on {data}" if data else ""
    plugins_doc = ("exactly the plugins passed at export time: " + ", ".join(plugins)
                   if plugins else "no plugin: none was passed at export time")
    text = _TEMPLATE.format(source=source, target=target, check=check, data=data,
                            plugins=tuple(plugins), plugins_doc=plugins_doc,
                            data_doc=data_doc, trace_json=trace.to_json(), name=name)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    return out
