"""Recurrent-state groups in mamba_cache_mode "align" (docs/spec.md §11.3): the worked examples
in kvcache, the same calls as a trace that kvcache and the model run in lockstep, and the
refusals."""

from __future__ import annotations

import pytest

from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.errors import ConfigError
from kvfuzz.core.trace import Trace
from kvfuzz.harness.executor import run_trace
from kvfuzz.kvcache import FullAttentionSpec, MambaSpec
from kvfuzz.kvcache.block_math import get_mamba_prefill_checkpoint_position
from kvfuzz.kvcache.scheduler import mamba_block_aligned_split

from kvcache_testkit import free_ids, make_manager, make_request, table_ids

ALIGN_CONFIGS = ["qwen3_5_align", "qwen3_next_eagle", "nemotron_h_align", "granite4",
                 "mamba_align", "swa_mamba_align", "swa_mamba_align_fine", "qwen3_5_retention"]


def _align(block_size: int, speculative: int = 0) -> MambaSpec:
    return MambaSpec(block_size=block_size, mamba_cache_mode="align",
                     num_speculative_blocks=speculative)


def _ids(blocks) -> list[list[int]]:
    return [list(g) for g in blocks.get_block_ids()]


def test_a_state_hit_at_a_block_end_waits_for_the_next_step():
    """bs 4, one group: A computes 8 of its 10 tokens, so position 1 holds the state at 8 and
    gets its key. B, the same prompt, hits it (8 tokens), but not in the step that wrote it."""
    manager = make_manager(16, _align(4))
    prompt = list(range(10))
    a = make_request("a", prompt, 4)
    assert _ids(manager.allocate_slots(a, 8)) == [[0, 1]]
    a.num_computed_tokens = 8
    b = make_request("b", prompt, 4)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == 8 and _ids(hit) == [[0, 1]]
    assert manager.allocate_slots(b, 2, num_hit, hit) is None  # written this step
    manager.new_step_starts()
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert _ids(manager.allocate_slots(b, 2, num_hit, hit)) == [[2]]
    assert table_ids(manager, "b") == [[0, 1, 2]]
    # A goes on: position 2 takes its state; once 10 are computed, position 1 is passed.
    assert _ids(manager.allocate_slots(a, 2)) == [[3]]
    a.num_computed_tokens = 10
    assert _ids(manager.allocate_slots(a, 1)) == [[]]
    assert table_ids(manager, "a") == [[0, 0, 3]]


def test_a_sub_block_hit_copies_on_write_and_the_producer_moves_its_entry():
    """Full attention and state groups of bs 8, hash blocks of 2 (sub-block hits on). A's
    11-token prompt ends its prefill at the last hash boundary, 10, inside state block 1 (its
    own partial-hit record). B hits at 10 and copies both shared tail blocks; A's next step
    moves its state's key to a private copy, since A writes on in block 3."""
    manager = make_manager(40, FullAttentionSpec(block_size=8), _align(8), hash_block_size=2)
    assert manager.coordinator.enable_partial_hash_hits
    prompt = list(range(11))
    a = make_request("a", prompt, 2)
    assert _ids(manager.allocate_slots(a, 10)) == [[1, 2], [0, 3]]
    a.num_computed_tokens = 10
    state = manager.coordinator.single_type_managers[1]
    assert {r: (i, b.block_id) for r, (i, b) in state._partial_hit_reqs.items()} == {"a": (1, 3)}
    assert state.num_cached_block["a"] == 1
    manager.new_step_starts()
    b = make_request("b", prompt + [5], 2)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == 10 and _ids(hit) == [[1, 2], [0, 3]]
    assert _ids(manager.allocate_slots(b, 2, num_hit, hit)) == [[4], [5]]
    assert table_ids(manager, "b") == [[1, 4], [0, 5]]
    copies, retained = manager.take_kv_cache_block_copies()
    assert [(c[0], c[1]) for c in copies] == [(2, 4), (3, 5)]
    manager.block_pool.free_blocks(retained)
    assert _ids(manager.allocate_slots(a, 1)) == [[], []]
    assert table_ids(manager, "a") == [[1, 2], [0, 3]]
    copies, retained = manager.take_kv_cache_block_copies()
    assert [(c[0], c[1]) for c in copies] == [(3, 6)]
    assert manager.block_pool.blocks[3].block_hash is None
    assert manager.block_pool.blocks[6].block_hash is not None
    manager.block_pool.free_blocks(retained)
    assert 6 in free_ids(manager.block_pool)  # cached, evictable, holding the state at 10


