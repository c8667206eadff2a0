"""`--tolerate ID` and `--no-tolerate ID`: which documented deviations a target tolerates.

A target with known deviations (the vLLM targets: `KnownDeviation`s, each documented by a
finding in docs/findings/) names them by id (the finding's number, `013`) or name
(`empty-state-entry`). `vllm` tolerates the ones that apply to the installed release and
`vllm-strict` none; a `Tolerance` adds some to a target's own set or takes some away, so a
strict campaign can go past a known deviation and reach the next bug. A side factory that
takes one accepts `tolerance=` and lists its catalogue with `deviation_catalogue()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvfuzz.core.errors import KvfuzzError


class UnknownDeviation(KvfuzzError):
    """`--tolerate`/`--no-tolerate` names no deviation the target documents."""


class Deviation(Protocol):
    name: str

    @property
    def id(self) -> str: ...


D = TypeVar("D", bound=Deviation)


@dataclass(frozen=True)
class Tolerance:
    """Deviations to tolerate beyond a target's own (`add`) and to report after all
    (`remove`), by id or name."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.remove)

    def select(self, own: Sequence[D], catalogue: Sequence[D]) -> tuple[D, ...]:
        """`own` with `add` put in and `remove` taken out, in the catalogue's order."""
        add = {find(n, catalogue).name for n in self.add}
        remove = {find(n, catalogue).name for n in self.remove}
        mine = {d.name for d in own} | add
        return tuple(d for d in catalogue if d.name in mine and d.name not in remove)

    def meta(self) -> dict[str, list[str]]:
        """What a finding records, so that replay tolerates the same."""
        return {k: list(v) for k, v in (("tolerate", self.add), ("no_tolerate", self.remove))
                if v}

    @classmethod
    def of_meta(cls, meta: dict[str, Any]) -> Tolerance:
        def names(key: str) -> tuple[str, ...]:
            value = meta.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise KvfuzzError(f"the trace's meta.{key} is not a list of deviation ids")
            return tuple(value)

        return cls(names("tolerate"), names("no_tolerate"))


def find(name: str, catalogue: Iterable[D]) -> D:
    """The deviation `name` (an id like 013, or a name) of `catalogue`."""
    known = list(catalogue)
    for d in known:
        if name in (d.id, d.name, f"{d.id}-{d.name}"):
            return d
    listed = ", ".join(f"{d.id} ({d.name})" for d in known) or "none"
    raise UnknownDeviation(f"no documented deviation {name!r}; known: {listed}")


def tolerating(factory: Callable[..., Any], name: str, tolerance: Tolerance) -> Callable[..., Any]:
    """`factory` building its sides with `tolerance` (its ids checked now: exit 2 if one is
    unknown, or if the target documents no deviation)."""
    catalogue = getattr(factory, "deviation_catalogue", None)
    if catalogue is None:
        raise UnknownDeviation(f"target {name} documents no deviation to tolerate "
                               "(--tolerate and --no-tolerate are for the vllm targets)")
    for n in (*tolerance.add, *tolerance.remove):
        find(n, catalogue())

    def build(config: Any, level: str) -> Any:
        return factory(config, level, tolerance=tolerance)

    build.__name__ = name
    return build
