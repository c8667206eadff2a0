"""Hand-written traces for the data tests: each planted content bug, and the real hazards.

Each trace is minimal for its plant and passes every check on kvcache (tests assert that too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace

FULL = {"name": "full", "num_blocks": 16, "max_model_len": 64,
        "groups": [{"kind": "full", "block_size": 4}]}
TINY = dict(FULL, num_blocks=4)
CONNECTOR = dict(BUILTIN["connector"][1].to_dict(),
                 scheduler={"kv_load_failure_policy": "recompute"})
"""Full attention (block size 4) with a KV connector whose failing loads are recomputed."""
PARTIAL = {"name": "partial_hits", "num_blocks": 24, "max_model_len": 64, "partial_hits": True,
           "groups": [{"kind": "full", "block_size": 8},
                      {"kind": "sliding_window", "block_size": 4, "sliding_window": 4}]}
FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"

A8 = [1, 1, 1, 1, 2, 2, 2, 2]
"""Two blocks of bs 4 that later requests hit."""
P14 = [1, 2, 3, 0] * 3 + [1, 2]
"""14 tokens: under `partial_hits`, a partial entry at 12 inside full-attention block 1."""
Q14 = [1, 2, 3, 0] * 3 + [3, 3]
"""Shares P14's first 12 tokens and diverges inside the shared tail block."""


def trace(level: str, config: dict[str, Any], ops: list[dict[str, Any]]) -> Trace:
    return Trace.from_dict({"format": "kvfuzz-trace", "version": 1, "level": level,
                            "config": config, "ops": ops, "meta": {}})


def add(rid: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"op": "add_request", "request_id": rid, "prompt": prompt, **extra}


def alloc(rid: str, n: int, lookup: bool = False) -> list[dict[str, Any]]:
    """allocate_slots, preceded by its lookup when it adopts hits."""
    op = {"op": "allocate_slots", "request_id": rid, "num_new_tokens": n, "use_lookup": lookup}
    return ([{"op": "get_computed_blocks", "request_id": rid}] if lookup else []) + [op]


STEP = {"op": "step"}


@dataclass(frozen=True)
class Plant:
    """A planted bug on one trace: what the data layer says, and what else notices."""

    mutant: str
    level: str
    trace: Trace
    message: str
    """A fragment of D1's message."""
    structural: str | None
    """The first check of properties.REGISTRY that fails with the model off; None: none does."""
    with_model: str | None
    """The first check that fails with the reference model in lockstep; None: none does."""


