"""What a scheduler-level side needs of its driver (`ManagerSide.scheduler`, docs/spec.md §7):
kvfuzz's `kvcache.scheduler.Scheduler`, or vLLM's own Scheduler played as it
(`harness/vllm_scheduler_target.py`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SchedulerDriver(Protocol):
    """The driver a trace's steps run on. Its KV loads (`start_load`, `finish_load`) are not
    part of it: only a side that `offers("load_remote")` asks for them (a connector)."""

    @property
    def waiting(self) -> tuple[Any, ...]: ...

    @property
    def running(self) -> tuple[Any, ...]: ...

    @property
    def loads(self) -> tuple[str, ...]:
        """Requests whose KV load is in flight."""
        ...

    @property
    def in_flight(self) -> tuple[tuple[Any, ...], ...]:
        """Steps launched and not completed, oldest first."""
        ...

    @property
    def deferred_frees(self) -> tuple[tuple[int, ...], ...]:
        """The block ids of the frees waiting for a step, one run per group."""
        ...

    @property
    def sync_loaded(self) -> dict[str, int]:
        """Synchronous loads admitted whose tokens no forward pass has read yet: request id ->
        external tokens (the reader pops them)."""
        ...

    def pending_tokens(self, request_id: str) -> int:
        """Tokens the request's steps in flight will append when they complete."""
        ...

    def add_request(self, request: Any) -> None: ...

    def finish_request(self, request_id: str, status: Any) -> None: ...

    def step(self, sample_token: Callable[..., int],
             run_model: Callable[[list[tuple[Any, int, int]], list[tuple[int, int]]], None]
             | None = None, *, in_flight: bool = False, accept: int | None = None,
             propose: Callable[[Any], list[int]] | None = None,
             drafted: Mapping[str, int] | None = None) -> Any:
        """One step; `run_model(scheduled, copies)` plays the model (`kvcache.scheduler`)."""
        ...

    def complete_step(self) -> list[int]:
        """The oldest step in flight completes: the block ids it released."""
        ...
