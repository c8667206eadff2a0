"""The invariant registry: named, described checks the executor runs after every op.

A **state** check sees the snapshot after an op; a **transition** check also sees the snapshot
before it, the op, its result and what the probes observed. A check returns None when it holds
and a message saying what is wrong when it does not. Users add checks by decorating a function
in a module of their own and naming that module with `kvfuzz run --plugin` or
`pytest --kvfuzz-plugin` (or importing it from a conftest): see README.md, "Adding an invariant".

    from kvfuzz.properties import invariant

    @invariant("MY1", "no request holds more than 8 blocks in group 0")
    def at_most_eight(snapshot, ctx):
        for rid, view in snapshot.requests.items():
            if view.tables[0] and len(view.tables[0]) > 8:
                return f"{rid} holds {len(view.tables[0])} blocks"
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfuzz.core.config import Config
from kvfuzz.core.extra_keys import Extras
from kvfuzz.core.sides import Observations
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.core.trace import Op


@dataclass(frozen=True)
class RequestMeta:
    """What the trace said about a request when it was added."""

    prompt: tuple[int, ...]
    cache_salt: str | None
    skip_reading_prefix_cache: bool
    num_encoder_tokens: int
    extras: Extras | None = None
    """LoRA, multimodal inputs and prompt embeddings (docs/spec.md §2.3); None for none."""
    prefix_cache_hit_limit: int | None = None
    """The request's own ceiling on prefix hits (vLLM 0.34's prompt scoring); None: none."""


@dataclass
class CheckContext:
    """Everything a check may need besides the snapshots."""

    config: Config
    level: str
    step: int
    op: Op
    result: Any
    observations: Observations
    requests: dict[str, RequestMeta]
    memory: dict[str, Any] = field(default_factory=dict)
    """Per-execution scratch space for checks that need history (keyed by check name)."""


StateCheck = Callable[[Snapshot, CheckContext], "str | None"]
TransitionCheck = Callable[[Snapshot, Snapshot, CheckContext], "str | None"]


@dataclass(frozen=True)
class Check:
    name: str
    description: str
    kind: Literal["state", "transition"]
    fn: Callable[..., str | None]
    covers: tuple[str, ...] = ()
    """docs/spec.md §8 invariants and docs/bugs.md rows this check stands for."""
    module: str = ""
    """The module that registered it."""

    @property
    def builtin(self) -> bool:
        """Registered by kvfuzz's own `properties` package, not by a user's plugin."""
        return self.module.startswith("kvfuzz.properties.")


class Registry:
    """An ordered collection of checks; the default one is `REGISTRY`."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}

    def add(self, check: Check) -> None:
        if check.name in self._checks and self._checks[check.name].fn is not check.fn:
            raise ValueError(f"an invariant named {check.name!r} is already registered")
        self._checks[check.name] = check

    def remove(self, name: str) -> None:
        del self._checks[name]

    def __iter__(self):
        return iter(self._checks.values())

    def __len__(self) -> int:
        return len(self._checks)

    def __contains__(self, name: str) -> bool:
        return name in self._checks

    def get(self, name: str) -> Check:
        return self._checks[name]

    def select(self, names: Iterable[str] | None) -> list[Check]:
        if names is None:
            return list(self._checks.values())
        chosen = []
        for name in names:
            if name not in self._checks:
                raise KeyError(f"unknown invariant {name!r}; known: {', '.join(self._checks)}")
            chosen.append(self._checks[name])
        return chosen


REGISTRY = Registry()


def invariant(
    name: str, description: str, *, covers: Iterable[str] = (), registry: Registry | None = None
) -> Callable[[StateCheck], StateCheck]:
    """Register `fn(snapshot, ctx) -> message | None` as a state invariant."""

    def decorate(fn: StateCheck) -> StateCheck:
        (REGISTRY if registry is None else registry).add(
            Check(name, description, "state", fn, tuple(covers), fn.__module__)
        )
        return fn

    return decorate


def transition(
    name: str, description: str, *, covers: Iterable[str] = (), registry: Registry | None = None
) -> Callable[[TransitionCheck], TransitionCheck]:
    """Register `fn(before, after, ctx) -> message | None` as a transition property."""

    def decorate(fn: TransitionCheck) -> TransitionCheck:
        (REGISTRY if registry is None else registry).add(
            Check(name, description, "transition", fn, tuple(covers), fn.__module__)
        )
        return fn

    return decorate
