"""Bounds checked before a campaign starts (exit 2 naming the value, nothing run or written),
and a budget or a stop that holds inside an example (issue 40)."""

import time

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz import bounds
from kvfuzz.fuzz.campaign import BatchRunner, CampaignOptions
from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.schedule import Batch
from kvfuzz.harness.executor import Execution

HUGE = Config(1 << 20, (GroupConfig("full", 16),), name="huge", max_model_len=4096)


@pytest.mark.parametrize("argv, needle", [
    (["--workers", "100000"], "--workers 100000 is more than the"),
    (["--steps", "1000000000000"], "--steps 1000000000000 is more than a trace may hold"),
])
def test_workers_and_steps_beyond_the_machine_are_usage_errors(tmp_path, capsys, argv, needle):
    assert main(["run", *argv, "--corpus", str(tmp_path / "c")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_the_workers_cap_is_the_cpus_and_at_least_two():
    assert bounds.max_workers() >= 2
    bounds.check_workers(bounds.max_workers())
    with pytest.raises(bounds.OutOfBounds):
        bounds.check_workers(bounds.max_workers() + 1)


def test_a_pool_beyond_the_memory_or_the_time_is_refused():
    with pytest.raises(bounds.OutOfBounds, match=r"'huge': 1,048,576 blocks take about 3\.2 GiB "
                       r"\(1100 bytes a block in each of 3 process\(es\)\), more than the 2\.0 "
                       "GiB available"):
        bounds.check_configs([HUGE], workers=2, steps=40, seconds=None, memory=2 << 30)
    bounds.check_configs([HUGE], workers=1, steps=40, seconds=None, memory=2 << 30)
    with pytest.raises(bounds.OutOfBounds, match=r"an example of up to 40 steps on 1,048,576 "
                       r"blocks takes about 59 s .* more than --seconds 5"):
        bounds.check_configs([HUGE], workers=1, steps=40, seconds=5, memory=None)
    bounds.check_configs([HUGE], workers=1, steps=3, seconds=5, memory=1 << 40)


def test_a_config_file_beyond_the_time_budget_exits_two_before_building(tmp_path, capsys):
    (tmp_path / "huge.toml").write_text('num_blocks = 1048576\nmax_model_len = 16777216\n'
                                        '[[groups]]\nkind = "full"\nblock_size = 16777216\n')
    assert main(["run", "--config-file", str(tmp_path / "huge.toml"), "--seconds", "5",
                 "--corpus", str(tmp_path / "c")]) == 2
    assert "more than --seconds 5" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_execution_stops_before_every_op_and_check():
    calls = []
    execution = Execution(builtin_config("full"), "api", stop=lambda: calls.append(1))
    at_start = len(calls)
    assert at_start == len(execution.checks)  # the initial state's checks
    execution.apply({"op": "add_request", "request_id": "r", "prompt": [1, 2, 3]})
    assert len(calls) - at_start == 1 + len(execution.checks)


def test_a_batch_past_its_deadline_ends_at_the_next_op_not_interrupted():
    options = CampaignOptions(configs=("full",), levels=("api",), deadline=time.time() - 1)
    result = BatchRunner(options)(Batch(0, "api", "full", seed=1, examples=50, first=True))
    assert not result.interrupted and result.failure is None
    assert result.examples == 0 and result.operations == 0  # cut at its initial checks
