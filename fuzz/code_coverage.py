"""The target's own code coverage, recorded per batch: the lines and branches of its source run.

A campaign weighs each (level, config) pair by the new code of the target its latest batch ran
(`kvfuzz.fuzz.campaign.pair_weight`), so a fixed budget goes where the target's code is still
being reached. The source measured is the target's (`target_roots`): vLLM's `v1/core` (with
`v1/core/sched`) for the targets that drive vLLM, kvfuzz's `kvcache/` for the others; a
plugin's side factory may name its own packages in a `code_packages` attribute.

A site is `(file, line)` for a line, `(file, function, from, to)` for a branch taken, the file
relative to its root, so sites compare across processes and machines. Coverage is a function of
the examples run, so weights computed from it keep a seed's campaign reproducible.

Two recorders:
- `sys.monitoring` (Python 3.12+) records every example of a batch: LINE and BRANCH events,
  each location disabled after its first report, so a batch pays once per site;
  `sys.monitoring.restart_events()` re-arms them for the next batch.
- `sys.settrace` otherwise, only while the target applies an op (`Side.apply`) of the last
  `SAMPLED` example(s) of each batch (a pair's first batch too: the schedule's weights after
  the first round rest on its code): on Python 3.11 any trace function puts the
  interpreter in its tracing mode, which alone halves a campaign's speed (the reference model,
  the checks and Hypothesis included); recording every op of every example cut a campaign to a
  third of the executor's replay speed (bench/bench_campaign.py), one example per batch keeps
  it above half. Code outside the roots gets no local tracer; a branch is an arc (file, function,
  previous line, line) between lines that do not follow each other.

Neither records while another tracer (a debugger, coverage.py under `kvfuzz mutate`) holds
`sys.settrace`, or while every `sys.monitoring` tool id is taken: the batch then reports no
code, and the schedule falls back on behaviour features alone.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

Site = tuple[Any, ...]
"""A line `(file, line)` or a branch `(file, function, from, to)`."""

VLLM_PACKAGES = ("vllm.v1.core",)
"""What a vLLM target's coverage measures (`v1/core/sched` lies inside)."""
KVCACHE_PACKAGES = ("kvfuzz.kvcache",)
SAMPLED: int | None = 1
"""Examples recorded per batch by the `sys.settrace` fallback (None: all)."""


def target_packages(target: str, factory: Any = None) -> tuple[str, ...]:
    """The packages whose code target `target` runs: the factory's own `code_packages`, else
    vLLM's v1/core for a target named vllm*, else kvfuzz's kvcache/ (the planted bugs too)."""
    declared = getattr(factory, "code_packages", None)
    if declared:
        return tuple(declared)
    return VLLM_PACKAGES if target.startswith("vllm") else KVCACHE_PACKAGES


def package_roots(packages: tuple[str, ...]) -> tuple[Path, ...]:
    """The source folders of `packages` that this Python can find (one not installed: none)."""
    roots = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        if spec is not None and spec.submodule_search_locations:
            roots.extend(Path(p).resolve() for p in spec.submodule_search_locations)
    return tuple(roots)


def is_line(site: Site) -> bool:
    return len(site) == 2


