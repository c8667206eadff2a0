"""Whether a signal asked kvfuzz to stop. A KeyboardInterrupt raised while no signal came is
not the user's Ctrl-C but code kvfuzz ran (a check, a plugin, an adapter) raising it: a fault of
that code (exit 3), like a SystemExit it raises."""

from __future__ import annotations

import threading
from typing import Any

SIGNALLED = threading.Event()
"""Set by kvfuzz's SIGINT and SIGTERM handlers."""


def on_sigint(signum: int, frame: Any) -> None:
    """SIGINT outside a campaign: noted, then Python's own KeyboardInterrupt."""
    SIGNALLED.set()
    raise KeyboardInterrupt


def asked_to_stop(exc: BaseException) -> bool:
    """Whether `exc` is an interrupt that a signal asked for (to be let through)."""
    return isinstance(exc, KeyboardInterrupt) and SIGNALLED.is_set()
