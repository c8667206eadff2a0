"""The plain vLLM regression tests checked in for the numbered findings.

`FINDING_TESTS` names, for each manager-level finding, the trace its vLLM test is exported from
(docs/findings/vllm-tests/, written by `kvfuzz export TRACE --vllm-test`). `expected_outcome`
says what that test does on the installed vLLM, decided from what the install offers (the
adapter's probed features and known deviations, never its version string) and, for findings
the adapter does not tolerate, from the finding's doc (every supported release).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

FINDINGS_DIR = Path(__file__).resolve().parent.parent / "docs" / "findings"
VLLM_TESTS_DIR = FINDINGS_DIR / "vllm-tests"

FINDING_TESTS: dict[str, str] = {
    "001": "001-empty-window-entry.json",
    "002": "002-negative-counts-accepted.json",
    "003": "003-running-hit-adoption-asserts.json",
    "005": "005-cache-blocks-unchecked.json",
    "006": "006-evict-block-id-unchecked.json",
    "007": "007-null-block-ref-count.json",
    "008": "008-probe-ignores-hit-limit.json",
    "009": "vllm-tests/009-lookup-bound-raises-ceiling-full.json",
    "010": "010-prompt-embeds-mask-unkeyed.json",
    "011": "011-block-removed-while-held.json",
    "012": "012-sink-full-attention-unbuildable.json",
    "013": "013-empty-state-entry.json",
    "014": "014-state-tail-rekeyed.json",
    "015": "015-external-counts-unchecked.json",
    "016": "vllm-tests/016-short-load-window-unloaded-budget.json",
    "017": "017-external-state-block-uncounted.json",
    "018": "vllm-tests/018-deferred-drain-group-order.json",
    "019": "019-checkpoint-record-kept.json",
    "020": "vllm-tests/020-checkpoint-chunk-keys-start-state-api.json",
    "021": "vllm-tests/021-junction-chunk-keys-start-state-api.json",
    "022": "022-junction-eagle-block-unkept.json",
    "023": "hazard-preempted-after-scheduled.json",
    "024": "hazard-copy-of-a-copy.json",
    "025": "vllm-tests/025-stopped-drafts-stay-computed-no-partial-hits.json",
    "026": "026-stored-event-spans-null-blocks.json",
    "027": "027-hit-report-names-null-blocks.json",
    "028": "028-align-count-negative.json",
    "029": "029-recompute-failed-blocks-keyed.json",
    "030": "030-encoder-decoder-slots-credited-twice.json",
    "031": "vllm-tests/031-sync-failure-several-groups-budget.json",
    "036": "036-partial-hit-reported-as-full.json",
    "035": "035-checkpoint-among-drafts.json",
}
"""Finding number -> the trace its vLLM test comes from. 009's own trace forces sub-block
hits inside vLLM, so its test comes from the same steps on full attention alone; 020's and 021's
traces are scheduler level, so theirs come from the same steps as manager calls (the chunk
vLLM's scheduler issues). Those traces are kept beside the tests, not as finding traces. 022-024 are
scheduler level: their tests drive vLLM's own Scheduler (fuzz/vllm_scheduler_test_export.py);
023's and 024's traces are the hazards they were promoted from (docs/findings/hazards.md).
025's trace forces sub-block hits and a budget below the in-flight tokens, which a vLLM test
cannot set, so its test comes from the same steps without them (on vLLM's own Scheduler, with
its drafts); 016's keeps its steps with the in-flight tokens at the budget, as vLLM's Scheduler
derives them (its test writes a KV connector on vLLM's base class); 018's with them at twice
the budget, as vLLM's AsyncScheduler derives them (its test leaves a step in flight there);
031's (DIFF-result in the finished requests: a failing synchronous load on two groups, its
test's connector naming the request) likewise with them at the budget.
028 (P1), 029 (a synchronous load), 030 (DIFF-result on an encoder-decoder Scheduler) and 035
(I10: a step with a drafter's count per request raises) are scheduler level too, their tests
from their own traces. 036's (EV4, api level) forces vLLM's partial hits on, as the `vllm`
target does."""

TEST_STEMS: dict[str, str] = {
    "023": "023-preempted-after-scheduled",
    "024": "024-copy-of-a-copy",
}
"""The finding a test is named for, where its trace file is named otherwise."""

PROPOSED_FIXES = frozenset({"016", "018", "022", "023", "024", "025", "028", "029", "030",
                            "031", "035"})
"""Findings whose tests drive vLLM's own Scheduler, under which kvcache cannot be dropped in
(and 023's and 024's bugs live in the scheduler and worker, which kvcache shares): their tests
are shown to pass with the finding doc's fix applied to vLLM (tests/vllm/proposed_fixes.py),
not through the drop-in."""

SKIPS: dict[str, str] = {
    "008": "cached_tokens_probe",
    "009": "lookup_bound",
    "010": "prompt_embeds_mask",
    "011": "kv_events",
    "015": "kv_connector",
    "017": "kv_connector",
    "019": "prefill_checkpoints",
    "020": "prefill_checkpoints",
    "021": "prefill_checkpoints",
    "026": "kv_events",
    "027": "report_mode",
    "035": "prefill_checkpoints",
    "036": "request_hit_limit",
}
"""The adapter feature (harness/vllm_api.FEATURES) a test needs; where the install lacks it the
test skips itself (its skipif names what is missing)."""


def vllm_test_path(number: str) -> Path:
    """The checked-in vLLM test of finding `number`."""
    return VLLM_TESTS_DIR / f"test_{_stem(number).replace('-', '_')}.py"


def _stem(number: str) -> str:
    return TEST_STEMS.get(number) or Path(FINDING_TESTS[number]).stem


def _sink_manager_rejects_kwargs() -> bool:
    """012: SinkFullAttentionManager.__init__ takes a fixed parameter list (no **kwargs)."""
    from importlib import import_module

    module = import_module("vllm.v1.core.single_type_kv_cache_manager")
    manager = getattr(module, "SinkFullAttentionManager", None)
    if manager is None:
        return False
    params = inspect.signature(manager.__init__).parameters.values()
    return not any(p.kind is p.VAR_KEYWORD for p in params)


def expected_outcome(number: str, api: Any) -> str:
    """'failed', 'skipped' or 'passed': what finding `number`'s vLLM test does on `api`."""
    from kvfuzz.harness.vllm_scheduler_target import SCHEDULER_DEVIATIONS
    from kvfuzz.harness.vllm_target import KNOWN_DEVIATIONS

    feature = SKIPS.get(number)
    if feature is not None and not api.has(feature):
        return "skipped"
    stem = _stem(number)
    for suffix in ("-full", "-api", "-no-partial-hits", "-budget"):
        stem = stem.removesuffix(suffix)
    doc = f"docs/findings/{stem}.md"
    deviations = [d for d in (*KNOWN_DEVIATIONS, *SCHEDULER_DEVIATIONS) if d.finding == doc]
    if deviations:
        return "failed" if any(d.applies(api) for d in deviations) else "passed"
    if number == "012":
        return "failed" if _sink_manager_rejects_kwargs() else "passed"
    return "failed"  # misuse findings 002, 003, 005, 006, 015 and 023, 024: in every release
