"""Draws steered to a config's own boundaries (kvfuzz.fuzz.boundaries): a watermark's admission
edge and a chunked-local group's chunk ends are reached in many more examples, each example
still valid and replayable, and a config without such a knob draws exactly as before."""

from __future__ import annotations

import random

import pytest

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz import boundaries, generator
from kvfuzz.fuzz.generator import run_example
from kvfuzz.fuzz.strategies import BytesChoices
from kvfuzz.harness.executor import Counterexample, Execution, run_trace

import kvfuzz.harness.mutants  # noqa: F401  (registers the bug:NAME targets)


def _bytes(seed: int) -> bytes:
    return random.Random(seed).randbytes(24 * 40 + 64)


def _found(plant: str, config: str, level: str, seeds: range) -> int:
    """Examples (one per seed) in which the plant is found."""
    found = 0
    for seed in seeds:
        try:
            run_example(_bytes(seed), builtin_config(config), level, steps=40,
                        targets=(f"bug:{plant}",))
        except Counterexample:
            found += 1
    return found


class NoDecisions:
    def below(self, n: int) -> int:
        raise AssertionError("a config without edges took a decision")


def test_edges_come_from_the_configs_own_knobs():
    assert not boundaries.edges(builtin_config("full"))
    assert not boundaries.edges(builtin_config("hybrid"))
    watermark = boundaries.edges(builtin_config("watermark"))
    assert (watermark.watermark_blocks, watermark.chunk) == (2, 0)  # int(0.1 * 20)
    assert boundaries.edges(builtin_config("chunked_local")).chunk == 8
    assert boundaries.edges(builtin_config("hybrid3")).chunk == 8


def test_a_config_without_edges_takes_no_decision_more():
    none = boundaries.edges(builtin_config("full"))
    views = [("r0", None)]
    assert boundaries.admission(NoDecisions(), none, 5, 0, 1, 9) is None
    assert boundaries.growth(NoDecisions(), none, 8, 4) is None
    assert boundaries.prompt_length(NoDecisions(), none, 5, 63) is None
    assert boundaries.promoted_tail_length(NoDecisions(), none, 9, 63) is None
    # Sub-block hits without a hash lookahead: a prompt's tail entry is keyed once, at prefill.
    assert boundaries.promoted_tail_length(NoDecisions(), boundaries.edges(
        builtin_config("partial_hits")), 9, 63) is None
    assert boundaries.at_chunk_end(NoDecisions(), none, views) is views


def test_an_admission_near_the_watermark_lands_on_both_sides_of_its_edge():
    edges = boundaries.edges(builtin_config("watermark"))  # 2 blocks of watermark, bs 4
    blocks = {boundaries.near_edge(BytesChoices(bytes([b])), edges, 10) for b in range(5)}
    assert blocks == {8, 9, 10, 11, 12}  # needed + 2 > 10 and needed - 2 <= 10 from 9 to 12
    steered = [boundaries.admission(BytesChoices(bytes([1, b])), edges, 10, 2, 1, 60)
               for b in range(5)]
    assert [s["num_new_tokens"] for s in steered] == [34, 38, 42, 46, 50]  # from token 4 on
    assert steered[0]["has_scheduled_reqs"] and not steered[0]["reserved_blocks"]


def test_a_chunked_local_growth_ends_on_a_chunk_end_then_asks_for_more_than_is_free():
    edges = boundaries.edges(builtin_config("chunked_local"))  # chunk 8, bs 4
    assert boundaries.growth(BytesChoices(bytes([1])), edges, 5, 20) == (3, 0)
    assert boundaries.growth(BytesChoices(bytes([1, 0])), edges, 8, 20) == (1, 64)
    assert boundaries.prompt_length(BytesChoices(bytes([1, 1])), edges, 5, 63) == 24
    ends = boundaries.at_chunk_end(BytesChoices(bytes([1])), edges,
                                   [("a", _View(5)), ("b", _View(16))])
    assert [rid for rid, _ in ends] == ["b"]