PLANTS = [
    # Wrong prefix hit, every count right: I13 sees the wrong key in an API-level lookup
    # result; at the scheduler level lookups stay inside the driver and only the model and the
    # data notice.
    Plant("hit-swaps-block", "api", trace("api", FULL, [
        add("r0", A8), *alloc("r0", 8), add("r1", [3] * 8), *alloc("r1", 8),
        add("r2", A8 + [0]), *alloc("r2", 1, lookup=True),
    ]), "which holds what r1 (salt None) wrote for its position 0", "I13", "I13"),
    Plant("hit-swaps-block", "scheduler", trace("scheduler", FULL, [
        add("r0", A8, max_tokens=1), add("r1", [3] * 8, max_tokens=1), STEP,
        add("r2", A8 + [0]), STEP,
    ]), "which holds what r1 (salt None) wrote for its position 0", None, "DIFF-state"),
    # Missing copy-on-write: Q writes into the tail block it shares with P. No structural
    # check sees it (the predictor and the tables agree with themselves).
    Plant("cow-skipped", "api", trace("api", PARTIAL, [
        add("P", P14), *alloc("P", 14), add("Q", Q14), *alloc("Q", 2, lookup=True),
    ]), "P (salt None) reads group 0 position 12 through block 2, which holds what Q", None,
        "DIFF-result"),
    Plant("cow-skipped", "scheduler", trace("scheduler", PARTIAL, [
        add("P", P14), STEP, add("Q", Q14), STEP,
    ]), "P (salt None) reads group 0 position 12 through block 2, which holds what Q", None,
        "DIFF-result"),
    # Two live writers: the manager is right, the worker writes through the CoW source, which
    # P still uses. Invisible to every structural check and to the model.
    Plant("cow-redirect-late", "api", trace("api", PARTIAL, [
        add("P", P14), *alloc("P", 14), add("Q", Q14), *alloc("Q", 2, lookup=True),
    ]), "P (salt None) reads group 0 position 12 through block 2, which holds what Q", None,
        None),
    Plant("cow-redirect-late", "scheduler", trace("scheduler", PARTIAL, [
        add("P", P14), STEP, add("Q", Q14), STEP,
    ]), "P (salt None) reads group 0 position 12 through block 2, which holds what Q", None,
        None),
    # Late copy: the counts stay right (the held endpoints stay retained); only the step's
    # `copies` differ from the model's.
    Plant("copy-one-step-late", "scheduler", trace("scheduler", PARTIAL, [
        add("P", P14), STEP, add("Q", Q14), STEP,
    ]), "Q (salt None) reads group 0 position 8 through block 7, which was never written", None,
        "DIFF-result"),
    # Hash before KV (docs/bugs.md #6): r1 hits a block r0 has not finished. I11 would fire once r0
    # writes into its own cached block; the hitter reads first.
    Plant("cache-ahead-of-schedule", "api", trace("api", FULL, [
        add("r0", A8 + [3]), *alloc("r0", 6), add("r1", A8 + [0]), *alloc("r1", 1, lookup=True),
    ]), "r1 (salt None) reads group 0 position 6 through block 2, which was never written", None,
        "DIFF-state"),
    Plant("cache-ahead-of-schedule", "scheduler", trace(
        "scheduler", dict(FULL, scheduler={"token_budget": 6}),
        [add("r0", A8 + [3]), STEP, {"op": "abort", "request_id": "r0"}, add("r1", A8 + [0]),
         STEP],
    ), "r1 (salt None) reads group 0 position 6 through block 2, which was never written", None,
        "DIFF-state"),
    # Write into a cached block: a block handed out keeps its old key, its new owner writes
    # it, a hitter of the old key reads the new owner's KV. Structurally consistent.
    Plant("no-eviction-on-pop", "api", trace("api", TINY, [
        add("r0", A8), *alloc("r0", 8), {"op": "free", "request_id": "r0"},
        add("r1", [3] * 5), *alloc("r1", 5), {"op": "free", "request_id": "r1"},
        add("r2", A8 + [0]), *alloc("r2", 1, lookup=True),
    ]), "r2 (salt None) reads group 0 position 4 through block 2, which holds what r1", None,
        "DIFF-state"),
    Plant("no-eviction-on-pop", "scheduler", trace("scheduler", TINY, [
        add("r0", A8, max_tokens=1), STEP, add("r1", [3] * 5, max_tokens=1), STEP,
        add("r2", A8 + [0]), STEP,
    ]), "r2 (salt None) reads group 0 position 4 through block 2, which holds what r1", None,
        "DIFF-state"),
    # A value that changes the KV left out of the key (docs/bugs.md #18, here the salt): H2 sees
    # r0's first hash differ from the documented one (H1 would see two prefixes under one hash).
    Plant("salt-ignored", "api", trace("api", FULL, [
        add("r0", A8, cache_salt="a"), *alloc("r0", 8),
        add("r1", A8 + [0], cache_salt="b"), *alloc("r1", 1, lookup=True),
    ]), "r1 (salt 'b') reads group 0 position 0 through block 1, which holds what r0 (salt 'a')",
        "H2", "H2"),
    Plant("salt-ignored", "scheduler", trace("scheduler", FULL, [
        add("r0", A8, cache_salt="a"), STEP, add("r1", A8 + [0], cache_salt="b"), STEP,
    ]), "r1 (salt 'b') reads group 0 position 0 through block 1, which holds what r0 (salt 'a')",
        "H2", "H2"),
    # A short load on a lone window group (docs/findings/016): 12 loaded into a null block
    # (0..3) and blocks 1, 2; only 4 landed. Keeping 4 tokens, as vLLM's scheduler does,
    # computes 4.. over a window that reads block 0's positions, which nobody wrote.
    Plant("load-rollback-into-window", "scheduler",
          Trace.load(FINDINGS / "plant-016-short-load-window.json"),
          "r reads position 0 of group 0 through the null block", None, "DIFF-result"),
    # The same on a failing synchronous load under "recompute" (docs/spec.md §13.3, step 5):
    # 11 of r's 12 tokens loaded into a null block and blocks 1, 2; 4 filled. vLLM's rule
    # resumes r at 4, whose window reads block 0; kvfuzz's driver preempts it.
    Plant("sync-failure-resumes-over-window", "scheduler",
          Trace.load(FINDINGS / "016-sync-load-window-unloaded.json"),
          "r reads position 0 of group 0 through the null block", None, "DIFF-result"),
    # A failing synchronous load (docs/spec.md §13.3, step 5) fills 6 of a's 16 tokens; the
    # report rounded up to whole blocks leaves block 2 (positions 4..7) valid, so a keeps 8
    # computed tokens and its next pass reads positions 6, 7, which nothing filled.
    Plant("failed-load-report-rounds-up", "scheduler", trace("scheduler", CONNECTOR, [
        add("a", list(range(20)), max_tokens=2),
        {"op": "load_remote", "request_id": "a", "num_external_tokens": 16, "sync": True,
         "num_loaded_tokens": 6}, STEP, STEP,
    ]), "a (salt None) reads group 0 position 6 through block 2, which a failing KV load left "
        "unfilled at step 2", None, "DIFF-state"),
]

# docs/spec.md §10.7: under the priority policy B is scheduled (its allocate_slots hashes block 1,
# positions 4-7), then preempted in the same step for A; its forward pass never runs, the key
# stays, and C hits never-written KV at position 7.
PREEMPTED_AFTER_SCHEDULED = trace(
    "scheduler",
    {"name": "priority_hazard", "num_blocks": 5, "groups": [{"kind": "full", "block_size": 4}],
     "scheduler": {"policy": "priority", "num_lookahead_tokens": 1, "token_budget": 8}},
    [add("B", [1] * 6, priority=1), STEP, add("A", [2] * 3, priority=0, max_tokens=2), STEP,
     STEP, add("C", [1] * 6 + [2, 3, 0]), STEP],
)

# Tier B: P and Q are admitted in one step; Q's partial hit ends inside P's tail block, whose
# KV P writes in that same step's forward pass, after the driver has executed the copy.
SAME_STEP_COPY = trace("scheduler", PARTIAL, [add("P", P14), add("Q", P14), STEP])


COPY_OF_A_COPY = Trace.from_dict(json.loads((FINDINGS / "hazard-copy-of-a-copy.json").read_text()))
"""Two same-step sub-block hits on Mamba "align": the second copies the first's copy."""

FAILED_BLOCK_SHARER = Trace.load(FINDINGS / "hazard-failed-block-sharer.json")
"""r4's synchronous load fails on block 1, which r6 hits in the same step; r4 marks it for
recomputation, r6 keeps it computed (docs/spec.md §13.3, step 5), r4 finishes first."""
