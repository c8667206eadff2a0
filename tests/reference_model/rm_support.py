"""Helpers of the reference-model tests: drive ReferenceModel only through normalized ops."""

from __future__ import annotations

from typing import Any

from kvfuzz.core.config import Config, GroupConfig, SchedulerConfig
from kvfuzz.core.snapshot import Snapshot
from kvfuzz.core.trace import normalize_op
from kvfuzz.reference_model import ReferenceModel


class Runner:
    """A model plus `run(op_name, **fields)`, which normalizes the op and applies it."""

    def __init__(self, config: Config, level: str) -> None:
        self.level = level
        self.model = ReferenceModel(config, level)

    def run(self, op: str, **fields: Any) -> Any:
        return self.model.apply(normalize_op({"op": op, **fields}, self.level))

    @property
    def snap(self) -> Snapshot:
        return self.model.snapshot()

    @property
    def probes(self) -> list[Any]:
        return self.model.observations().allocations

    def add(self, rid: str, prompt: list[int], **fields: Any) -> None:
        assert self.run("add_request", request_id=rid, prompt=prompt, **fields) is None

    def admit(self, rid: str, num_new_tokens: int) -> Any:
        """get_computed_blocks then allocate_slots with the lookup."""
        self.run("get_computed_blocks", request_id=rid)
        return self.run(
            "allocate_slots", request_id=rid, num_new_tokens=num_new_tokens, use_lookup=True
        )


def full(bs: int) -> GroupConfig:
    return GroupConfig("full", bs)


def swa(bs: int, w: int, extra: int = 0) -> GroupConfig:
    return GroupConfig("sliding_window", bs, sliding_window=w, extra_retained_tokens=extra)


def chunked(bs: int, c: int) -> GroupConfig:
    return GroupConfig("chunked_local", bs, attention_chunk_size=c)


def config(num_blocks: int, *groups: GroupConfig, **fields: Any) -> Config:
    sched = fields.pop("scheduler", None)
    if sched is not None:
        fields["scheduler"] = SchedulerConfig(**sched)
    return Config(num_blocks=num_blocks, groups=tuple(groups), **fields)
