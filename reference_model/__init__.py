"""The reference model: a slow, obviously-correct executable model of docs/spec.md Tier A and B,
used as the oracle of the lockstep trace executor (docs/traces.md).

Modules: `layout` (static config facts), `requests` (harness-side requests, content keys),
`state` (ownership tables, free queue, cache entries, pool operations), `lookup` (hit searches,
hybrid reconciliation), `caching` (recording cache entries), `allocation` (allocate_slots and the
per-group operations), `manager` (layer-1 API, probes), `scheduler` (the driver), `model` (ops,
validity, misuse, snapshots).
"""

from kvfuzz.reference_model.model import ReferenceModel

__all__ = ["ReferenceModel"]
