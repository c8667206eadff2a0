"""The campaign generator: bytes decide every op, swarms leave features out, focus weighs them,
pairs whose coverage grows get more batches, and batches build nothing that accumulates."""

from __future__ import annotations

import gc
import random
from collections import Counter
from dataclasses import replace

from kvfuzz.core.configs import builtin_config
from kvfuzz.fuzz.campaign import (FOCUS_WEIGHT, GROWTH_GAIN, Campaign, CampaignOptions,
                                  campaign_pairs, pair_weight)
from kvfuzz.fuzz.generator import (MAX_BURST, MAX_OUTPUTS, ApiRules, SchedulerRules, Swarm,
                                   focus_features, run_example)
from kvfuzz.fuzz.strategies import SPECULATIVE_BLOCKS, BytesChoices, vary_config
from kvfuzz.harness.executor import Execution, run_trace


def _example(data: bytes, level: str = "api", config: str = "hybrid", **kwargs):
    return run_example(data, builtin_config(config), level, steps=40, targets=("kvcache",),
                       **kwargs)


def _bytes(seed: int, size: int = 1024) -> bytes:
    return random.Random(seed).randbytes(size)


def test_the_same_bytes_give_the_same_trace_which_replays():
    for level in ("api", "scheduler"):
        first, again = _example(_bytes(1), level), _example(_bytes(1), level)
        assert first.trace.ops and first.trace.ops == again.trace.ops
        assert first.trace.config == again.trace.config
        assert first.trace.ops != _example(_bytes(2), level).trace.ops
        assert run_trace(first.trace, ["kvcache"]).passed


def test_an_example_ends_when_its_bytes_run_out():
    assert _example(b"") is None
    short = _example(_bytes(3, 40))
    assert short is not None and len(short.trace.ops) < len(_example(_bytes(3)).trace.ops)


def _ops(rules_class, swarm: Swarm, seeds: range, focus=frozenset()) -> Counter:
    counts: Counter = Counter()
    for seed in seeds:
        execution = Execution(builtin_config("full"), rules_class.level, ("kvcache",))
        rules = rules_class(execution, BytesChoices(_bytes(seed, 4096)), swarm=swarm,
                            focus=focus)
        rules.start()
        for _ in range(60):
            if not rules.run_one():
                break
        counts.update(op["op"] for op in execution.trace.ops)
        if "lookahead" in swarm.off:
            assert all(op.get("num_lookahead_tokens", 0) == 0 for op in execution.trace.ops)
    return counts


def test_a_swarm_leaves_out_its_rules_and_knobs():
    everything = _ops(ApiRules, Swarm(), range(20))
    assert everything["free"] and everything["append_tokens"]
    without = _ops(ApiRules, Swarm(frozenset({"free", "misuse", "sample", "lookahead"})),
                   range(20))
    assert without["free"] == 0 and without["append_tokens"] == 0 and without["allocate_slots"]
    assert _ops(SchedulerRules, Swarm(frozenset({"abort"})), range(10))["abort"] == 0


def test_swarms_vary_per_example_and_keep_the_core_and_focused_rules():
    swarms = [ApiRules.draw_swarm(BytesChoices(_bytes(s, 64))) for s in range(400)]
    assert 0.4 < sum(not s.off for s in swarms) / len(swarms) < 0.7
    assert set().union(*(s.off for s in swarms)) == set(ApiRules.features())
    assert max(len(s.off) for s in swarms) >= 3
    assert not any(s.off & ApiRules.CORE for s in swarms)
    # Knobs are left out at a quarter of the rules' rate.
    rules = [r for r in ApiRules.features() if r not in ApiRules.KNOBS]
    rule_off = sum(len(s.off & set(rules)) for s in swarms) / len(rules)
    knob_off = sum(len(s.off & set(ApiRules.KNOBS)) for s in swarms) / len(ApiRules.KNOBS)
    assert 2 < rule_off / knob_off < 8
    kept = [ApiRules.draw_swarm(BytesChoices(_bytes(s, 64)), keep={"free"}) for s in range(200)]
    assert not any("free" in s.off for s in kept)


def test_speculative_blocks_vary_alike_in_every_state_group_and_only_where_set():
    seen = set()
    for seed in range(40):
        groups = vary_config(BytesChoices(_bytes(seed, 64)), builtin_config("qwen3_5")).groups
        counts = {g.num_speculative_blocks for g in groups if g.kind == "mamba"}
        assert len(counts) == 1 and not any(g.num_speculative_blocks for g in groups
                                            if g.kind != "mamba")
        seen |= counts
    assert seen == set(SPECULATIVE_BLOCKS)
    for seed in range(10):
        groups = vary_config(BytesChoices(_bytes(seed, 64)), builtin_config("jamba")).groups
        assert not any(g.num_speculative_blocks for g in groups)


def test_a_varied_speculative_count_replays_on_kvcache_and_the_model():
    counts = set()
    for seed in range(6):
        ex = _example(_bytes(seed), "scheduler", "qwen3_5_align")
        counts |= {g.num_speculative_blocks for g in ex.trace.config.groups if g.kind == "mamba"}
        assert run_trace(ex.trace, ["kvcache"]).passed
    assert len(counts) > 1


def test_an_example_whose_swarm_keeps_everything_is_the_same_without_swarm_testing():
    same = 0
    for seed in range(12):
        data = _bytes(seed)
        on, off = _example(data, swarm=True), _example(data, swarm=False)
        choices = BytesChoices(data)
        vary_config(choices, builtin_config("hybrid"))
        if not ApiRules.draw_swarm(choices).off:
            assert on.trace.ops == off.trace.ops
            same += 1
    assert same


