"""vLLM's Scheduler, played as kvfuzz's driver, is a `SchedulerDriver` by declaration
(harness/scheduler_driver.py; kvfuzz's own: tests/harness/test_scheduler_driver.py).

Run with the venv of ci/install-vllm.sh:  "$py" -m pytest -m vllm tests/vllm -q
"""

import pytest

from kvfuzz.core.configs import builtin_config
from kvfuzz.harness.scheduler_driver import SchedulerDriver
from kvfuzz.harness.targets import get_target
from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]


@pytest.mark.parametrize("target,config", [("vllm-scheduler", "full"),
                                           ("vllm-scheduler", "connector"),
                                           ("vllm-async-scheduler", "full")])
def test_vllm_driver_is_one(target, config):
    driver = get_target(target).build(builtin_config(config), "scheduler").scheduler
    assert SchedulerDriver in type(driver).__mro__
    assert isinstance(driver, SchedulerDriver)
    assert driver.sync_loaded == {} and driver.pending_tokens("r") == 0
