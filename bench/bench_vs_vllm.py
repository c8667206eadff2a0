"""kvcache vs the installed vLLM, side by side: the same workloads through both managers in one run.

Each workload drives kvcache's KVCacheManager and vLLM's with the same driver
(`kvcache.scheduler.Scheduler`, FCFS with preemption) and the same prompts; thin wrappers time
the manager calls. The two sides run interleaved, request by request and step by step (who goes
first alternates between repeats), after one discarded warm-up pass, so that a slow stretch of
a shared machine falls on both alike. Printed per operation: microseconds per call (median
over the repeats of each repeat's mean, the slowest 1% of calls left out on both sides alike:
those the OS preempted), the ratio kvcache/vLLM, a "net" ratio with the cost of an empty
timed call (the same wrapper around a method that returns at once, timed right after each
lookup) taken off both sides, the number of calls, and the lowest and highest ratio of single
repeats (how far a row moves between runs); then the workload's time per operation over all
its calls (each operation's mean weighted by its calls); then whether both produced
identical block tables (every request's tables when it is freed, and every step's schedule);
if any workload's differ, the bench exits 1 after printing. The KV
connector workload also times the loads' allocations and the caching of a landed load (the
driver plays the connector, docs/spec.md §13.2).
Request creation includes hashing the prompt (SHA-256 on both sides). Figures only: nothing is
asserted about time. Needs the venv of ci/install-vllm.sh:

    "$(bash ci/install-vllm.sh | tail -n 1)" bench/bench_vs_vllm.py [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


from kvfuzz.core.config import Config, GroupConfig
from kvfuzz.harness.kvcache_target import build_kvcache_manager
from kvfuzz.kvcache import Request, RequestStatus, Scheduler, get_request_block_hasher

OPERATIONS = (
    "get_computed_blocks",
    "allocate_slots (admission)",
    "allocate_slots (prefill chunk)",
    "allocate_slots (decode)",
    "allocate_slots (KV load)",
    "cache_blocks (load landed)",
    "free",
    "Request creation (hashing)",
)
WRAPPER = "empty timed call"
"""The timing wrapper around a method that returns at once, right after each lookup."""
_ADMITTED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(frozen=True)
class Workload:
    name: str
    config: Config
    num_requests: int
    prompt_len: int
    shared_prefix_len: int
    decode_steps: int
    token_budget: int
    max_running: int
    repeats: int
    connector: bool = False
    """The unshared half loads half its prompt from a simulated KV connector (spec §13.2)."""

    def prompts(self) -> list[list[int]]:
        """Half the prompts start with one shared prefix; the rest is random."""
        rng = random.Random(0)
        shared = [rng.randrange(32_000) for _ in range(self.shared_prefix_len)]
        prompts = []
        for i in range(self.num_requests):
            head = shared if i % 2 == 0 else []
            tail = [rng.randrange(32_000) for _ in range(self.prompt_len - len(head))]
            prompts.append(head + tail)
        return prompts


def _workloads(quick: bool) -> list[Workload]:
    scale = 4 if quick else 1
    full = GroupConfig("full", 16)
    swa = GroupConfig("sliding_window", 16, sliding_window=128)
    # Caching off, vLLM's state block spans the context: Qwen3.5-shaped, 1 attention : 3 state.
    state = GroupConfig("mamba", 1024, num_speculative_blocks=1)
    # Align mode, Qwen3.5-shaped: attention and state blocks of 64 tokens, prompts hashed in
    # blocks of 16 (sub-block state hits, copy-on-write), 1 MTP block per state group.
    full64 = GroupConfig("full", 64)
    aligned = GroupConfig("mamba", 64, mamba_cache_mode="align", num_speculative_blocks=1)
    return [
        Workload("full attention, 600 blocks", Config(600, (full,), max_model_len=1024),
                 2000 // scale, 512, 256, 32, 2048, 24, 5),
        # Nine repeats: a pass makes only two prefill-chunk calls, each a long out-of-window
        # release, so a single repeat's ratio for them moves by a third.
        Workload("full + sliding window (128), 600 blocks",
                 Config(600, (full, swa), max_model_len=1024),
                 2000 // scale, 512, 256, 32, 2048, 24, 9 if not quick else 5),
        Workload("full + 3 Mamba state groups (Qwen3.5-shaped, caching off), 600 blocks",
                 Config(600, (full, state, state, state), max_model_len=1024,
                        enable_caching=False),
                 2000 // scale, 512, 0, 32, 2048, 24, 5),
        Workload("full + 3 Mamba align groups (Qwen3.5-shaped, bs 64, hash blocks of 16), "
                 "600 blocks",
                 Config(600, (full64, aligned, aligned, aligned), max_model_len=1024,
                        hash_block_size=16),
                 2000 // scale, 512, 256, 32, 2048, 24, 5),
        Workload("KV connector: full attention, 600 blocks, half the requests load KV",
                 Config(600, (full,), max_model_len=1024, kv_connector=True),
                 2000 // scale, 512, 256, 32, 2048, 24, 5, connector=True),
        # Nine repeats: a pass makes only 64 admissions and 64 frees, and one admission (vLLM's
        # hash map growing) is about a quarter of its time in the row.
        Workload("long context, 1,000,000 blocks",
                 Config(1_000_000, (full,), max_model_len=131_072),
                 64 // scale, 65_536, 32_768, 32, 16_384, 16, 9 if not quick else 3),
    ]


@dataclass
class Run:
    """One pass of a workload on one implementation."""

    ns: dict[str, list[int]] = field(default_factory=lambda: {op: [] for op in (*OPERATIONS, WRAPPER)})
    """Each call's nanoseconds, per operation."""
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*OPERATIONS, WRAPPER), 0))
    tables: list[tuple[str, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    """(request id, its tables) at every free, in order."""
    schedule: list[Any] = field(default_factory=list)
    preemptions: int = 0

    def add(self, op: str, ns: int) -> None:
        self.ns[op].append(ns)
        self.calls[op] += 1

    def us_per_call(self, op: str) -> float | None:
        """Mean microseconds per call, the slowest 1% of calls left out: on a shared machine
        those are the calls the OS preempted, each worth milliseconds."""
        times = sorted(self.ns[op])
        kept = times[: len(times) - len(times) // 100]
        return sum(kept) / len(kept) / 1e3 if kept else None


class _Empty:
    """A manager whose lookup returns at once: timed through `TimedManager`, what the timer and
    the wrapper cost by themselves."""

    def get_computed_blocks(self, request: Any) -> None:
        return None


class TimedManager:
    """Forwards to a KVCacheManager, timing the calls the benchmark reports."""

    def __init__(self, manager: Any, run: Run) -> None:
        self._manager = manager
        self._run = run
        self._empty = _Empty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def get_computed_blocks(self, request: Any) -> Any:
        start = time.perf_counter_ns()
        out = self._manager.get_computed_blocks(request)
        self._run.add("get_computed_blocks", time.perf_counter_ns() - start)
        # The same timing around a method that returns at once, with the wrapper's code now
        # warm: a lower bound of what the timer and the wrapper add to the lookup above.
        start = time.perf_counter_ns()
        self._empty.get_computed_blocks(request)
        self._run.add(WRAPPER, time.perf_counter_ns() - start)
        return out

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("delay_cache_blocks"):
            op = "allocate_slots (KV load)"
        elif request.status in _ADMITTED:
            op = "allocate_slots (admission)"
        elif request.num_computed_tokens < request.num_prompt_tokens:
            op = "allocate_slots (prefill chunk)"
        else:
            op = "allocate_slots (decode)"
        start = time.perf_counter_ns()
        out = self._manager.allocate_slots(request, *args, **kwargs)
        self._run.add(op, time.perf_counter_ns() - start)
        return out

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        start = time.perf_counter_ns()
        self._manager.cache_blocks(request, num_computed_tokens)
        self._run.add("cache_blocks (load landed)", time.perf_counter_ns() - start)

    def free(self, request: Any) -> None:
        tables = tuple(tuple(ids) for ids in self._manager.get_block_ids(request.request_id))
        self._run.tables.append((request.request_id, tables))
        start = time.perf_counter_ns()
        self._manager.free(request)
        self._run.add("free", time.perf_counter_ns() - start)


class Implementation:
    """How one side builds its manager and its requests."""

    name: str

    def manager(self, config: Config) -> Any:
        raise NotImplementedError

    def request_factory(self, config: Config, max_tokens: int) -> Callable[[str, list[int]], Any]:
        raise NotImplementedError


class Kvcache(Implementation):
    name = "kvcache"

    def manager(self, config: Config) -> Any:
        return build_kvcache_manager(config)

    def request_factory(self, config: Config, max_tokens: int) -> Callable[[str, list[int]], Any]:
        hasher = get_request_block_hasher(config.resolved_hash_block_size)

        def make(rid: str, prompt: list[int]) -> Any:
            return Request(rid, prompt, max_tokens=max_tokens, block_hasher=hasher)

        return make


class Vllm(Implementation):
    name = "vLLM"

    def __init__(self) -> None:
        from kvfuzz.harness.vllm_api import load_vllm

        self._v = load_vllm()
        self.version = f"vLLM {self._v.version}"

    def manager(self, config: Config) -> Any:
        from kvfuzz.harness.vllm_target import build_vllm_manager

        return build_vllm_manager(config)

    def request_factory(self, config: Config, max_tokens: int) -> Callable[[str, list[int]], Any]:
        v = self._v
        v["utils"].init_none_hash(v["sha256"])
        hasher = v["utils"].get_request_block_hasher(config.resolved_hash_block_size, v["sha256"])
        params = v["SamplingParams"](max_tokens=max_tokens)
        make_request = v["Request"]

        def make(rid: str, prompt: list[int]) -> Any:
            return make_request(rid, prompt, params, None, arrival_time=0.0,
                                block_hasher=hasher)

        return make


def run_once(impls: list[Implementation], workload: Workload,
             prompts: list[list[int]]) -> list[Run]:
    """One pass of the workload on every implementation, interleaved: each request is created
    on every side in turn and each scheduler step runs on every side in turn, so a slow
    stretch of a shared machine falls on all sides alike. The schedules are identical, so
    the sides finish on the same step (checked afterwards through `Run.schedule`).
    """
    sides = []
    for impl in impls:
        run = Run()
        scheduler = Scheduler(
            TimedManager(impl.manager(workload.config), run),
            max_model_len=workload.config.max_model_len,
            token_budget=workload.token_budget,
            max_running=workload.max_running,
            mamba_block_aligned_split=any(
                g.mamba_cache_mode == "align" for g in workload.config.groups),
            use_eagle=workload.config.use_eagle,
        )
        sides.append((run, scheduler, impl.request_factory(workload.config,
                                                           workload.decode_steps)))
    gc.collect()
    gc.disable()
    try:
        clock = time.perf_counter_ns
        for i, prompt in enumerate(prompts):
            for run, scheduler, make in sides:
                start = clock()
                request = make(f"r{i}", prompt)
                run.add("Request creation (hashing)", clock() - start)
                scheduler.add_request(request)

        def sample(request: Any) -> int:
            return request.num_tokens * 7919 % 32_000

        loaded: list[set[str]] = [set() for _ in sides]
        while any(scheduler.waiting or scheduler.running or scheduler.loads
                  for _, scheduler, _ in sides):
            for (run, scheduler, _), tried in zip(sides, loaded):
                if workload.connector:
                    _play_connector(scheduler, tried, workload.prompt_len // 2)
                if scheduler.waiting or scheduler.running:
                    out = scheduler.step(sample)
                    run.preemptions += len(out.preempted)
                    run.schedule.append((out.scheduled, out.preempted, out.finished))
    finally:
        gc.enable()
    return [run for run, _, _ in sides]


def _play_connector(scheduler: Scheduler, tried: set[str], num_external_tokens: int) -> None:
    """Before a step: the loads started before the last step land (every fourth one short, with
    half its tokens), then up to two waiting requests of the unshared half start theirs."""
    for rid in scheduler.loads:
        scheduler.finish_load(rid, num_external_tokens // 2 if int(rid[1:]) % 8 == 3 else None)
    started = 0
    for request in scheduler.waiting:
        rid = request.request_id
        if started == 2:
            break
        if int(rid[1:]) % 2 == 1 and rid not in tried and not request.num_computed_tokens:
            tried.add(rid)
            started += scheduler.start_load(rid, num_external_tokens) is not None


def bench(workload: Workload, impls: list[Implementation]) -> bool:
    """Run and print one workload; whether both sides gave identical tables and schedules."""
    prompts = workload.prompts()
    runs: dict[str, list[Run]] = {impl.name: [] for impl in impls}
    # A discarded warm-up pass: the first passes of a process grow its heap, and page faults
    # then land on whichever side allocates first.
    run_once(impls, workload, prompts)
    for repeat in range(workload.repeats):
        # Alternate who goes first within each interleaved step, too.
        order = impls if repeat % 2 == 0 else impls[::-1]
        for impl, run in zip(order, run_once(order, workload, prompts)):
            runs[impl.name].append(run)
    kv, vl = (runs[impl.name] for impl in impls)
    print(f"\n== {workload.name}: {workload.num_requests} requests of {workload.prompt_len} "
          f"tokens (half share {workload.shared_prefix_len}), {workload.decode_steps} decode "
          f"steps, block sizes {sorted(set(workload.config.block_sizes))}, budget {workload.token_budget}, max running "
          f"{workload.max_running}, {workload.repeats} repeats after a warm-up ==")
    # The wrapper's own cost, the same code on both sides: one figure for both.
    wrapper = statistics.median(r.us_per_call(WRAPPER) for r in kv + vl)
    print(f"  {'operation':32} {'kvcache us':>11} {'vLLM us':>10} {'kv/vLLM':>8} {'net':>6} "
          f"{'calls':>9} {'repeats':>10}")
    for op in (*OPERATIONS, WRAPPER):
        if not kv[0].calls[op]:
            continue
        a = statistics.median(r.us_per_call(op) for r in kv)
        b = statistics.median(r.us_per_call(op) for r in vl)
        net = f"{(a - wrapper) / (b - wrapper):6.2f}" if op != WRAPPER and b > wrapper else ""
        spread = _spread([x.us_per_call(op) / y.us_per_call(op) for x, y in zip(kv, vl)])
        print(f"  {op:32} {a:11.2f} {b:10.2f} {a / b:8.2f} {net:>6} {kv[0].calls[op]:9d} "
              f"{spread:>10}")
    # The workload as a whole: every timed call of both kinds (the wrapper row aside), each
    # operation's mean weighted by its calls, over all the calls.
    a, b = (statistics.median(_us_per_op(r) for r in runs) for runs in (kv, vl))
    calls = sum(kv[0].calls[op] for op in OPERATIONS)
    spread = _spread([_us_per_op(x) / _us_per_op(y) for x, y in zip(kv, vl)])
    print(f"  {'all calls (time per op)':32} {a:11.2f} {b:10.2f} {a / b:8.2f} "
          f"{(a - wrapper) / (b - wrapper):6.2f} {calls:9d} {spread:>10}")
    print(f"  net: kv/vLLM with the empty timed call's {wrapper:.2f} us taken off both sides; "
          "repeats: the lowest and highest kv/vLLM of single repeats (each repeat's two passes "
          "ran interleaved)")
    same = all(r.tables == vl[0].tables and r.schedule == vl[0].schedule for r in kv + vl)
    print(f"  preemptions: {kv[0].preemptions} (kvcache), {vl[0].preemptions} (vLLM); "
          f"steps: {len(kv[0].schedule)}")
    print(f"  identical block tables: {'yes' if same else 'no'}")
    return same


def _spread(ratios: list[float]) -> str:
    """The range of per-repeat ratios: how far one repeat's figure moves on this machine."""
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def _us_per_op(run: Run) -> float:
    """Mean microseconds per call over every operation of one pass (each operation's slowest
    1% left out, as in its own row)."""
    ops = [op for op in OPERATIONS if run.calls[op]]
    total = sum(run.us_per_call(op) * run.calls[op] for op in ops)  # type: ignore[operator]
    return total / sum(run.calls[op] for op in ops)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int,
                        help="repeats per workload (default: 5; 9 for full + SWA and long context)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--only", metavar="TEXT", help="run the workloads whose name has TEXT")
    args = parser.parse_args(argv)
    vllm = Vllm()
    impls = [Kvcache(), vllm]
    print(f"kvcache vs {vllm.version}")
    start = time.monotonic()
    differing = []
    for workload in _workloads(args.quick):
        if args.only and args.only not in workload.name:
            continue
        if args.repeats:
            workload = Workload(**{**workload.__dict__, "repeats": args.repeats})
        if not bench(workload, impls):
            differing.append(workload.name)
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    if differing:
        sys.exit(f"block tables or schedules differ: {'; '.join(differing)}")


if __name__ == "__main__":
    main()
