"""The one scheduler of campaign work: a deterministic stream of (level, config, seed) batches.

A campaign is cut into `Batch`es. `Schedule` decides which batch comes next; a backend executes
batches, anywhere, with a `kvfuzz.fuzz.campaign.BatchRunner`, and hands back `BatchResult`s; the
campaign driver (`kvfuzz.fuzz.campaign.run_campaign`) keeps the backend busy, feeds every result
back to the schedule, counts it, and deduplicates, shrinks and saves its failure, once, itself.

- Determinism: batch `i` of a campaign is the same (level, config, seed, examples) whatever
  runs it, as long as the schedule sees the same budget: with `--examples` the whole list is
  fixed by the seed and options; with `--seconds` only the batch sizes near the end depend on
  time. A batch's seed derives from the campaign seed and the batch index, never from a worker.
- Fairness: the next pair is the one with the fewest examples assigned for its weight (ties: in
  the campaign's order), so every (level, config) pair gets a first, small batch before any
  gets a second (the first round); with `--examples N` each pair's quota is its weighted
  share of N (at least one when N is at least the number of pairs). `Schedule.unreached` and
  `Schedule.short` name the pairs that got none or too few.
- Weights: `Schedule.weights[pair]` (1.0 each by default) scales a pair's share. A
  coverage-guided policy sets every pair's weight once the whole first round is in
  (`reweigh`: no batch after the round is chosen before, `ready`), and passes a new weight with
  each later result (`record`, in batch order), which takes effect LAG batches later; so the
  pairs chosen do not depend on how many batches run at once (up to LAG; more run at once only
  when results come back that far ahead, `ready`).

How another backend plugs in: implement `Backend` (`capacity`, `submit`, `results`, `close`),
run each submitted batch on its side (a process, a Ray task, a machine) with a
`BatchRunner(options)` made once there (`runner(batch)`), return the `BatchResult` (plain data,
picklable), and pass the backend to
`run_campaign(options, on_progress, backend=...)`. A backend that loses a batch may rerun it:
the same batch gives the same examples. `InProcess` and `kvfuzz.fuzz.workers.LocalWorkers`
are the two built in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Pair = tuple[str, str]
"""(level, config)."""

BATCH_EXAMPLES = 10
"""Examples in a full batch."""
FIRST_BATCH = 2
"""Examples in a pair's first batch: small, so a short budget still reaches every pair: the
simplest example and one drawn from the seed, whose code weighs the rest of the budget
(`Schedule.reweigh`)."""
FEW_EXAMPLES = 10
"""A pair that ran fewer examples than this is named in the summary as run too little."""
LAG = 16
"""A result's weight applies from the batch LAG places after it (the default `lag`): the
batches are the same for any number of workers or nodes running at most `lag` at once; a
bigger cluster needs a bigger lag to keep every CPU busy, and weights then react later."""


@dataclass(frozen=True)
class Batch:
    """One unit of campaign work: `examples` examples of `level` traces on `config`."""

    index: int
    level: str
    config: str
    seed: int
    examples: int
    first: bool = False
    """The pair's first batch: its examples keep every rule and knob (no swarm), so a bug that
    plain examples find at once costs no more with swarm testing on."""

    @property
    def pair(self) -> Pair:
        return (self.level, self.config)


@dataclass
class Failure:
    """A batch's raw (unshrunk) counterexample, portable between processes."""

    check: str
    message: str
    signature: tuple[str, ...]
    trace_json: str
    target_raised: str = ""
    """What the target raised at the failing step ("" if nothing; `Finding.target_raised`)."""


@dataclass
class BatchResult:
    """What running one batch gave: counts, behaviour features, its first failure."""

    batch: Batch
    examples: int = 0
    operations: int = 0
    checks: int = 0
    features: set[tuple[Any, ...]] = field(default_factory=set)
    seconds: float = 0.0
    failure: Failure | None = None
    interrupted: bool = False
    database_lost: str | None = None
    """Why the batch's process dropped the shared example database, if it did (the driver
    warns once per campaign)."""
    tolerated: dict[str, int] = field(default_factory=dict)
    """Per known deviation (`id name`), the examples in which the target tolerated it."""
    code: set[tuple[Any, ...]] = field(default_factory=set)
    """The target's code sites the batch ran (`kvfuzz.fuzz.code_coverage`)."""
    generated: tuple[str, tuple[str, ...] | list[str]] | None = None
    """A generated pair's batch: its config's name and cross-feature combinations."""


def batch_seed(campaign_seed: int, index: int) -> int:
    material = f"{campaign_seed}:{index}".encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big")


