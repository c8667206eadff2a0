"""Invariants and Hypothesis state machines over the executor (see registry.py for the API)."""

from kvfuzz.properties.registry import (
    REGISTRY,
    Check,
    CheckContext,
    Registry,
    RequestMeta,
    invariant,
    transition,
)
from kvfuzz.properties import mission as _mission  # noqa: F401  (registers P1-P4)
from kvfuzz.properties import invariants as _invariants  # noqa: F401  (registers I1-I20, H1-H2)
from kvfuzz.properties import events as _events  # noqa: F401  (registers EV1-EV6)
from kvfuzz.properties import states as _states  # noqa: F401  (registers S2-S3)
from kvfuzz.properties import retention as _retention  # noqa: F401  (registers RT1)
from kvfuzz.properties import inflight as _inflight  # noqa: F401  (registers IF1-IF2)
from kvfuzz.properties import worker as _worker  # noqa: F401  (registers W1)

__all__ = [
    "REGISTRY",
    "Check",
    "CheckContext",
    "Registry",
    "RequestMeta",
    "invariant",
    "transition",
]
