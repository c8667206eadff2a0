"""kvfuzz's scheduler driver is a `SchedulerDriver` (harness/scheduler_driver.py), and a driver
that lacks any of its members is not one (vLLM's: tests/vllm/test_vllm_scheduler_driver.py)."""

from typing import Any

import pytest

from kvfuzz.core.configs import builtin_config
from kvfuzz.harness.scheduler_driver import SchedulerDriver
from kvfuzz.harness.targets import get_target

MEMBERS = ("waiting", "running", "loads", "in_flight", "deferred_frees", "sync_loaded",
           "pending_tokens", "add_request", "finish_request", "step", "complete_step")


class _Without:
    """`driver` with every attribute but `missing`."""

    def __init__(self, driver: Any, missing: str) -> None:
        self._driver, self._missing = driver, missing

    def __getattr__(self, name: str) -> Any:
        if name == self._missing:
            raise AttributeError(name)
        return getattr(self._driver, name)


@pytest.mark.parametrize("config", ["full", "connector"])
def test_kvcache_driver_is_one(config):
    side = get_target("kvcache").build(builtin_config(config), "scheduler")
    assert isinstance(side.scheduler, SchedulerDriver)
    assert isinstance(_Without(side.scheduler, "no such member"), SchedulerDriver)


def test_the_members_are_the_protocols():
    assert set(MEMBERS) == {name for name in vars(SchedulerDriver) if not name.startswith("_")}


@pytest.mark.parametrize("member", MEMBERS)
def test_a_driver_without_a_member_is_not_one(member):
    side = get_target("kvcache").build(builtin_config("full"), "scheduler")
    assert not isinstance(_Without(side.scheduler, member), SchedulerDriver)
