"""`kvfuzz.testing.assert_invariants` judges every group kind by its own rules: the groups it
reads off a live manager's specs are the config's, a valid run on every built-in config passes
it op after op, and a broken pool fails it on every kind."""

import pytest

from kvfuzz.core.configs import BUILTIN, builtin_config
from kvfuzz.fuzz.generator import run_example
from kvfuzz.harness.spot_check import _config_of
from kvfuzz.testing import assert_invariants, kvcache_manager

ONE_PER_KIND = {}
for _name, (_, _config) in BUILTIN.items():
    for _group in _config.groups:
        ONE_PER_KIND.setdefault(_group.kind, _name)


def test_every_kind_has_a_builtin_config() -> None:
    from kvfuzz.core.config import GROUP_KINDS

    assert set(ONE_PER_KIND) == set(GROUP_KINDS)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_groups_read_off_the_specs(name: str) -> None:
    config = builtin_config(name)
    read = _config_of(kvcache_manager(config))
    assert read.groups == config.groups


def _side(execution):
    return execution.targets[0].side


@pytest.mark.parametrize("name", sorted(set(ONE_PER_KIND.values()) | {"bert", "colqwen3_5",
                                                                      "full_ring"}))
def test_valid_runs_pass_on_every_kind(name: str) -> None:
    """Generated api-level runs on kvcache (which campaigns find clean) pass the spot check
    after every op. Partial hits keep copies the caller must pass as `retained`: not here."""
    config = builtin_config(name)
    if config.partial_hits:
        config = type(config)(**{**config.__dict__, "partial_hits": False})
    checked = 0

    def check(execution, before) -> None:
        nonlocal checked
        side = _side(execution)
        assert_invariants(side.manager, requests=list(side.requests.values()))
        checked += 1

    for seed in range(6):
        data = bytes((seed * 37 + i * 11) % 256 for i in range(2000))
        run_example(data, config, "api", steps=25, targets=("kvcache",), on_op=check,
                    vary=False)
    assert checked > 10


def test_whole_prompt_admit_on_encoder_only() -> None:
    """The issue's case: a valid whole-prompt admit on `bert` raised I17."""
    from kvfuzz.kvcache import Request, RequestStatus

    manager = kvcache_manager("bert")
    request = Request("a", list(range(40)), max_tokens=1)
    request.status = RequestStatus.RUNNING
    assert manager.allocate_slots(request, 40) is not None
    assert_invariants(manager, requests=[request])


@pytest.mark.parametrize("kind", sorted(ONE_PER_KIND))
def test_a_leak_fails_on_every_kind(kind: str) -> None:
    manager = kvcache_manager(ONE_PER_KIND[kind])
    block = manager.block_pool.free_block_queue.popleft()  # held by no one, not free: a leak
    block.ref_cnt = 1
    with pytest.raises(AssertionError, match=r"\[P2\]"):
        assert_invariants(manager)


def test_an_unknown_spec_is_named() -> None:
    manager = kvcache_manager("full")

    class MySpec:
        block_size = 4

    manager.coordinator.single_type_managers[0].kv_cache_spec = MySpec()
    with pytest.raises(TypeError, match="MySpec"):
        assert_invariants(manager)


def test_readme_example_runs() -> None:
    """README's spot-check example, as it stands."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(from kvfuzz.kvcache import Request, RequestStatus\n.*?)```",
                     readme.replace("\n  ", "\n"), re.S).group(1)
    space: dict = {}
    exec(compile(code, "README.md", "exec"), space)
    space["test_encoder_only_admit"]()