def test_speculative_blocks_move_to_the_end_of_the_table():
    """bs 4, 1 speculative block: a 4-token chunk takes [state, draft]; a chunk to 16 leaves
    the draft block behind the new state position, so it moves to the end."""
    manager = make_manager(16, _align(4, 1))
    request = make_request("r", list(range(20)), 4)
    assert _ids(manager.allocate_slots(request, 4)) == [[1, 2]]
    request.num_computed_tokens = 4
    assert _ids(manager.allocate_slots(request, 12)) == [[0, 2, 3]]
    assert table_ids(manager, "r") == [[1, 0, 0, 2, 3]]


def _trace(config: Config, ops: list[dict]) -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": "api",
                            "config": config.to_dict(), "ops": ops})


@pytest.mark.parametrize("name", ALIGN_CONFIGS)
def test_align_configs_run_clean_on_kvcache_and_the_model(name):
    """Shared prompts, chunks ending on and off hash boundaries, new steps in between."""
    config = BUILTIN[name][1]
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    ops: list[dict] = []
    for i in range(3):
        rid = f"r{i}"
        ops += [{"op": "add_request", "request_id": rid, "prompt": prompt + [i] * i,
                 "max_tokens": 3},
                {"op": "get_computed_blocks", "request_id": rid},
                {"op": "allocate_slots", "request_id": rid, "num_new_tokens": 4 + i,
                 "use_lookup": True},
                {"op": "take_kv_cache_block_copies"},
                {"op": "new_step_starts"},
                {"op": "allocate_slots", "request_id": rid, "num_new_tokens": 1},
                {"op": "release_copies"}]
    result = run_trace(_trace(config, ops), ["kvcache"])
    assert result.passed, result.finding


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(groups=(GroupConfig("full", 4), GroupConfig("mamba", 6, mamba_cache_mode="align")),
              hash_block_size=4),
         "not a multiple of hash_block_size"),
    ],
)
def test_config_refuses_align_mixes(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        Config(8, **kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "group, needle",
    [
        (GroupConfig("mamba", 4, num_prefill_checkpoint_blocks=-1),
         "groups[0].num_prefill_checkpoint_blocks"),
        (GroupConfig("mamba", 4, prefill_checkpoint_alignment=0),
         "groups[0].prefill_checkpoint_alignment"),
        (GroupConfig("full", 4, num_prefill_checkpoint_blocks=1), "mamba settings"),
        (GroupConfig("full", 4, prefill_checkpoint_alignment=1), "mamba settings"),
    ],
)
def test_config_refuses_prefill_checkpoint_settings(group, needle):
    with pytest.raises(ConfigError) as err:
        Config(8, groups=(group,))
    assert needle in str(err.value)


def test_prefill_checkpoint_settings_are_accepted_and_unread_in_mode_none():
    """vLLM's Mamba2 layers declare a checkpoint block in every mode; only "align" reads it."""
    group = GroupConfig("mamba", 4, num_prefill_checkpoint_blocks=1,
                        prefill_checkpoint_alignment=1)
    assert Config(8, groups=(group,), enable_caching=False).groups == (group,)


@pytest.mark.parametrize("num_tokens, eagle, expected", [
    (11, False, 10), (12, False, 10), (11, True, 8), (12, True, 10), (3, True, 0), (1, False, 0),
])
def test_checkpoint_position_steps_down_a_hash_block_with_eagle(num_tokens, eagle, expected):
    """vLLM's rule: below `num_tokens - 1`, or with EAGLE one hash block below the aligned
    count (EAGLE recomputes that block anyway)."""
    assert get_mamba_prefill_checkpoint_position(num_tokens, 2, eagle) == expected


@pytest.mark.parametrize("use_eagle, first_chunk", [(False, 8), (True, 10)])
def test_with_eagle_the_prefill_chunk_stops_at_the_eagle_checkpoint(use_eagle, first_chunk):
    """bs 8, hash blocks of 2, a 13-token prompt in one budget: without EAGLE the chunk stops
    at the last cacheable block end, 8; with EAGLE that end is 0 and it stops at the prompt's
    checkpoint, 10."""
    assert mamba_block_aligned_split(0, 13, 13, 13, 8, 2, True, 64, use_eagle) == first_chunk


@pytest.mark.parametrize("junction, chunk", [
    (0, 32),   # no junction: the chunk ends on its last block end (the budget's 32)
    (28, 24),  # 28 floored to a whole block from the start
    (5, 32),   # less than a block past the start: no stop
    (32, 32),  # at the chunk's end, not inside it
])
def test_a_prefill_chunk_stops_at_the_junction_floored_to_a_block(junction, chunk):
    """bs 8, hash blocks of 2, a 40-token prompt, a budget of 32 from token 0 (§11.3)."""
    assert mamba_block_aligned_split(0, 32, 40, 40, 8, 2, True, 32, junction=junction) == chunk


def test_the_driver_splits_on_a_pool_that_does_not_hash_ahead():
    """vLLM 0.32's BlockPool has no `num_hash_lookahead_tokens`: kvcache's driver, run on that
    manager (target `vllm`), splits a Mamba chunk as with no lookahead."""
    from types import SimpleNamespace

    from kvfuzz.kvcache.scheduler import Scheduler

    driver = SimpleNamespace(
        manager=SimpleNamespace(coordinator=SimpleNamespace(scheduler_block_size=8),
                                block_pool=SimpleNamespace(hash_block_size=2)),
        token_budget=32, use_eagle=False, prefill_checkpoint_alignment=None,
        _exact_junction=False)
    request = SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=40, num_tokens=40,
                              shared_prefix_boundary=28)
    assert Scheduler._mamba_aligned(driver, request, 32, 0) == 24  # type: ignore[arg-type]