class Schedule:
    """The batches of one campaign over `pairs`, for `examples` in all (None: until time ends)."""

    def __init__(self, pairs: Sequence[Pair], seed: int, examples: int | None = None,
                 lag: int = LAG) -> None:
        if not pairs:
            raise ValueError("a campaign needs at least one (level, config) pair")
        self.pairs = list(pairs)
        self.seed = seed
        self.examples = examples
        self.weights: dict[Pair, float] = {pair: 1.0 for pair in self.pairs}
        self.assigned: dict[Pair, int] = {pair: 0 for pair in self.pairs}
        self.ran: dict[Pair, int] = {pair: 0 for pair in self.pairs}
        self.seconds_per_example: float | None = None
        self._index = 0
        self._ran_seconds = 0.0
        self.lag = lag
        self._fed = 0
        self._pending: dict[int, tuple[Pair, float]] = {}

    def quota(self, pair: Pair) -> int | None:
        """The examples `pair` gets out of an examples budget (None: no such budget): a first
        batch each when the budget has room for every pair's, and the rest by weight (so a
        heavy pair never shrinks another's first batch)."""
        if self.examples is None:
            return None
        first = FIRST_BATCH if self.examples >= FIRST_BATCH * len(self.pairs) else 0
        rest = self.examples - first * len(self.pairs)
        total = sum(self.weights.values())
        shares = [(rest * self.weights[p] / total, -i) for i, p in enumerate(self.pairs)]
        floors = [int(share) for share, _ in shares]
        # Largest remainders first, earlier pairs on ties, so the quotas add up to the budget.
        order = sorted(range(len(shares)), key=lambda i: (shares[i][0] - floors[i], shares[i][1]),
                       reverse=True)
        for i in order[: rest - sum(floors)]:
            floors[i] += 1
        return first + floors[self.pairs.index(pair)]

    def next_batch(self, seconds_left: float | None = None, parallel: int = 1) -> Batch | None:
        """The next batch, or None when the examples budget is all assigned. `seconds_left`
        (with `parallel` batches running at once) keeps a batch from overrunning a time budget."""
        for index in sorted(i for i in self._pending if i < self._index - self.lag):
            pair, weight = self._pending.pop(index)
            self.weights[pair] = weight
        candidates = [p for p in self.pairs if self._room(p) > 0]
        if not candidates:
            return None
        pair = min(candidates,
                   key=lambda p: (self.assigned[p] / self.weights[p], self.pairs.index(p)))
        first = not self.assigned[pair]
        size = min(self._room(pair), FIRST_BATCH if first else BATCH_EXAMPLES)
        if seconds_left is not None and self.seconds_per_example:
            fits = int(seconds_left * parallel / self.seconds_per_example)
            size = max(1, min(size, fits))
        self.assigned[pair] += size
        batch = Batch(self._index, pair[0], pair[1], batch_seed(self.seed, self._index), size,
                      first)
        self._index += 1
        return batch

    def ready(self) -> bool:
        """Whether the next batch can be chosen: every result `lag` batches back is in (so at
        most `lag` batches run at once), and after the first round, every result of that round
        (the weights `reweigh` sets from it come first)."""
        round_end = len(self.pairs)
        if self._index >= round_end > self._fed:
            return False
        return self._fed >= self._index - self.lag

    def reweigh(self, weights: dict[Pair, float]) -> None:
        """Set the pairs' weights at once, from the whole first round (call it when the round's
        last result is recorded: `ready` holds the next batch back until then)."""
        self.weights.update(weights)

    def record(self, result: BatchResult, weight: float | None = None) -> None:
        """Feedback, in batch order: what a batch ran, how long an example takes, and the
        pair's new weight (None: unchanged)."""
        self._fed += 1
        if weight is not None:
            self._pending[result.batch.index] = (result.batch.pair, weight)
        self.ran[result.batch.pair] += result.examples
        self._ran_seconds += result.seconds
        ran = sum(self.ran.values())
        if ran:
            self.seconds_per_example = self._ran_seconds / ran

    def _room(self, pair: Pair) -> int:
        """How many more examples `pair` may be given (weights may change quotas, never the
        total)."""
        quota = self.quota(pair)
        if quota is None or self.examples is None:
            return BATCH_EXAMPLES
        return min(quota - self.assigned[pair], self.examples - sum(self.assigned.values()))

    def unreached(self) -> list[Pair]:
        """The pairs that ran no example."""
        return [p for p in self.pairs if not self.ran[p]]

    def short(self) -> list[Pair]:
        """The pairs that ran some examples, but fewer than `FEW_EXAMPLES`."""
        return [p for p in self.pairs if 0 < self.ran[p] < FEW_EXAMPLES]

    def done_pairs(self) -> int:
        return sum(1 for p in self.pairs if self.ran[p])


class Backend(Protocol):
    """Runs batches somewhere and hands back their results (see the module docstring)."""

    capacity: int
    """How many batches it runs at once: the driver keeps that many submitted."""

    def submit(self, batch: Batch) -> None:
        """Start `batch` (or queue it for the next free slot)."""

    def results(self, timeout: float) -> list[BatchResult]:
        """The results finished since the last call, waiting up to `timeout` s for one."""

    def close(self, cancel: bool) -> list[BatchResult]:
        """Stop; with `cancel`, interrupt the running batches. Returns the results still
        coming (partial ones marked `interrupted`)."""


class InProcess:
    """The backend of `--workers 1`: runs each batch in this process, when results are asked."""

    capacity = 1

    def __init__(self, run: Callable[[Batch], BatchResult]) -> None:
        self.run = run
        self.pending: list[Batch] = []

    def submit(self, batch: Batch) -> None:
        self.pending.append(batch)

    def results(self, timeout: float) -> list[BatchResult]:
        done = [self.run(batch) for batch in self.pending]
        self.pending.clear()
        return done

    def close(self, cancel: bool) -> list[BatchResult]:
        self.pending.clear()
        return []
