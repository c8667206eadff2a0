"""Evidence that the checks can fail: every planted bug is found, shrunk and replayable.

Each `bug:NAME` target is kvcache with one behaviour broken (harness/mutants.py). A short
seeded campaign must find it through the one executor, report the expected check, and save a
shrunk trace that replays to the same check. The mission properties and I7 are also shown
failing on their own: model off, only that check registered.
"""

from pathlib import Path

import pytest

from kvfuzz.fuzz.campaign import Campaign, CampaignOptions
from kvfuzz.harness.executor import run_trace
from kvfuzz.harness.mutants import MUTANTS, REQUIRED
from kvfuzz.core.trace import Trace
from kvfuzz.properties import REGISTRY

# What catches each plant first (invariants run before the differential comparison; a plant
# the campaign meets first at the other level may show as a DIFF there: each named check is also
# seen catching its plant alone, in test_check_alone_catches_its_plant).
EXPECTED = {
    "predictor-off-by-one": {"P1"},
    "touch-leaves-queued": {"P1", "P3"},
    "free-forgets-decrement": {"P2"},
    "free-forward-order": {"I7", "DIFF-state"},
    "hit-reaches-num-tokens": {"I12"},
    "lookup-ignores-bound": {"I12"},
    "salt-ignored": {"H1", "H2"},
    "weak-hash": {"H1", "H2"},
    "uncached-to-tail": {"I7", "DIFF-state"},
    "cached-to-head": {"I7", "DIFF-state"},
    "touch-before-check": {"P2", "DIFF-probe"},
    "stale-hash-on-evict": {"I5"},
    "no-eviction-on-pop": {"I5", "I10", "DIFF-state"},
    "capped-step-predictor": {"P1"},
    "window-never-freed": {"I18", "DIFF-result"},
    "null-block-queued": {"P2", "P3"},
    "reset-while-held": {"I19"},
    "watermark-ignored": {"I8", "DIFF-probe", "DIFF-result"},
    "cow-unretained": {"P2"},
    "lora-name-only": {"H1", "H2"},
    "lora-keys-by-id": {"H1", "H2", "DIFF-result", "DIFF-state", "DIFF-probe"},
    "lora-salt-untagged": {"H1", "H2"},
    "embeds-mask-dropped": {"H1", "H2"},
    "removed-while-held": {"EV2", "EV4"},
    "deferred-free-whole-list": {"I7", "DIFF-state"},
    "evict-first-ignored": {"I7", "F1", "DIFF-state"},
    "reset-not-announced": {"EV1", "EV4"},
    "reset-keeps-running": {"DIFF-result", "DIFF-state"},
    "reset-preempts-in-order": {"I7", "DIFF-state"},
    "stored-parent-dropped": {"EV3"},
    "stored-on-every-hit": {"EV4"},
    "stored-extra-keys-at-start": {"EV5"},
    "cached-report-dropped": {"EV6"},
    "plain-extras-empty": {"H2"},
    "mm-later-input-unkeyed": {"H1", "H2"},
    "promoted-partial-unannounced": {"EV4"},
    "partial-promotion-keeps-key": {"DIFF-state"},
    "resumed-checkpoint-dropped": {"DIFF-state"},
    "one-token-state-unkeyed": {"DIFF-state"},
    "state-predictor-under-count": {"P1"},
    "state-released-early": {"S1", "DIFF-result", "DIFF-state"},
    "state-allocation-asserts-growth": {"DIFF-result", "I10"},
    "state-hit-misplaced": {"I12", "P1", "S2", "DIFF-result", "DIFF-state"},
    "align-cow-forgets-pending-copy": {"P2", "DIFF-state"},
    "eagle-checkpoint-ignored": {"DIFF-state"},
    "checkpoint-not-rekeyed": {"S2", "DIFF-state", "DIFF-result"},
    "rswa-gap-kept": {"DIFF-state", "DIFF-result"},
    "ring-block-per-step": {"P1", "P4"},
    "encoder-only-takes-blocks": {"EO1"},
    "retention-ignored": {"RT1", "DIFF-state"},
    "state-retention-ignored": {"RT1", "DIFF-state"},
    "boundary-before-hit": {"I20"},
    "boundary-one-short": {"DIFF-probe", "DIFF-state"},
    "negative-external-accepted": {"P1", "DIFF-result", "DIFF-probe", "DIFF-state"},
    "aborted-load-holds-blocks": {"C1", "I16", "DIFF-state"},
    "external-state-block-uncounted": {"P1", "P4", "DIFF-probe", "DIFF-result"},
    "inflight-freed-at-once": {"IF1", "DIFF-state"},
    "inflight-fence-one-late": {"IF2", "DIFF-state"},
    "dynamic-drafts-fixed": {"DIFF-state"},
    "inflight-drain-whole-list": {"DIFF-state"},
    "encoder-budget-per-request": {"DIFF-result", "DIFF-state"},
    "cross-encoder-unbudgeted": {"DIFF-result", "DIFF-state", "DIFF-probe"},
    "load-rollback-into-window": {"DIFF-result", "DIFF-state"},
    "failed-load-blocks-keyed": {"I11", "DIFF-state"},
    "failed-load-report-rounds-up": {"DIFF-state", "DIFF-result"},
    "sync-failure-first-group-only": {"DIFF-state", "DIFF-result"},
    "sync-failure-resumes-over-window": {"DIFF-result", "DIFF-state"},
    "lookahead-unhashed": {"H1", "H2", "DIFF-result", "DIFF-state", "DIFF-probe"},
    "reprefillable-cached": {"DIFF-state", "DIFF-result", "DIFF-probe"},
    "output-unpublished": {"DIFF-state", "DIFF-result", "DIFF-probe"},
    "landed-load-first": {"DIFF-state", "DIFF-result"},
    "junction-state-unkeyed": {"DIFF-state", "DIFF-result", "DIFF-probe"},
    "sync-load-ignored": {"DIFF-result", "DIFF-state"},
    "watermark-subtracted": {"I8", "P4", "DIFF-result", "DIFF-probe"},
    "null-head-overshoot": {"I10", "DIFF-result"},
    "offer-margin-everywhere": {"DIFF-result", "DIFF-state", "DIFF-probe"},
    "offer-margin-cap-or": {"DIFF-result", "DIFF-state", "DIFF-probe"},
    "one-new-block-reads-none": {"W2"},
}


