"""KV events through vLLM's own Scheduler: the batches it publishes, recorded per op.

vLLM's Scheduler builds its KVCacheManager with `enable_kv_cache_events` from
`VllmConfig.kv_events_config`, and at the end of each `update_from_output` takes the manager's
events (and its connector's) and hands them to its publisher as one `KVEventBatch`
(0.34.0: `sched/scheduler.py:146-149`, `:2689-2704`). Target `vllm-scheduler` turns events on
with the null publisher (no socket: offline) and puts a `PublishedEvents` in its place, which
keeps each batch until the side reads it after the op (`VllmSchedulerSide.queued_events`).
"""

from __future__ import annotations

from typing import Any


class PublishedEvents:
    """An event publisher (`publish`, `shutdown`) that keeps what vLLM's Scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        """Nothing to close: no socket, no thread."""

    def take(self) -> list[Any]:
        """The events of every batch published since the last call, in order."""
        events = [event for batch in self.batches for event in batch.events]
        self.batches = []
        return events


def kv_events_config(kv_events_config_cls: Any) -> Any:
    """vLLM's `KVEventsConfig` with events on and the null publisher."""
    return kv_events_config_cls(enable_kv_cache_events=True, publisher="null")


def count_outputs(driver: Any, scheduler: Any) -> None:
    """Count the `update_from_output` calls of `scheduler` in `driver.outputs_taken`: an op
    whose events vLLM publishes ran at least one."""
    update = scheduler.update_from_output

    def update_from_output(*args: Any, **kwargs: Any) -> Any:
        driver.outputs_taken += 1
        return update(*args, **kwargs)

    scheduler.update_from_output = update_from_output