def test_a_prompt_is_cut_where_the_hash_lookahead_promotes_its_tail_block():
    """Full bs 8, hash blocks of 2 covering the next 2 tokens: a prompt's tail entry wants
    `P - 1` tokens (no EAGLE block is dropped with a hash lookahead), its prefill hashes
    `P - 2`; they differ for an odd `P`, and the block is promoted unless a boundary is a block
    end. Without the lookahead (EAGLE's drop instead) nothing is promoted."""
    mtp = boundaries.edges(builtin_config("qwen3_next_mtp"))
    assert (mtp.tail_block_size, mtp.hash_block_size, mtp.hash_lookahead) == (8, 2, 2)
    assert not mtp  # watermark and chunk steering stay off
    assert [n for n in range(1, 24) if boundaries.promotes_tail(n, mtp)] == [5, 7, 13, 15, 21, 23]
    eagle = boundaries.edges(builtin_config("qwen3_next_mtp_eagle"))
    assert eagle.tail_block_size == 0
    assert boundaries.promoted_tail_length(NoDecisions(), eagle, 12, 63) is None
    assert boundaries.promoted_tail_length(BytesChoices(bytes([1])), mtp, 12, 63) == 7
    assert boundaries.promoted_tail_length(BytesChoices(bytes([1])), mtp, 3, 63) == 5
    assert boundaries.promoted_tail_length(BytesChoices(bytes([0])), mtp, 12, 63) is None


def test_steering_finds_the_promoted_partial_key_plant_in_more_examples(monkeypatch):
    """vLLM 0.34.0's survivor S32 (`n * hbs` → `n - hbs`: a promoted block keeps its shorter
    partial key), planted in kvcache: 62 of 160 examples of `qwen3_next_mtp` (seeds 0-79,
    both levels) find it with steering, 29 without."""
    def found() -> int:
        return sum(_found("partial-promotion-keeps-key", "qwen3_next_mtp", level, range(80))
                   for level in ("api", "scheduler"))

    assert found() >= 52
    monkeypatch.setattr(generator.boundaries, "edges", lambda config: boundaries.Edges(0, 0, 1, 1))
    assert found() < 40


def test_a_checkpoint_prompt_puts_its_checkpoint_on_a_block_end_far_in():
    """Hash blocks of 2 (bs 8): without EAGLE the checkpoint is `(P - 1) // 2 * 2`, a block end
    for P = 8k + 1, 8k + 2; with EAGLE `P // 2 * 2 - 2`, for P = 8k + 2, 8k + 3. long_checkpoint
    (bs 64, hash blocks of 16, max_model_len 1024) puts it past token 256."""
    qwen = boundaries.edges(builtin_config("qwen3_5_checkpoint"))
    assert (qwen.checkpoint_block_size, qwen.checkpoint_unit) == (8, 2)
    assert not qwen  # watermark and chunk steering stay off
    assert boundaries._checkpoint_lengths(qwen, 63) == (33, 34, 41, 42, 49, 50, 57, 58)
    eagle = boundaries.edges(builtin_config("qwen3_next_checkpoint"))
    assert boundaries._checkpoint_lengths(eagle, 63)[:4] == (34, 35, 42, 43)
    assert boundaries.checkpoint_length(BytesChoices(bytes([1])), qwen, 12, 63) == 33
    assert boundaries.checkpoint_length(BytesChoices(bytes([1])), qwen, 35, 63) == 41
    assert boundaries.checkpoint_length(BytesChoices(bytes([1])), qwen, 63, 63) == 58
    assert boundaries.checkpoint_length(BytesChoices(bytes([0])), qwen, 12, 63) is None
    long = boundaries.edges(builtin_config("long_checkpoint"))
    assert boundaries.checkpoint_length(BytesChoices(bytes([1])), long, 12, 1023) == 321
    assert min(boundaries.checkpoint_position(n, long)
               for n in boundaries._checkpoint_lengths(long, 1023)) == 320
    for config in ("full", "qwen3_next_mtp", "qwen3_5_align"):  # no checkpoint blocks
        assert boundaries.checkpoint_length(NoDecisions(), boundaries.edges(
            builtin_config(config)), 12, 63) is None


