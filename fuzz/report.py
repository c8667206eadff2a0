"""What a campaign did: the behaviours each (level, config) pair reached, over time, and those
it never reached.

A behaviour is a named kind of event a user asks about ("did my config evict, preempt, leave
its window, hit a prefix_cache_hit_limit?"), read off the campaign's coverage features
(`kvfuzz.fuzz.coverage`). It applies to a pair only where the config can show it (no eviction
without prefix caching, no window exit without a windowed group). For the user's own config
files, an applicable behaviour never reached is a warning ("the sliding window of 1024 was
never exceeded in 900 examples"): the campaign did not test what the config is there for.

`Timeline` records the campaign's totals after every batch and when each pair first reached
each behaviour; `campaign_report` is the JSON report's added part (enough to rerun the campaign
and to plot nightly trends), `summary_lines` its text, `kvfuzz.fuzz.html_report` its page.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.fuzz.coverage import REACHED, WINDOW_KINDS

Feature = tuple[Any, ...]
COLLAPSE_OVER = 12
"""A summary with more pairs than this shows the clean ones (no finding, no warning) as one
line."""


@dataclass(frozen=True)
class Behaviour:
    """A named behaviour: whether a feature (less its level and config) shows it, where it can
    happen, and how to say it never happened."""

    name: str
    title: str
    shows: Callable[[Feature], bool]
    applies: Callable[[Config, str], bool]
    never: Callable[[Config], str]


def _is(op: str, *head: Any) -> Callable[[Feature], bool]:
    return lambda f: f[0] == op and f[1:1 + len(head)] == head


def _windows(config: Config) -> str:
    parts = [f"the sliding window of {g.sliding_window}" if g.kind == "sliding_window"
             else f"the attention chunk of {g.attention_chunk_size}"
             for g in config.groups if g.kind in WINDOW_KINDS]
    return " and ".join(dict.fromkeys(parts)) + " " + ("was" if len(parts) == 1 else "were")


def _step(index: int) -> Callable[[Feature], bool]:
    """A scheduler step whose outcome field `index` is true (`coverage.outcome_class`)."""
    return lambda f: f[0] == "step" and len(f) > index and f[index] is True


BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour("allocate_none", "allocate_slots returned None",
              _is("allocate_slots", "none"), lambda c, level: level == "api",
              lambda c: f"allocate_slots never returned None (the pool of {c.num_blocks} "
              "blocks was never short)"),
    Behaviour("pool_dry", "the pool ran out of free blocks", _is(REACHED, "pool_dry"),
              lambda c, level: True,
              lambda c: f"the pool of {c.num_blocks} blocks never ran out of free blocks"),
    Behaviour("eviction", "a cached block was evicted", _is(REACHED, "eviction"),
              lambda c, level: c.enable_caching,
              lambda c: "no cached block was ever evicted"),
    Behaviour("preemption", "a request was preempted",
              lambda f: _step(2)(f) or f == ("free", True), lambda c, level: True,
              lambda c: "no request was ever preempted"),
    Behaviour("prefix_hit", "a prefix-cache hit",
              lambda f: (f[0] == "get_computed_blocks" and len(f) > 2 and f[1] == "hit"
                         and f[2] != 0) or _step(5)(f),
              lambda c, level: c.enable_caching, lambda c: "no lookup ever hit the prefix cache"),
    Behaviour("window_exit", "a block left the window", _is(REACHED, "window_exit"),
              lambda c, level: any(g.kind in WINDOW_KINDS for g in c.groups),
              lambda c: f"{_windows(c)} never exceeded"),
    Behaviour("hit_limit", "a lookup hit up to its prefix_cache_hit_limit",
              _is(REACHED, "hit_limit"), lambda c, level: c.enable_caching and level == "api",
              lambda c: "no lookup ever hit up to a request's prefix_cache_hit_limit"),
    Behaviour("copy", "a partial block was copied (copy-on-write)", _step(4),
              lambda c, level: c.partial_hits and level == "scheduler",
              lambda c: "no partial block was ever copied"),
)
"""Every named behaviour, in report order."""


def reached_by_pair(features: set[Feature]) -> dict[tuple[str, str], set[str]]:
    """The behaviours each (level, config) pair reached."""
    out: dict[tuple[str, str], set[str]] = {}
    for f in features:
        for b in BEHAVIOURS:
            if b.shows(f[2:]):
                out.setdefault((f[0], f[1]), set()).add(b.name)
    return out


class Timeline:
    """The campaign's totals after each batch, and when each pair first reached each behaviour
    (record it from the campaign's progress callback)."""

    def __init__(self) -> None:
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self._t0 = time.monotonic()
        self.points: list[dict[str, Any]] = []
        self.first: dict[str, dict[str, float]] = {}
        """Per pair ("level/config"), per behaviour: seconds into the campaign it was first
        reached."""
        self._seen: set[Feature] = set()

    def record(self, stats: Any) -> None:
        now = round(time.monotonic() - self._t0, 3)
        new = stats.features - self._seen
        self._seen |= new
        for (level, config), names in reached_by_pair(new).items():
            pair = self.first.setdefault(f"{level}/{config}", {})
            for name in names:
                pair.setdefault(name, now)
        self.points.append({"seconds": now, "examples": stats.examples,
                            "operations": stats.operations, "coverage": len(stats.features),
                            "behaviours": sum(map(len, self.first.values())),
                            "findings": len(stats.findings)})


def pair_rows(stats: Any, options: Any) -> list[dict[str, Any]]:
    """One row per (level, config) pair: its counts, the behaviours that apply to it, those it
    reached and those it never reached."""
    from kvfuzz.fuzz.campaign import campaign_config
    from kvfuzz.fuzz.config_space import GENERATED

    reached = reached_by_pair(stats.features)
    coverage: dict[tuple[str, str], int] = {}
    for f in stats.features:
        coverage[(f[0], f[1])] = coverage.get((f[0], f[1]), 0) + 1
    rows = []
    for row in stats.by_config():
        pair = (row["level"], row["config"])
        config = campaign_config(options, row["config"])
        apply = ([] if row["config"] == GENERATED  # a config per batch: no one applies
                 else [b.name for b in BEHAVIOURS if b.applies(config, row["level"])])
        got = reached.get(pair, set())
        rows.append({**row, "coverage": coverage.get(pair, 0), "applies": apply,
                     "reached": [n for n in apply if n in got],
                     "never": [n for n in apply if n not in got]})
    return rows


def warnings(rows: list[dict[str, Any]], options: Any) -> list[str]:
    """For each pair of a user's config file that ran examples, each applicable behaviour it
    never reached, said in the config's terms."""
    by_name = {b.name: b for b in BEHAVIOURS}
    files = {c.name: c for c in options.config_files}
    return [f"config {r['config']} ({r['level']} level): {by_name[n].never(files[r['config']])}"
            f" in {r['examples']} examples"
            for r in rows if r["config"] in files and r["examples"] for n in r["never"]]


def campaign_report(stats: Any, options: Any, timeline: Timeline,
                    findings_target: str) -> dict[str, Any]:
    """The JSON report's part beyond the totals: the options and config files to rerun it with,
    when it started, every coverage feature, the timeline, each pair's behaviours and the
    warnings."""
    rows = pair_rows(stats, options)
    opts = {k: (str(v) if k == "corpus" else list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(options).items() if k != "config_files"}
    return {
        "started": timeline.started.isoformat(timespec="seconds"),
        "options": opts,
        "config_files": {c.name: c.to_dict() for c in options.config_files},
        "behaviours": {b.name: b.title for b in BEHAVIOURS},
        "by_config": rows,
        "warnings": warnings(rows, options),
        "timeline": timeline.points,
        "first_reached": timeline.first,
        "features": sorted((list(f) for f in stats.features), key=repr),
        "findings": [{**asdict(f), "target": findings_target} for f in stats.findings],
    }


def summary_lines(rows: list[dict[str, Any]], warned: list[str]) -> list[str]:
    """The summary's per-pair table (clean pairs as one line when there are many), the
    behaviours never reached, and the warnings."""
    warned_pairs = {w.split(":", 1)[0] for w in warned}  # "config NAME (LEVEL level)"
    shown = [r for r in rows if len(rows) <= COLLAPSE_OVER or r["findings"]
             or f"config {r['config']} ({r['level']} level)" in warned_pairs]
    clean = [r for r in rows if r not in shown]
    names = [f"{r['level']}/{r['config']}" for r in shown]
    if clean:
        names.append(f"{len(clean)} clean pairs")
    width = max(map(len, names), default=9)
    code = any(r.get("code_lines") for r in rows)
    out = [f"  {'by config':<{width}}  {'examples':>9}  {'operations':>11}  findings  behaviours"
           + ("  code lines" if code else "")]
    for name, r in zip(names, shown):
        out.append(f"  {name:<{width}}  {r['examples']:>9}  {r['operations']:>11}  "
                   f"{r['findings']:>8}  {len(r['reached'])}/{len(r['applies']):<8}"
                   + (f"  {r.get('code_lines', 0):>10}" if code else "").rstrip())
    if clean:
        got = [len(r["reached"]) for r in clean]
        lines = [r.get("code_lines", 0) for r in clean]
        out.append(f"  {names[-1]:<{width}}  {sum(r['examples'] for r in clean):>9}  "
                   f"{sum(r['operations'] for r in clean):>11}  {0:>8}  "
                   f"{min(got)}-{max(got)} each"
                   + (f"  {min(lines)}-{max(lines)} each" if code else ""))
    missed = {b.name: [f"{r['level']}/{r['config']}" for r in rows
                       if r["examples"] and b.name in r["never"]] for b in BEHAVIOURS}
    if any(missed.values()):
        out.append("\n  never reached (where it applies)")
        for b in BEHAVIOURS:
            pairs = missed[b.name]
            if pairs:
                more = f" (+{len(pairs) - 4} more)" if len(pairs) > 4 else ""
                out.append(f"    {b.title}: {', '.join(pairs[:4])}{more}")
    out += [f"\n  warning: {w}" if i == 0 else f"  warning: {w}" for i, w in enumerate(warned)]
    return out