def _hunt(tmp_path: Path, target: str, configs: tuple[str, ...] | None, *, model: bool = True,
          levels: tuple[str, ...] = ("api", "scheduler"), examples: int = 1500):
    options = CampaignOptions(
        target=target, seconds=None, examples=examples, seed=1,
        configs=configs or CampaignOptions().configs, corpus=tmp_path, model=model,
        levels=levels, shrink_seconds=30, max_findings=1,
    )
    return Campaign(options).run()


def test_every_plant_has_an_expectation():
    assert set(EXPECTED) <= set(MUTANTS)
    assert set(REQUIRED) <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_planted_bug_is_found_shrunk_and_replays(tmp_path, name):
    mutant = MUTANTS[name]
    stats = _hunt(tmp_path, f"bug:{name}", mutant.configs)
    assert stats.findings, f"bug:{name} survived {stats.examples} examples"
    finding = stats.findings[0]
    assert finding.check in EXPECTED[name], finding
    trace = Trace.load(finding.file)
    # The checker issue's six plants must shrink to at most 10 ops; the others are longer bugs.
    assert len(trace.ops) <= (10 if name in REQUIRED else 20), trace.to_json()
    replayed = run_trace(trace, [f"bug:{name}"])
    assert replayed.finding is not None and replayed.finding.check == finding.check
    assert run_trace(trace, ["kvcache"]).passed, "the shrunk trace fails on kvcache too"


@pytest.mark.parametrize(
    "check, plant, level",
    [("P1", "predictor-off-by-one", "api"), ("P2", "free-forgets-decrement", "api"),
     ("P3", "touch-leaves-queued", "api"), ("P4", "predictor-off-by-one", "scheduler"),
     ("I7", "free-forward-order", "api"), ("S1", "state-released-early", "api"),
     ("S2", "state-hit-misplaced", "api"), ("S2", "state-hit-misplaced", "scheduler"),
     ("S2", "checkpoint-not-rekeyed", "api"),
     ("S3", "cow-unretained", "api"), ("F1", "evict-first-ignored", "api"),
     ("C1", "aborted-load-holds-blocks", "scheduler"),
     ("P1", "negative-external-accepted", "api"),
     ("P1", "external-state-block-uncounted", "api"),
     # At the api level: a scheduler passes over a request whose hit leaves it no token
     # (vLLM's `skip_request`, docs/spec.md §7.2), so a whole-prompt hit is never scheduled.
     ("I12", "hit-reaches-num-tokens", "api"), ("I12", "lookup-ignores-bound", "api"),
     ("RT1", "retention-ignored", "api"), ("RT1", "state-retention-ignored", "api"),
     ("RT1", "state-retention-ignored", "scheduler"), ("EO1", "encoder-only-takes-blocks", "api"),
     ("IF1", "inflight-freed-at-once", "scheduler"),
     ("IF2", "inflight-fence-one-late", "scheduler"),
     ("EV4", "stored-on-every-hit", "api"), ("H2", "plain-extras-empty", "api"),
     ("H1", "weak-hash", "api"), ("EV4", "promoted-partial-unannounced", "scheduler"),
     ("H2", "lookahead-unhashed", "api"), ("EV5", "stored-extra-keys-at-start", "api"),
     ("EV6", "cached-report-dropped", "api"), ("W2", "one-new-block-reads-none", "api"),
     ("W2", "one-new-block-reads-none", "scheduler")],
)
def test_check_alone_catches_its_plant(tmp_path, monkeypatch, check, plant, level):
    """Without the model and with every other check removed, the check still fails."""
    import kvfuzz.properties.registry as registry

    only = registry.Registry()
    only.add(REGISTRY.get(check))
    monkeypatch.setattr(registry, "REGISTRY", only)
    monkeypatch.setattr("kvfuzz.properties.REGISTRY", only)
    monkeypatch.setattr("kvfuzz.harness.executor.REGISTRY", only)
    stats = _hunt(tmp_path, f"bug:{plant}", MUTANTS[plant].configs or ("full",), model=False,
                  levels=(level,), examples=3000)
    assert stats.findings and stats.findings[0].check == check