def test_an_admission_stops_where_the_last_chunk_starts_next_to_the_checkpoint_column():
    """A 41-token prompt (bs 8) exports its checkpoint in column 4: its last chunk starts from
    the state in column 3 (token 32, valid) or in column 4 (token 40, just refused)."""
    qwen = boundaries.edges(builtin_config("qwen3_5_checkpoint"))
    assert boundaries.checkpoint_split(BytesChoices(bytes([1, 0])), qwen, 0, 41) == 32
    assert boundaries.checkpoint_split(BytesChoices(bytes([1, 1])), qwen, 8, 41) == 32
    assert boundaries.checkpoint_split(BytesChoices(bytes([1, 0])), qwen, 32, 41) is None
    assert boundaries.checkpoint_split(BytesChoices(bytes([0])), qwen, 0, 41) is None
    assert boundaries.checkpoint_split(NoDecisions(), boundaries.edges(
        builtin_config("qwen3_5_align")), 0, 41) is None


CHECKPOINT_CONFIGS = ("nemotron_h_checkpoint", "qwen3_5_checkpoint", "qwen3_5_checkpoint_replay",
                      "qwen3_next_checkpoint", "long_checkpoint")


def _last_chunks(config: str, seeds: range) -> list[list[tuple[int, int, int]]]:
    """Per example (api), the (start, end, checkpoint) of each chunk that ends a prefill and
    exports its checkpoint mid-chunk (vLLM's test, kvcache/block_math.py)."""
    from kvfuzz.kvcache.block_math import (
        get_mamba_prefill_checkpoint_position,
        is_mamba_prefill_checkpoint_valid,
    )

    base = builtin_config(config)
    bs, align = base.groups[1].block_size, base.prefill_checkpoint_alignment
    unit, eagle = base.alignment_tokens, base.use_eagle
    examples = []
    for seed in seeds:
        chunks: list[tuple[int, int, int]] = []

        def seen(execution: Execution, _before: object) -> None:
            op = execution.trace.ops[-1]
            view = execution.state.requests.get(op.get("request_id"))
            if op["op"] != "allocate_slots" or view is None:
                return
            end = view.num_computed_tokens
            start = end - op["num_new_tokens"]
            at = get_mamba_prefill_checkpoint_position(end, unit, eagle)
            if end == view.num_tokens and is_mamba_prefill_checkpoint_valid(
                    start, end, at, unit, bs, align):
                chunks.append((start, end, at))

        run_example(_bytes(seed), base, "api", steps=40, targets=("kvcache",),
                    allow_misuse=False, swarm=False, on_op=seen)
        examples.append(chunks)
    return examples