def test_focus_on_an_op_makes_more_of_it():
    plain = _ops(ApiRules, Swarm(), range(20))
    focused = _ops(ApiRules, Swarm(), range(20), focus=focus_features(["evict_blocks"]))
    assert focused["evict_blocks"] > 1.5 * plain["evict_blocks"]


def _picks(options: CampaignOptions, growth: dict, batches: int) -> list:
    """The pairs of the first `batches` batches of a time-budgeted campaign's schedule, with
    the weights its driver gives after a batch of `growth` new features per pair."""
    schedule = Campaign(options).schedule
    picks = [schedule.next_batch().pair for _ in schedule.pairs]
    for pair in schedule.pairs:
        schedule.weights[pair] = pair_weight(options, pair, growth.get(pair, 0))
    return picks + [schedule.next_batch().pair for _ in range(batches - len(picks))]


def test_every_pair_comes_first_then_growing_and_focused_pairs_get_more(tmp_path):
    options = CampaignOptions(seconds=60, configs=("full", "watermark"), corpus=tmp_path)
    pairs = campaign_pairs(options)
    assert _picks(options, {}, len(pairs)) == pairs
    later = Counter(_picks(options, {pairs[2]: 30}, 400)[len(pairs):])
    others = [later[p] for p in pairs if p != pairs[2]]
    # The growing pair gets GROWTH_GAIN more; no pair falls below 1/(1 + GROWTH_GAIN) of its
    # even share.
    assert 1.1 < later[pairs[2]] / (sum(others) / len(others)) < 1.3
    assert min(others) >= 396 / len(pairs) / (1 + GROWTH_GAIN)
    assert pair_weight(options, pairs[0], 5) < pair_weight(options, pairs[0], 10) == 1.2
    focused = replace(options, focus=("watermark",), weighting=False)
    picks = Counter(p[1] for p in _picks(focused, {pairs[0]: 30}, 800)[len(pairs):])
    assert 0.6 * FOCUS_WEIGHT < picks["watermark"] / picks["full"] < 1.5 * FOCUS_WEIGHT
    plain = replace(options, weighting=False)
    assert _picks(plain, {pairs[0]: 30}, 12) == pairs * 3


def test_only_a_pairs_first_batch_keeps_every_feature(tmp_path):
    schedule = Campaign(CampaignOptions(seconds=60, configs=("full", "watermark"),
                                        corpus=tmp_path)).schedule
    batches = [schedule.next_batch() for _ in range(12)]
    assert [b.first for b in batches] == [True] * 4 + [False] * 8


def test_batches_create_no_classes(tmp_path):
    """The old engine built a state-machine class per batch, which Hypothesis kept."""

    def classes() -> int:
        gc.collect()
        return sum(isinstance(o, type) for o in gc.get_objects())

    options = dict(seconds=None, configs=("full",), levels=("api",), corpus=tmp_path, steps=5)
    Campaign(CampaignOptions(examples=30, **options)).run()
    before = classes()
    Campaign(CampaignOptions(examples=300, **options)).run()
    assert classes() == before


def test_sliding_window_connector_configs_draw_whole_short_and_failed_loads():
    """docs/spec.md §13.2 on the window configs: every kind of load end, and each example
    passes three-way on kvcache and the model."""
    for name in ("gpt_oss_connector", "mistral_connector"):
        ends: Counter = Counter()
        for seed in range(12):
            example = _example(_bytes(seed, 4096), "scheduler", name)
            if example is None:
                continue
            assert run_trace(example.trace, ["kvcache"]).passed
            for op in example.trace.ops:
                if op["op"] == "finish_load":
                    loaded = op["num_loaded_tokens"]
                    ends["whole" if loaded is None else "failed" if loaded == 0 else "short"] += 1
        assert set(ends) == {"whole", "short", "failed"}, (name, ends)


def test_multimodal_inputs_reach_block_boundaries_and_follow_each_other():
    """mm_inputs puts inputs at block ends, ending at block ends, and a second one right after
    the first ended or at the next block end, always valid for the prompt."""
    from kvfuzz.core.extra_keys import Extras, extras_problem
    from kvfuzz.fuzz.strategies import mm_inputs

    drawn = [mm_inputs(BytesChoices(_bytes(s, 64)), 16, (4,)) for s in range(400)]
    for inputs in drawn:
        assert extras_problem(Extras(mm_inputs=tuple(map(tuple, inputs))), [0] * 16, {}) is None
    firsts = [inputs[0] for inputs in drawn if inputs]
    assert any(o and o % 4 == 0 for _, o, _ in firsts)
    assert any((o + n) % 4 == 0 and o % 4 for _, o, n in firsts)
    pairs = [inputs for inputs in drawn if len(inputs) == 2]
    assert any(b[1] == a[1] + a[2] and b[1] % 4 for a, b in pairs)
    assert any(b[1] > a[1] + a[2] and b[1] % 4 == 0 for a, b in pairs)


def test_scheduler_requests_arrive_in_bursts_with_long_outputs():
    """One `add_request` rule may add up to MAX_BURST requests at once (its first decision), each
    generating up to MAX_OUTPUTS tokens: enough overlap for the pool to run dry at the scheduler
    level (docs/mutation.md, the default-budget survivors)."""
    execution = Execution(builtin_config("watermark"), "scheduler", ("kvcache",))
    rules = SchedulerRules(execution, BytesChoices(bytes([MAX_BURST - 1]) + _bytes(0)))
    rules.add_request()
    assert [op["op"] for op in execution.trace.ops] == ["add_request"] * MAX_BURST
    drawn = {op["max_tokens"] for seed in range(20)
             for op in _example(_bytes(seed, 4096), "scheduler", "watermark").trace.ops
             if op["op"] == "add_request"}
    assert max(drawn) > 6 and max(drawn) <= MAX_OUTPUTS