def test_a_chunk_exporting_its_checkpoint_still_stops_at_the_junction():
    """bs 8, hash blocks of 4, checkpoint alignment 1 (nemotron_h_checkpoint): the whole
    40-token prompt in one chunk exports the state at 36 mid-chunk and is left whole, unless a
    junction at 28 lies inside it: then it stops at 24 (§11.6)."""
    split = (0, 40, 40, 40, 8, 4, True, 64, False, 1)
    assert mamba_block_aligned_split(*split) == 40
    assert mamba_block_aligned_split(*split, junction=28) == 24


@pytest.mark.parametrize("use_eagle, cached_at", [(False, 12), (True, 10)])
def test_with_eagle_the_prompt_state_is_cached_at_eagles_replay_boundary(use_eagle, cached_at):
    """Full attention and a state group of bs 8, hash blocks of 2, a 13-token prompt: the
    prompt's state checkpoint is 12, or with EAGLE 10, where a prefill chunk is cut and the
    state gets its key (inside block 1: a partial-hit record on the producer)."""
    manager = make_manager(40, FullAttentionSpec(block_size=8), _align(8), hash_block_size=2,
                           use_eagle=use_eagle)
    state = manager.coordinator.single_type_managers[1]
    assert state.drop_eagle_checkpoint_block is use_eagle
    a = make_request("a", list(range(13)), 2)
    assert manager.allocate_slots(a, cached_at) is not None
    assert {r: i for r, (i, _) in state._partial_hit_reqs.items()} == {"a": 1}
    assert state.req_to_blocks["a"][1].block_hash_num_tokens == cached_at


def test_partial_hits_follow_vllms_rule():
    """A state block larger than the hash block turns sub-block hits on, unless a group that
    cannot look up below its block (sliding window) has a block larger than the hash block."""
    assert BUILTIN["qwen3_5_align"][1].partial_hash_hits
    assert not BUILTIN["swa_mamba_align"][1].partial_hash_hits
    assert not BUILTIN["mamba_align"][1].partial_hash_hits


def test_a_moved_state_entry_emits_no_kv_event():
    """vLLM's move_block_hashes keeps the entries live: no BlockRemoved, no BlockStored."""
    manager = make_manager(40, FullAttentionSpec(block_size=8), _align(8), hash_block_size=2,
                           enable_kv_cache_events=True)
    a = make_request("a", list(range(11)), 2)
    assert manager.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    assert manager.take_events()
    manager.new_step_starts()
    assert manager.allocate_slots(a, 1) is not None
    assert manager.take_kv_cache_block_copies()[0]  # the move happened
    assert manager.take_events() == []


@pytest.mark.parametrize("level", ["api", "scheduler"])
def test_campaigns_reach_every_align_path(tmp_path, monkeypatch, level):
    """Generated traces on the align configs adopt state hits, copy them on write, move a
    producer's entry, defer a same-step hit and (API level) move draft blocks."""
    from kvfuzz.fuzz.campaign import Campaign, CampaignOptions
    from kvfuzz.kvcache.single_type_kv_cache_manager import MambaManager

    reached: set[str] = set()
    for name in ("_apply_cow", "_move_cached_state", "_relocate_speculative_block",
                 "get_num_blocks_to_allocate"):
        original = getattr(MambaManager, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            value = _original(self, *args, **kwargs)
            if _name != "get_num_blocks_to_allocate":
                reached.add(_name)
            elif value == self.block_pool.num_gpu_blocks + 1:
                reached.add("deferred")
            return value

        monkeypatch.setattr(MambaManager, name, spy)
    Campaign(CampaignOptions(target="kvcache", seconds=None, examples=300, seed=0,
                             corpus=tmp_path, configs=("qwen3_5_align", "granite4"),
                             levels=(level,))).run()
    expected = {"_apply_cow", "_move_cached_state", "deferred"}
    if level == "api":
        expected.add("_relocate_speculative_block")
    assert expected <= reached
