"""Does kvcache's per-operation cost depend on the pool size? It should not (docs/spec.md §2.2, §3).

Runs one allocate/decode/free workload (200 requests, prompts of 64-512 tokens drawn over a
few shared prefixes, block size 16, a few decode steps each, then free) on a 1,000-block and a
1,000,000-block pool, and prints microseconds per operation (median of the repeats) for each
pool size and the ratio big/small, plus the pool construction time. Figures only: nothing is
asserted about time.

    python bench/bench_kvcache_scaling.py
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable


from kvfuzz.kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    get_request_block_hasher,
)

BLOCK_SIZE = 16
NUM_REQUESTS = 200
CONCURRENT = 8
"""Requests admitted together before they decode and are freed: at most ~260 blocks held,
so the workload fits the small pool."""
DECODE_STEPS = 4
REPEATS = 5
POOL_SIZES = (1_000, 1_000_000)
MAX_MODEL_LEN = 1024
OPERATIONS = (
    "get_computed_blocks",
    "allocate_slots (admission)",
    "allocate_slots (decode)",
    "free",
)


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of 64-512 tokens, each starting with one of eight shared prefixes."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(32_000) for _ in range(rng.choice((32, 64, 128, 256)))] for _ in range(8)
    ]
    prompts = []
    for _ in range(NUM_REQUESTS):
        prefix = rng.choice(prefixes)
        length = rng.randint(max(64, len(prefix) + 1), 512)
        prompts.append(prefix + [rng.randrange(32_000) for _ in range(length - len(prefix))])
    return prompts


def build_manager(num_blocks: int) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=BLOCK_SIZE))],
    )
    return KVCacheManager(config, MAX_MODEL_LEN, BLOCK_SIZE, BLOCK_SIZE)


def run_workload(
    manager: KVCacheManager, prompts: list[list[int]], hasher: Callable[[Request], list[bytes]]
) -> tuple[dict[str, float], int]:
    """Nanoseconds per call of each operation, and the total prefix hit in tokens."""
    clock = time.perf_counter_ns
    total_ns = dict.fromkeys(OPERATIONS, 0)
    calls = dict.fromkeys(OPERATIONS, 0)
    hit_tokens = 0
    requests = [Request(f"r{i}", p, block_hasher=hasher) for i, p in enumerate(prompts)]
    for start in range(0, len(requests), CONCURRENT):
        batch = requests[start : start + CONCURRENT]
        for request in batch:
            t0 = clock()
            blocks, hit, _ = manager.get_computed_blocks(request)
            t1 = clock()
            new_blocks = manager.allocate_slots(
                request, request.num_tokens - hit, hit, blocks, has_scheduled_reqs=False
            )
            t2 = clock()
            if new_blocks is None:
                raise RuntimeError(f"admission of {request.request_id} refused: pool too small")
            total_ns["get_computed_blocks"] += t1 - t0
            total_ns["allocate_slots (admission)"] += t2 - t1
            hit_tokens += hit
            request.num_computed_tokens = request.num_tokens
            request.status = RequestStatus.RUNNING
        for step in range(DECODE_STEPS):
            for request in batch:
                request.append_output_token_ids(step)
                t0 = clock()
                new_blocks = manager.allocate_slots(request, 1)
                total_ns["allocate_slots (decode)"] += clock() - t0
                if new_blocks is None:
                    raise RuntimeError(f"decode of {request.request_id} refused: pool too small")
                request.num_computed_tokens += 1
        for request in batch:
            t0 = clock()
            manager.free(request)
            total_ns["free"] += clock() - t0
            request.status = RequestStatus.FINISHED_STOPPED
        calls["get_computed_blocks"] += len(batch)
        calls["allocate_slots (admission)"] += len(batch)
        calls["allocate_slots (decode)"] += len(batch) * DECODE_STEPS
        calls["free"] += len(batch)
    return {op: total_ns[op] / calls[op] for op in OPERATIONS}, hit_tokens


def measure(prompts: list[list[int]]) -> dict[int, tuple[float, dict[str, float], int]]:
    """Per pool size: median construction seconds, median microseconds per operation, and
    the prefix hit in tokens. One discarded warm-up run, then the pool sizes take turns in
    every repeat, so warm-up and drift do not favour either size.
    """
    hasher = get_request_block_hasher(BLOCK_SIZE)
    run_workload(build_manager(min(POOL_SIZES)), prompts, hasher)
    build_s: dict[int, list[float]] = {n: [] for n in POOL_SIZES}
    per_op: dict[int, dict[str, list[float]]] = {
        n: {op: [] for op in OPERATIONS} for n in POOL_SIZES
    }
    hits: dict[int, set[int]] = {n: set() for n in POOL_SIZES}
    for _ in range(REPEATS):
        for num_blocks in POOL_SIZES:
            gc.collect()
            t0 = time.perf_counter()
            manager = build_manager(num_blocks)
            build_s[num_blocks].append(time.perf_counter() - t0)
            ns_per_op, hit_tokens = run_workload(manager, prompts, hasher)
            for op, ns in ns_per_op.items():
                per_op[num_blocks][op].append(ns / 1000)
            hits[num_blocks].add(hit_tokens)
            del manager
    results = {}
    for num_blocks in POOL_SIZES:
        (hit_tokens,) = hits[num_blocks]  # deterministic: every repeat hits the same
        results[num_blocks] = (
            statistics.median(build_s[num_blocks]),
            {op: statistics.median(v) for op, v in per_op[num_blocks].items()},
            hit_tokens,
        )
    return results


def main() -> None:
    prompts = make_prompts()
    small, big = POOL_SIZES
    results = measure(prompts)
    print(
        f"kvcache scaling: {NUM_REQUESTS} requests of 64-512 tokens, block size {BLOCK_SIZE}, "
        f"{CONCURRENT} at a time, {DECODE_STEPS} decode steps each; median of {REPEATS} repeats"
    )
    width = max(len(op) for op in OPERATIONS) + 8
    print(f"{'operation':<{width}}{small:>14,} blk{big:>14,} blk{'big/small':>12}")
    build_small, build_big = results[small][0], results[big][0]
    print(
        f"{'pool construction (ms)':<{width}}{build_small * 1e3:>18.2f}{build_big * 1e3:>18.2f}"
        f"{build_big / build_small:>12.1f}"
    )
    for op in OPERATIONS:
        a, b = results[small][1][op], results[big][1][op]
        print(f"{op + ' (us/op)':<{width}}{a:>18.2f}{b:>18.2f}{b / a:>12.2f}")
    print(f"prefix-hit tokens per run: {results[small][2]:,} (small), {results[big][2]:,} (big)")


if __name__ == "__main__":
    main()
