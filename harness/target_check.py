"""A startup check of a target adapter: the request fields the generator sets must reach the
manager's Request. An adapter whose `make_request` drops one (say `prefix_cache_hit_limit`)
runs a different request than the reference model, and every difference that makes is a false
finding (I12, DIFF-result). A target that cannot map a field declines it in `offers()`, and
the generator then leaves it out."""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.trace import normalize_op

FIELDS: tuple[tuple[str, Any], ...] = (
    ("max_tokens", 7), ("cache_salt", "kvfuzz-salt"), ("priority", 2),
    ("skip_reading_prefix_cache", True), ("prefix_cache_hit_limit", 5),
)
"""(op field, a value that is not its default): the Request keeps it in the attribute of that
name, or its sampling parameters do (vLLM's `skip_reading_prefix_cache`)."""


def _carried(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = getattr(getattr(request, "sampling_params", None), name, None)
    return value


def dropped_fields(target: Any, config: Config | None = None) -> list[str]:
    """The fields of FIELDS that `target` (a registered target's info) offers but whose value
    its `make_request` does not pass on to the Request it builds."""
    config = config or Config(16, (GroupConfig("full", 4),), name="probe")
    side = target.build(config, "api")
    offers = getattr(side, "offers", lambda _: True)
    dropped = []
    for i, (name, value) in enumerate(FIELDS):  # one field a request: they interact
        if not offers(name):  # declined: the generator leaves it out (it may even refuse it)
            continue
        raw = {"op": "add_request", "request_id": f"probe{i}", "prompt": [1, 2, 3, 4, 5],
               name: value}
        request = side.make_request(normalize_op(raw, "api"), float(i))
        if _carried(request, name) != value:
            dropped.append(name)
    return dropped


def warn_dropped(target: Any) -> list[str]:
    """One warning line per dropped field (none when the target cannot be probed so)."""
    try:
        dropped = dropped_fields(target)
    except Exception:  # noqa: BLE001 - the campaign itself reports a target that cannot build
        return []
    return [f"warning: target {target.name}'s make_request drops {name}, which the generator "
            f"sets: pass it to the Request, or decline it in offers() (docs/targets.md); "
            f"otherwise its differences are false findings" for name in dropped]
