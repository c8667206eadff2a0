"""The four mission properties P1-P4 (the reasons kvfuzz exists), I8's capacity margin, and P5.

P1 predictor exactness, P2 no leaks, P3 ref_cnt == 0 exactly in the free queue, P4 the pool's
"Cannot get N free blocks" ValueError is unreachable through allocate_slots. P5 is P1's twin for
the prefix-cache probe vLLM 0.34 added: `get_num_cached_tokens` answers what the lookup it
predicts hits, and changes nothing.
"""

from __future__ import annotations

from kvfuzz.core.snapshot import Snapshot
from kvfuzz.properties.registry import CheckContext, invariant, transition


@transition(
    "P1",
    "predictor exactness: on every allocate_slots that returns blocks the free-count drop "
    "equals the layer-1 prediction, and each group takes exactly what its "
    "get_num_blocks_to_allocate returned",
    covers=("I8", "bugs #2", "bugs #5", "bugs #21"),
)
def predictor_exact(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for probe in ctx.observations.allocations:
        if probe.outcome != "blocks" or probe.prediction is None:
            continue
        taken = probe.free_before - probe.free_after
        if taken != probe.prediction:
            return (
                f"allocate_slots({probe.request_id!r}) predicted {probe.prediction} blocks but "
                f"the free count fell by {taken} ({probe.free_before} -> {probe.free_after})"
            )
        for g, (predicted, took) in enumerate(zip(probe.group_predictions, probe.group_taken)):
            if predicted != took:
                return (
                    f"allocate_slots({probe.request_id!r}): group {g} predicted {predicted} "
                    f"blocks but took {took}"
                )
    return None


@invariant(
    "P2",
    "no leaks: every non-null block is free or held, its ref_cnt equals its holders (request "
    "tables plus pending and retained copy endpoints), and with nothing held N-1 blocks are free",
    covers=("I2", "I4", "bugs #1", "bugs #10", "bugs #22"),
)
def no_leaks(s: Snapshot, ctx: CheckContext) -> str | None:
    holders = s.holders()
    if holders[1:] != list(s.ref_cnt[1:]):  # the common case in one comparison
        for b in range(1, s.num_blocks):
            if s.ref_cnt[b] != holders[b]:
                return f"block {b} has ref_cnt {s.ref_cnt[b]} but {holders[b]} holders"
    if not any(holders) and s.num_free_blocks != s.num_blocks - 1:
        return (
            f"nothing is held but {s.num_free_blocks} of {s.num_blocks - 1} blocks are free"
        )
    return None


@invariant(
    "P3",
    "ref_cnt == 0 exactly when the block is in the free queue; the null block never is",
    covers=("I1", "bugs #1", "bugs #12"),
)
def zero_iff_free(s: Snapshot, ctx: CheckContext) -> str | None:
    free = s.free_set()
    if 0 in free:
        return "the null block 0 is in the free queue"
    if free == {b for b, count in enumerate(s.ref_cnt) if count == 0 and b}:
        return None
    for b in range(1, s.num_blocks):
        in_queue = b in free
        if (s.ref_cnt[b] == 0) != in_queue:
            where = "in" if in_queue else "not in"
            return f"block {b} has ref_cnt {s.ref_cnt[b]} and is {where} the free queue"
    return None


@transition(
    "P4",
    "the layer-4 'Cannot get N free blocks' ValueError is never raised through allocate_slots "
    "or a scheduler step",
    covers=("I8", "bugs #2", "bugs #5"),
)
def no_pool_shortage(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    if ctx.observations.pool_shortages:
        return f"BlockPool.get_new_blocks raised: {ctx.observations.pool_shortages[0]}"
    return None


@transition(
    "I8",
    "capacity margin: an allocate_slots that returns blocks leaves reserved_blocks free, plus "
    "the watermark when it admits a waiting or preempted request beside scheduled ones",
    covers=("I8", "bugs #20", "spec §10.19"),
)
def capacity_margin(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    watermark = int(ctx.config.watermark * ctx.config.num_blocks)
    for probe in ctx.observations.allocations:
        if probe.outcome != "blocks" or probe.free_after is None:
            continue
        margin = probe.reserved_blocks + (watermark if probe.admission else 0)
        if probe.free_after < margin:
            return (
                f"allocate_slots({probe.request_id!r}) left {probe.free_after} blocks free, "
                f"below its margin of {margin} (reserved {probe.reserved_blocks}"
                f"{f', watermark {watermark}' if probe.admission else ''})"
            )
    return None


@transition(
    "P5",
    "probe agreement: get_num_cached_tokens equals the hit get_computed_blocks gives in the same "
    "state (the per-request hit limit included), and the probe changes no state",
    covers=("spec §6.3",),
)
def cached_tokens_probe_agrees(before: Snapshot, after: Snapshot, ctx: CheckContext) -> str | None:
    for probe in ctx.observations.cached_token_probes:
        if probe.num_cached_tokens != probe.lookup_hit:
            return (
                f"get_num_cached_tokens({probe.request_id!r}) = {probe.num_cached_tokens}, but "
                f"get_computed_blocks hits {probe.lookup_hit} tokens"
            )
    if ctx.op["op"] == "get_num_cached_tokens" and before != after:
        return f"get_num_cached_tokens({ctx.op['request_id']!r}) changed the manager's state"
    return None
