"""A randomized misuse driver: invalid calls on a manager's public methods, mixed into valid use.

kvcache's misuse contract (docs/traces.md "API misuse"): every public method of BlockPool and
KVCacheManager validates before it mutates, refuses blocks of another pool, and raises
ValueError naming the bad value — for every input, not only the documented classes. The driver
plays valid ops through a target's `ManagerSide` (so its state stays what the harness expects)
and, between them, calls the manager directly with one bad argument: a non-block or another
pool's block in a block list, None / str / float / bool / negative counts, something that is not
a request. Each invalid call must raise ValueError and leave the snapshot (ref counts, queue
order and links, keys, tables, pending copies) exactly as it was.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.core.errors import InvalidTrace
from kvfuzz.core.trace import normalize_op
from kvfuzz.harness.targets import get_target

_BAD_VALUES: tuple[Any, ...] = (None, "x", 1.5, -1, True, [1], b"1")
_BAD_COUNTS: tuple[Any, ...] = (None, "3", 1.5, -1, True)


@dataclass
class MisuseReport:
    """What one run of the driver saw."""

    calls: int = 0
    """Invalid calls tried."""
    rejected: int = 0
    """Invalid calls that raised ValueError and changed nothing."""
    valid_ops: int = 0
    state_changes: list[str] = field(default_factory=list)
    """Invalid calls after which the snapshot differed (with their description)."""
    wrong_outcomes: list[str] = field(default_factory=list)
    """Invalid calls that returned, or raised something other than ValueError."""

    def merge(self, other: MisuseReport) -> None:
        self.calls += other.calls
        self.rejected += other.rejected
        self.valid_ops += other.valid_ops
        self.state_changes += other.state_changes
        self.wrong_outcomes += other.wrong_outcomes

    def summary(self) -> str:
        return (f"{self.calls} invalid calls tried among {self.valid_ops} valid ops, "
                f"{self.rejected} rejected cleanly, {len(self.state_changes)} state changes, "
                f"{len(self.wrong_outcomes)} wrong outcomes")


class MisuseDriver:
    """Valid ops and invalid calls on one side of `target`, from one seed."""

    def __init__(self, config: Config, target: str = "kvcache", seed: int = 0) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.side: Any = get_target(target).build(config, "api")
        self.report = MisuseReport()
        self._next_id = 0
        self._foreign = get_target(target).build(config, "api").manager.block_pool

    # ----- valid use -----

    def _apply(self, **raw: Any) -> Any:
        try:
            out = self.side.apply(normalize_op(raw, "api"))
        except InvalidTrace:
            return None
        self.report.valid_ops += 1
        return out

    def _requests(self, *statuses: str) -> list[Any]:
        names = {int(getattr(self.side.request_status, s)) for s in statuses}
        return [r for r in self.side.requests.values() if int(r.status) in names]

    def valid_step(self) -> None:
        rng, cfg = self.rng, self.config
        waiting, running = self._requests("WAITING", "PREEMPTED"), self._requests("RUNNING")
        roll = rng.random()
        if roll < 0.3 and len(waiting) + len(running) < 6:
            self._next_id += 1
            n = rng.randint(1, max(1, cfg.max_model_len // 2))
            self._apply(op="add_request", request_id=f"r{self._next_id}",
                        prompt=[rng.randint(0, 3) for _ in range(n)], max_tokens=4)
        elif roll < 0.6 and waiting:
            request = rng.choice(waiting)
            out = self._apply(op="get_computed_blocks", request_id=request.request_id)
            hit = out.get("num_computed_tokens", 0) if isinstance(out, dict) else 0
            new = request.num_tokens - request.num_computed_tokens - hit
            self._apply(op="allocate_slots", request_id=request.request_id,
                        num_new_tokens=max(new, 1), use_lookup=True)
        elif roll < 0.85 and running:
            request = rng.choice(running)
            self._apply(op="append_tokens", request_id=request.request_id,
                        tokens=[rng.randint(0, 3)])
            self._apply(op="allocate_slots", request_id=request.request_id, num_new_tokens=1)
        elif running or waiting:
            request = rng.choice(running + waiting)
            self._apply(op="free", request_id=request.request_id, preempt=rng.random() < 0.3)

    # ----- misuse -----

    def _block_list(self, bad: Any) -> list[Any]:
        """Some blocks of this pool (held or free), then `bad`."""
        pool = self.side.manager.block_pool
        good = self.rng.sample(pool.blocks[1:], k=min(2, len(pool.blocks) - 1))
        return [*good, bad]

    def _bad_block(self) -> Any:
        rng = self.rng
        if rng.random() < 0.4:
            return rng.choice(self._foreign.blocks)
        return rng.choice(_BAD_VALUES)

    def invalid_call(self) -> tuple[str, Callable[[], Any]]:
        """One call that must be refused: its description and the call itself."""
        rng, manager = self.rng, self.side.manager
        pool = manager.block_pool
        requests = list(self.side.requests.values()) or [None]
        request = rng.choice(requests)
        bad = rng.choice(_BAD_COUNTS)
        kind = rng.randrange(10)
        if kind == 0 and rng.random() < 0.2:  # vLLM 0.34's option, given a non-bool
            blocks = self._block_list(pool.null_block)
            first = rng.choice((None, 1, "yes", 0.0))
            return (f"free_blocks({blocks!r}, evict_first={first!r})",
                    lambda: pool.free_blocks(blocks, evict_first=first))
        if kind == 0:
            blocks = self._block_list(self._bad_block())
            return f"free_blocks({blocks!r})", lambda: pool.free_blocks(blocks)
        if kind == 1:
            blocks = self._block_list(self._bad_block())
            return f"touch({blocks!r})", lambda: pool.touch(blocks)
        if kind == 2:
            hits = type(manager.empty_kv_cache_blocks)(
                tuple([self._bad_block()] for _ in manager.coordinator.single_type_managers))
            return (f"allocate_slots(hits={hits.blocks!r})",
                    lambda: manager.allocate_slots(request, 4, 4, hits))
        if kind == 3:
            return (f"allocate_slots({request!r}, {bad!r})",
                    lambda: manager.allocate_slots(request, bad))
        if kind == 4:
            return f"cache_blocks({request!r}, {bad!r})", lambda: manager.cache_blocks(request, bad)
        if kind == 5:
            thing = rng.choice(_BAD_VALUES)
            return f"free({thing!r})", lambda: manager.free(thing)
        if kind == 6:
            ids = [rng.choice((-1, len(pool.blocks), None, "x", 1.5))]
            return f"evict_blocks({ids!r})", lambda: manager.evict_blocks(ids)
        if kind == 7:
            return f"get_new_blocks({bad!r})", lambda: pool.get_new_blocks(bad)
        if kind == 8:  # None is the default ceiling there: not a bad value
            ceiling = rng.choice(_BAD_COUNTS[1:])
            return (f"get_computed_blocks({request!r}, {ceiling!r})",
                    lambda: manager.get_computed_blocks(request, ceiling))
        thing = rng.choice(_BAD_VALUES)
        return f"allocate_slots({thing!r}, 1)", lambda: manager.allocate_slots(thing, 1)

    def try_invalid(self) -> None:
        what, call = self.invalid_call()
        report = self.report
        report.calls += 1
        before = self.side.snapshot()
        try:
            call()
        except ValueError:
            outcome = None
        except Exception as exc:  # noqa: BLE001 - any other exception breaks the contract
            outcome = f"{what} raised {type(exc).__name__}: {exc}"
        else:
            outcome = f"{what} was accepted"
        if self.side.snapshot() != before:
            report.state_changes.append(what)
        elif outcome is None:
            report.rejected += 1
        if outcome is not None:
            report.wrong_outcomes.append(outcome)

    def run(self, num_invalid: int, valid_per_invalid: int = 2) -> MisuseReport:
        for _ in range(num_invalid):
            for _ in range(self.rng.randint(0, valid_per_invalid)):
                self.valid_step()
            self.try_invalid()
        return self.report


def run_misuse(configs: dict[str, Config], num_invalid: int, target: str = "kvcache",
               seed: int = 0) -> MisuseReport:
    """`num_invalid` invalid calls in all, shared out over `configs`."""
    report = MisuseReport()
    per_config = max(1, num_invalid // max(1, len(configs)))
    for i, config in enumerate(configs.values()):
        report.merge(MisuseDriver(config, target, seed + i).run(per_config))
    return report