def _tight_far_checkpoints(config: str, seeds: range) -> int:
    """Examples with a last chunk at least 5 blocks long whose checkpoint column
    (`cdiv(end, bs) - 2`) lies right above the state it starts from."""
    bs = builtin_config(config).groups[1].block_size
    return sum(any(-(-end // bs) >= 5 and (start - 1) // bs == -(-end // bs) - 3
                   for start, end, _ in chunks) for chunks in _last_chunks(config, seeds))


def test_steering_exports_checkpoints_far_in_from_the_closest_state(monkeypatch):
    """vLLM 0.34.0's survivor S19 (`_needs_internal_checkpoint`'s column `cdiv(end, bs) - 2`
    → `// 2`) differs only for such a last chunk of 5 or 6 blocks: 35 of 100 api examples of
    the five checkpoint configs have one with steering, 3 without (seeds 0-19)."""
    def found() -> int:
        return sum(_tight_far_checkpoints(c, range(20)) for c in CHECKPOINT_CONFIGS)

    assert found() >= 25
    monkeypatch.setattr(generator.boundaries, "edges", lambda config: boundaries.Edges(0, 0, 1, 1))
    assert found() < 10


def test_steering_exports_checkpoints_on_block_ends_past_token_256(monkeypatch):
    """vLLM 0.34.0's survivor S39 (the checkpoint's re-key test `==` → `is`) differs only for
    a checkpoint on a block end (keyed already as a full block) past token 256: 20 of 40 api
    examples of long_checkpoint export one with steering, 3 without (seeds 0-39)."""
    def found() -> int:
        return sum(any(at > 256 and at % 64 == 0 for _, _, at in chunks)
                   for chunks in _last_chunks("long_checkpoint", range(40)))

    assert found() >= 12
    monkeypatch.setattr(generator.boundaries, "edges", lambda config: boundaries.Edges(0, 0, 1, 1))
    assert found() < 8


class _View:
    def __init__(self, computed: int) -> None:
        self.num_computed_tokens = computed


@pytest.mark.parametrize("config", ["watermark", "chunked_local", "hybrid3", "qwen3_next_mtp",
                                    "qwen3_5_checkpoint", "long_checkpoint"])
@pytest.mark.parametrize("level", ["api", "scheduler"])
def test_steered_examples_replay_and_pass_on_kvcache(config, level):
    for seed in range(8):
        example = run_example(_bytes(seed), builtin_config(config), level, steps=40,
                              targets=("kvcache",))
        again = run_example(_bytes(seed), builtin_config(config), level, steps=40,
                            targets=("kvcache",))
        assert example.trace.to_json() == again.trace.to_json()
        assert run_trace(example.trace, ["kvcache"]).passed


def test_steering_finds_the_watermark_survivors_plant_in_more_examples(monkeypatch):
    """vLLM 0.34.0's survivor #11 (`needed - watermark`), planted in kvcache: 24 of 40 api
    examples of `watermark` find it with steering, 6 without (seeds 0-39)."""
    assert _found("watermark-subtracted", "watermark", "api", range(40)) >= 16
    monkeypatch.setattr(generator.boundaries, "edges", lambda config: boundaries.Edges(0, 0, 1, 1))
    assert _found("watermark-subtracted", "watermark", "api", range(40)) < 16


def test_steering_finds_the_null_head_survivors_plant(monkeypatch):
    """vLLM 0.34.0's survivor #12 (`lo = mid + 2`), planted in kvcache: a chunked-local table
    of nulls alone, freed after a growth at a chunk end failed. 23 of 80 api examples of
    `chunked_local` and `hybrid3` find it with steering, none without (seeds 0-39)."""
    def found() -> int:
        return sum(_found("null-head-overshoot", c, "api", range(40))
                   for c in ("chunked_local", "hybrid3"))

    assert found() >= 16
    monkeypatch.setattr(generator.boundaries, "edges", lambda config: boundaries.Edges(0, 0, 1, 1))
    assert found() == 0


def test_a_scheduler_arrival_is_sized_past_the_prompts_waiting_ahead_of_it():
    """The driver admits waiting requests first, so a steered arrival's room is the pool's free
    blocks less the reserve and the waiting prompts' blocks (with `bug:watermark-subtracted`,
    vLLM's survivor #11 at `scheduler/watermark` was found in 13 of 80 examples so, 3 without)."""
    config = builtin_config("watermark")  # bs 4, a reserve of 1
    execution = Execution(config, "scheduler", ("kvcache",))
    rules = generator.SchedulerRules(execution, BytesChoices(b""))
    free = execution.state.num_free_blocks
    assert rules.arrival_room() == free - 1
    execution.apply({"op": "add_request", "request_id": "a", "prompt": [1] * 9, "max_tokens": 1})
    assert rules.arrival_room() == free - 1 - 3
    assert generator.ApiRules(Execution(config, "api", ("kvcache",)),
                              BytesChoices(b"")).arrival_room() == free - 1