class CodeRecorder:
    """Records the sites of the files under `roots` that run between `start` and `stop`."""

    def __init__(self, roots: tuple[Path, ...], monitoring: bool | None = None) -> None:
        """`monitoring`: use `sys.monitoring` (None: where Python has it)."""
        self.roots = tuple(str(r) for r in roots)
        self.monitoring = hasattr(sys, "monitoring") if monitoring is None else monitoring
        self.sites: set[Site] = set()
        self._files: dict[str, str | None] = {}
        self._tool: int | None = None
        self._active = False
        self._examples = 0
        self._batch_examples = 0

    def relative(self, filename: str) -> str | None:
        """`filename` relative to the root holding it (with the root's own name), or None."""
        known = self._files.get(filename, ...)
        if known is not ...:
            return known
        where = None
        for root in self.roots:
            if filename.startswith(root):
                where = Path(root).name + filename[len(root):].replace("\\", "/")
                break
        self._files[filename] = where
        return where

    def batch(self, examples: int) -> None:
        """A batch of `examples` examples begins: its sites start empty (`take` hands them
        over)."""
        self.sites = set()
        self._examples = 0
        self._batch_examples = examples
        if self.monitoring:
            self.start()

    def watch(self, side: Any) -> None:
        """A side of the batch's next example: the fallback records its ops (`Side.apply`) in
        the batch's last `SAMPLED` examples (None: all), so that a batch failing early pays
        nothing (bar a pair's first batch: its one example is its last)."""
        self._examples += 1
        if self.monitoring or (
                SAMPLED is not None and self._examples <= self._batch_examples - SAMPLED):
            return
        apply = side.apply

        def recorded(op: Any) -> Any:
            self.start()
            try:
                return apply(op)
            finally:
                self.stop()

        side.apply = recorded

    def take(self) -> set[Site]:
        """The batch ends: the sites it ran."""
        self.stop()
        sites, self.sites = self.sites, set()
        return sites

    def start(self) -> None:
        """Record from now on, adding to `sites` (nothing without roots or with another
        tracer)."""
        if not self.roots or self._active:
            return
        if self.monitoring:
            self._start_monitoring()
        elif sys.gettrace() is None:
            sys.settrace(self._call)
            self._active = True

    def stop(self) -> None:
        """Stop recording (the sites so far stay in `sites`)."""
        if self._active:
            if self.monitoring:
                sys.monitoring.set_events(self._tool, 0)  # type: ignore[attr-defined]
            else:
                sys.settrace(None)
            self._active = False

    # sys.monitoring (3.12+)

    def _start_monitoring(self) -> None:
        mon = sys.monitoring  # type: ignore[attr-defined]
        if self._tool is None:
            self._tool = next((t for t in (mon.COVERAGE_ID, 2, 3, 4)
                               if mon.get_tool(t) is None), None)
            if self._tool is None:
                return
            mon.use_tool_id(self._tool, "kvfuzz")
            mon.register_callback(self._tool, mon.events.LINE, self._line_event)
            for name in branch_events():
                mon.register_callback(self._tool, getattr(mon.events, name), self._branch_event)
        events = mon.events.LINE
        for name in branch_events():
            events |= getattr(mon.events, name)
        mon.restart_events()
        mon.set_events(self._tool, events)
        self._active = True

    def _line_event(self, code: CodeType, line: int) -> Any:
        where = self.relative(code.co_filename)
        if where is not None:
            self.sites.add((where, line))
        return sys.monitoring.DISABLE  # type: ignore[attr-defined]

    def _branch_event(self, code: CodeType, offset: int, destination: int) -> Any:
        where = self.relative(code.co_filename)
        if where is not None:
            self.sites.add((where, code.co_qualname, offset, destination))
        return sys.monitoring.DISABLE  # type: ignore[attr-defined]

    # sys.settrace (the fallback)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        code = frame.f_code
        where = self.relative(code.co_filename)
        if where is None:
            return None
        sites, name = self.sites, code.co_qualname
        previous = [frame.f_lineno]

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                line, before = frame.f_lineno, previous[0]
                sites.add((where, line))
                if line != before + 1:
                    sites.add((where, name, before, line))
                previous[0] = line
            return local

        return local


def branch_events() -> tuple[str, ...]:
    """The names of `sys.monitoring`'s branch events in this Python (3.14 splits BRANCH)."""
    events = sys.monitoring.events  # type: ignore[attr-defined]
    if hasattr(events, "BRANCH_LEFT"):
        return ("BRANCH_LEFT", "BRANCH_RIGHT")
    return ("BRANCH",)


def count_lines(sites: set[Site]) -> tuple[int, int]:
    """(lines, branches) among `sites`."""
    lines = sum(1 for s in sites if is_line(s))
    return lines, len(sites) - lines


def rarity(reached: dict[tuple[str, str], set[Site]], most: int) -> dict[tuple[str, str], float]:
    """Per (level, config) pair of `reached`, its share of the sites that at most `most`
    configs reached: 1/n for a site n configs reached (the levels of one config share its
    code, so they count as one)."""
    configs: dict[Site, set[str]] = {}
    for (_, config), sites in reached.items():
        for site in sites:
            configs.setdefault(site, set()).add(config)
    return {pair: sum(1 / len(configs[site]) for site in sites if len(configs[site]) <= most)
            for pair, sites in reached.items()}
