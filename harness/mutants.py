"""Deliberately broken variants of kvcache: the planted bugs every property must be seen catching.

Each variant is a target `bug:NAME`: kvcache with one method patched on the built instances,
modelled on a row of docs/bugs.md (or a classic of the field). Patches wrap the real
methods where they can, so each variant differs from kvcache in exactly one behaviour.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvfuzz.core.config import Config
from kvfuzz.harness.kvcache_target import KvcacheSide
from kvfuzz.harness.manager_side import publishes_after_output
from kvfuzz.harness.targets import register_target


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    patch: Callable[[KvcacheSide], None]
    bug: str = ""
    """The docs/bugs.md row (or source) the plant is modelled on."""
    configs: tuple[str, ...] | None = None
    """Built-in configs where the bug can show (None: any)."""
    needs_data: bool = False
    """Only the data checks (`--data`) can see it: counts, queues and keys stay right."""


MUTANTS: dict[str, Mutant] = {}

# The six plants the checker issue names; the campaign benchmark times these.
REQUIRED = (
    "predictor-off-by-one",
    "touch-leaves-queued",
    "free-forgets-decrement",
    "free-forward-order",
    "hit-reaches-num-tokens",
    "salt-ignored",
)


def mutant(name: str, description: str, *, bug: str = "", configs: tuple[str, ...] | None = None,
           needs_data: bool = False) -> Callable[[Callable[[KvcacheSide], None]], Any]:
    def register(patch: Callable[[KvcacheSide], None]) -> Callable[[KvcacheSide], None]:
        MUTANTS[name] = Mutant(name, description, patch, bug, configs, needs_data)

        class Broken(KvcacheSide):
            def build_manager(self, config: Config) -> Any:
                manager = super().build_manager(config)
                self.manager = manager
                patch(self)
                return manager

        Broken.name = f"bug:{name}"
        Broken.__name__ = Broken.__qualname__ = f"Bug_{name.replace('-', '_')}"
        seen_by = "; only --data sees it" if needs_data else ""
        register_target(f"bug:{name}", f"planted bug ({bug or 'classic'}{seen_by}): "
                        f"{description}", Broken)
        return patch

    return register


def _around(obj: Any, name: str, around: Callable[..., Any]) -> None:
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(obj, name, wrapper)


def _pool(side: KvcacheSide) -> Any:
    return side.manager.block_pool


def _singles(side: KvcacheSide) -> tuple[Any, ...]:
    return side.manager.coordinator.single_type_managers


@mutant("predictor-off-by-one", "group 0's get_num_blocks_to_allocate says one block too few",
        bug="docs/bugs.md #21")
def _predictor_off_by_one(side: KvcacheSide) -> None:
    def around(original, *args, **kwargs):
        value = original(*args, **kwargs)
        return value - 1 if value > 0 else value

    _around(_singles(side)[0], "get_num_blocks_to_allocate", around)


@mutant("touch-leaves-queued", "touch takes a reference on a free hit block but leaves it queued",
        bug="docs/bugs.md #26 / v0 #16825")
def _touch_leaves_queued(side: KvcacheSide) -> None:
    def around(original, blocks):
        original([b for b in blocks if b.ref_cnt > 0])
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                b.ref_cnt = 1

    _around(_pool(side), "touch_own", around)


@mutant("touch-unvalidated", "touch takes each reference before looking at the next entry, "
        "with no undo (kvcache before its misuse contract); only the misuse driver sees it",
        bug="issue 13: touch([free_block, 7])")
def _touch_unvalidated(side: KvcacheSide) -> None:
    pool = _pool(side)

    def touch(blocks):
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                pool.free_block_queue.remove(block)
            block.ref_cnt += 1

    pool.touch = touch


@mutant("probe-ignores-hit-limit", "get_num_cached_tokens probes up to num_tokens - 1, "
        "ignoring the request's prefix_cache_hit_limit (as vLLM 0.34 does)",
        bug="docs/findings/008-probe-ignores-hit-limit.md")
def _probe_ignores_hit_limit(side: KvcacheSide) -> None:
    manager = side.manager

    def probe(request):
        if not manager.prefix_cache_lookup_enabled(request):
            return 0
        return manager.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)[1]

    manager.get_num_cached_tokens = probe


@mutant("free-forgets-decrement",
        "release (free_blocks) forgets the decrement of the last block it is given", bug="docs/bugs.md #1, #22")
def _free_forgets_decrement(side: KvcacheSide) -> None:
    def around(original, ordered_blocks, evict_first=False):
        blocks = list(ordered_blocks)
        real = [b for b in blocks if not b.is_null]
        if len(real) > 1:
            real[-1].ref_cnt += 1
        original(blocks, evict_first)

    _around(_pool(side), "release", around)


@mutant("free-forward-order", "a request's blocks are freed head first instead of tail first",
        bug="docs/bugs.md #11")
def _free_forward_order(side: KvcacheSide) -> None:
    for single in _singles(side):
        single.free = lambda request_id, m=single: m.block_pool.free_blocks(
            m.pop_blocks_for_free(request_id)
        )


@mutant("hit-reaches-num-tokens", "the prefix hit may cover the whole prompt (no token left to "
        "compute)", bug="docs/spec.md §10.15")
def _hit_reaches_num_tokens(side: KvcacheSide) -> None:
    # The ceiling lives in Request.get_max_cache_hit_length (num_tokens - 1, lowered by the hit
    # limit and the bound): during a lookup, and the probe that predicts it, it starts from
    # num_tokens instead.
    def around(original, request, *bound):
        def whole_prompt(bound=None):
            caps = (request.num_tokens, request.prefix_cache_hit_limit, bound)
            return min(c for c in caps if c is not None)

        request.get_max_cache_hit_length = whole_prompt
        try:
            return original(request, *bound)
        finally:
            del request.get_max_cache_hit_length

    _around(side.manager, "get_computed_blocks", around)
    _around(side.manager, "get_num_cached_tokens", around)


@mutant("lookup-ignores-bound", "get_computed_blocks ignores its max_cache_hit_length bound",
        bug="docs/spec.md §6.3 step 2 / I12")
def _lookup_ignores_bound(side: KvcacheSide) -> None:
    def around(original, request, max_cache_hit_length=None):
        return original(request)

    _around(side.manager, "get_computed_blocks", around)


_HASHED_FIELDS = ("request_id", "block_hashes", "num_tokens", "all_token_ids", "cache_salt",
                  "lora_request", "mm_features", "prompt_embeds", "prompt_is_token_ids")


def _hash_as(side: KvcacheSide, **changes: Callable[[Any], Any]) -> None:
    """Hash every request as if the named fields were what `changes` makes of the request."""
    hasher = side._hasher

    def hash_view(request):
        fields = {name: getattr(request, name) for name in _HASHED_FIELDS}
        fields.update({name: change(request) for name, change in changes.items()})
        return hasher(SimpleNamespace(**fields))

    side._hasher = hash_view


@mutant("salt-ignored", "the block-0 hash leaves the cache salt out",
        bug="docs/bugs.md #17, #16")
def _salt_ignored(side: KvcacheSide) -> None:
    _hash_as(side, cache_salt=lambda request: None)


@mutant("lora-name-only", "a LoRA adapter keys blocks by its name, not its path",
        bug="docs/bugs.md #16", configs=("tenants",))
def _lora_name_only(side: KvcacheSide) -> None:
    def same_path(request):
        lora = request.lora_request
        return lora and SimpleNamespace(lora_name=lora.lora_name, lora_int_id=1, lora_path="/")

    _hash_as(side, lora_request=same_path)


@mutant("lora-keys-by-id", "a LoRA adapter keys blocks by its name and id, not its path "
        "(kvcache before vLLM 0.34's rule)", bug="docs/bugs.md #16", configs=("tenants",))
def _lora_keys_by_id(side: KvcacheSide) -> None:
    def id_as_path(request):
        lora = request.lora_request
        return lora and SimpleNamespace(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id,
                                        lora_path=f"id {lora.lora_int_id}")

    _hash_as(side, lora_request=id_as_path)


@mutant("mm-later-input-unkeyed", "block keys name only a request's first multimodal input, "
        "as if the input index never moved past it", bug="docs/spec.md §2.3",
        configs=("tenants",))
def _mm_later_input_unkeyed(side: KvcacheSide) -> None:
    _hash_as(side, mm_features=lambda request: request.mm_features[:1])


@mutant("lora-salt-untagged", "untagged extra keys: a LoRA name reads as a cache salt",
        bug="docs/bugs.md #17", configs=("tenants",))
def _lora_salt_untagged(side: KvcacheSide) -> None:
    _hash_as(side, lora_request=lambda request: None,
             cache_salt=lambda request: request.cache_salt or (
                 request.lora_request and request.lora_request.lora_name))


@mutant("embeds-mask-dropped", "prompt-embedding keys leave out which positions hold token ids",
        bug="docs/bugs.md #18", configs=("tenants",))
def _embeds_mask_dropped(side: KvcacheSide) -> None:
    _hash_as(side, prompt_is_token_ids=lambda request: None)


@mutant("weak-hash", "block hashes chain only the sum of a block's tokens",
        bug="docs/bugs.md #19")
def _weak_hash(side: KvcacheSide) -> None:
    hbs = side.config.resolved_hash_block_size

    def weak(request):
        out, parent = [], request.block_hashes[-1] if request.block_hashes else b"seed"
        tokens = request.all_token_ids
        for k in range(len(request.block_hashes), request.num_tokens // hbs):
            block = tokens[k * hbs:(k + 1) * hbs]
            parent = hashlib.sha256(parent + str(sum(block)).encode()).digest()
            out.append(parent)
        return out

    side._hasher = weak


@mutant("plain-extras-empty", "a plain request's blocks hash with an empty extra-keys value "
        "where the documented function has none (vLLM: `()` for None): every hash changes alike",
        bug="docs/spec.md §2.3")
def _plain_extras_empty(side: KvcacheSide) -> None:
    from kvfuzz.kvcache.kv_cache_utils import has_extra_keys

    real = side._hasher

    def hasher(request):
        hashes = real(request)
        if has_extra_keys(request):
            return hashes
        return [hashlib.sha256(bytes(h) + b"()").digest() for h in hashes]

    hasher.yields_digests = True
    hasher.hash_block_size = real.hash_block_size
    side._hasher = hasher


@mutant("removed-while-held", "BlockRemoved for every evicted copy of a key, though another "
        "block still holds it", bug="docs/bugs.md #25", configs=("events",))
def _removed_while_held(side: KvcacheSide) -> None:
    from kvfuzz.kvcache.kv_events import BlockRemoved, _split

    pool = side.manager.block_pool

    def removed(keys):
        for key in keys:
            block_hash, group = _split(key)
            pool.kv_event_queue.append(BlockRemoved([block_hash], group_idx=group))

    pool._removed = removed


@mutant("deferred-free-whole-list", "a deferred free reverses the concatenated blocks of every "
        "group once instead of freeing each group tail first", bug="docs/bugs.md #11",
        configs=("deferred",))
def _deferred_free_whole_list(side: KvcacheSide) -> None:
    pool = side.manager.block_pool

    def free_deferred_blocks(blocks_per_group, evict_first=False):
        pool.free_blocks([b for blocks in blocks_per_group for b in blocks][::-1], evict_first)

    side.manager.free_deferred_blocks = free_deferred_blocks


def _on_scheduler(side: KvcacheSide, patch: Callable[[Any], None]) -> None:
    """Patch the scheduler driver the side builds next (scheduler level only)."""
    build = side.build_scheduler

    def built(config: Config) -> Any:
        scheduler = build(config)
        patch(scheduler)
        return scheduler

    side.build_scheduler = built  # type: ignore[method-assign]


@mutant("inflight-freed-at-once", "the driver frees a finished or preempted request's blocks at "
        "once although a step still in flight reads them", bug="docs/spec.md §7.1",
        configs=("deferred",))
def _inflight_freed_at_once(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        scheduler._free = scheduler.manager.free

    _on_scheduler(side, patch)


@mutant("dynamic-drafts-fixed", "the driver ignores the batch-size schedule of dynamic "
        "speculative decoding: every step drafts num_speculative_tokens (still unpadded)",
        bug="docs/spec.md §7.3", configs=("dynamic_drafts",))
def _dynamic_drafts_fixed(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        table = scheduler._drafts_by_batch
        if table is not None:
            scheduler._drafts_by_batch = [scheduler.num_speculative_tokens] * len(table)

    _on_scheduler(side, patch)


@mutant("inflight-fence-one-late", "a deferred free waits for the step after the newest one "
        "launched, so its blocks outlive every step in flight (a leak once they drain)",
        bug="docs/spec.md §7.1", configs=("deferred",))
def _inflight_fence_one_late(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        def late(original, request):
            scheduler._launched += 1
            try:
                original(request)
            finally:
                scheduler._launched -= 1

        _around(scheduler, "_free", late)

    _on_scheduler(side, patch)


@mutant("encoder-budget-per-request", "the driver's encoder budget is not shared by a step's "
        "requests: each request's multimodal inputs get the whole budget",
        bug="docs/spec.md §7.2", configs=("tenants",))
def _encoder_budget_per_request(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        def whole(original, *args):
            scheduler._encoder_left = scheduler.encoder_budget
            return original(*args)

        _around(scheduler, "_encoder_inputs", whole)

    _on_scheduler(side, patch)


@mutant("cross-encoder-unbudgeted", "the driver lets an encoder-decoder request's encoder "
        "input past the step's encoder budget", bug="docs/spec.md §7.2", configs=("cross",))
def _cross_encoder_unbudgeted(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        def unbudgeted(original, request, *args):
            if not getattr(request, "num_encoder_tokens", 0):
                return original(request, *args)
            left, scheduler._encoder_left = scheduler._encoder_left, None
            try:
                return original(request, *args)
            finally:
                scheduler._encoder_left = left

        _around(scheduler, "_encoder_inputs", unbudgeted)

    _on_scheduler(side, patch)


@mutant("inflight-drain-whole-list", "the driver releases a deferred free by reversing the "
        "concatenated blocks of every group once (vLLM 0.34's Scheduler._drain_deferred_frees), "
        "not each group tail first", bug="docs/bugs.md #11", configs=("deferred",))
def _inflight_drain_whole_list(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        pool = scheduler.manager.block_pool
        scheduler._release = lambda runs: pool.free_blocks(
            [b for run in runs for b in run][::-1])

    _on_scheduler(side, patch)


@mutant("reset-keeps-running", "the driver's reset_prefix_cache ignores "
        "reset_running_requests: nothing is preempted, and the reset fails while requests run",
        bug="vLLM's Scheduler.reset_prefix_cache", configs=("events",))
def _reset_keeps_running(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        scheduler.reset_prefix_cache = lambda reset_running_requests=False: (
            scheduler.manager.reset_prefix_cache())

    _on_scheduler(side, patch)


@mutant("reset-preempts-in-order", "the driver's reset_prefix_cache preempts the running "
        "requests first to last, so they free in the other order and wait reversed",
        bug="vLLM's Scheduler.reset_prefix_cache", configs=("events",))
def _reset_preempts_in_order(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        def reset_prefix_cache(reset_running_requests: bool = False) -> bool:
            while reset_running_requests and scheduler._running:
                scheduler._preempt(scheduler._running.pop(0))
            return scheduler.manager.reset_prefix_cache()

        scheduler.reset_prefix_cache = reset_prefix_cache

    _on_scheduler(side, patch)


@mutant("evict-first-ignored", "free_blocks(evict_first=True) queues cached blocks at the tail, "
        "as a plain free does, so blocks another tier holds outlive the ones it does not",
        bug="vLLM 0.34 BlockPool.free_blocks(evict_first)", configs=("deferred",))
def _evict_first_ignored(side: KvcacheSide) -> None:
    _around(side.manager.block_pool, "free_blocks",
            lambda original, blocks, evict_first=False: original(blocks))


@mutant("reset-not-announced", "a successful prefix-cache reset emits no AllBlocksCleared",
        bug="docs/spec.md §3.10", configs=("events",))
def _reset_not_announced(side: KvcacheSide) -> None:
    pool = side.manager.block_pool

    def around(original):
        queued = len(pool.kv_event_queue)
        done = original()
        del pool.kv_event_queue[queued:]
        return done

    _around(pool, "reset_prefix_cache", around)


@mutant("stored-parent-dropped", "every BlockStored names no parent, as if its chain started "
        "at token 0", bug="docs/spec.md §3.10", configs=("events",))
def _stored_parent_dropped(side: KvcacheSide) -> None:
    pool = side.manager.block_pool

    def around(original, *args, **kwargs):
        queued = len(pool.kv_event_queue)
        out = original(*args, **kwargs)
        pool.kv_event_queue[queued:] = [
            dataclasses.replace(e, parent_block_hash=None)
            if hasattr(e, "parent_block_hash") else e for e in pool.kv_event_queue[queued:]
        ]
        return out

    _around(pool, "register_full_blocks", around)


@mutant("stored-extra-keys-at-start", "each BlockStored names every block's extra keys as "
        "block 0's (its start read as token 0), as vLLM mutants of block_pool.py:306 do: a "
        "salted request's later blocks name the salt", bug="docs/mutation.md events misses",
        configs=("events",))
def _stored_extra_keys_at_start(side: KvcacheSide) -> None:
    from kvfuzz.kvcache import kv_events

    pool = side.manager.block_pool
    keys_of = kv_events.event_extra_keys

    def around(original, *args, **kwargs):
        kv_events.event_extra_keys = (
            lambda request, start, end, lookahead: keys_of(request, 0, end - start, lookahead))
        try:
            return original(*args, **kwargs)
        finally:
            kv_events.event_extra_keys = keys_of

    _around(pool, "register_full_blocks", around)


@mutant("stored-on-every-hit", "a prefix-cache hit re-announces the blocks it reuses as "
        "BlockStored, as vLLM's kv_cache_report_mode \"full\" does, for every request",
        bug="vLLM emit_cached_block_events without the mode", configs=("events",))
def _stored_on_every_hit(side: KvcacheSide) -> None:
    from kvfuzz.kvcache.kv_cache_utils import resolve_block_hashes
    from kvfuzz.kvcache.kv_events import BlockStored

    manager = side.manager
    pool = manager.block_pool

    def around(original, request, *args, **kwargs):
        out = original(request, *args, **kwargs)
        blocks, num_hit_tokens = out[0], out[1]
        for g, group in enumerate(side.config.groups):
            hit = list(blocks.blocks[g]) if num_hit_tokens else []
            if not hit or any(b.is_null for b in hit):
                continue
            bs = group.block_size
            hashes = resolve_block_hashes(request.block_hashes, pool.hash_block_size, bs)
            pool.kv_event_queue.append(BlockStored(
                list(hashes[:len(hit)]), None, list(request.all_token_ids[:len(hit) * bs]), bs,
                group_idx=g))
        return out

    _around(manager, "get_computed_blocks", around)


@mutant("cached-report-dropped", "a lookup of a request in kv_cache_report_mode \"full\" "
        "re-announces none of the blocks its hit reuses", bug="vLLM kv_cache_manager.py:331-339",
        configs=("events_tenants",))
def _cached_report_dropped(side: KvcacheSide) -> None:
    side.manager.block_pool.emit_hit_block_events = lambda *args, **kwargs: None


@mutant("hit-report-names-null-blocks", "a lookup of a request in kv_cache_report_mode "
        "\"full\" re-announces its whole hit list from token 0, the keys of its null "
        "placeholders included, as vLLM does", bug="docs/findings/027")
def _hit_report_names_null_blocks(side: KvcacheSide) -> None:
    pool = side.manager.block_pool

    def around(original, request, blocks, block_size, kv_cache_group_id, *_):
        # vLLM's: the hit list's length only
        pool.emit_cached_block_events(request, len(blocks), block_size, kv_cache_group_id)

    _around(pool, "emit_hit_block_events", around)


@mutant("hit-report-partial-as-full", "a lookup of a request in kv_cache_report_mode \"full\" "
        "whose hit ends inside a block re-announces that block under its full key, as vLLM "
        "does", bug="docs/findings/036")
def _hit_report_partial_as_full(side: KvcacheSide) -> None:
    # Without the hit's length, every block of the hit is announced as a full one.
    _around(side.manager.block_pool, "emit_hit_block_events",
            lambda original, *args: original(*args[:4]))


@mutant("promoted-partial-unannounced", "promoting a partial entry to a full block's key emits "
        "no BlockRemoved for the partial key it drops", bug="docs/spec.md §3.10",
        configs=("events_partial",))
def _promoted_partial_unannounced(side: KvcacheSide) -> None:
    pool = side.manager.block_pool

    def around(original, *args, **kwargs):
        pool._evicting_inline = True  # what the eventful pool reads as "removals reported"
        try:
            return original(*args, **kwargs)
        finally:
            pool._evicting_inline = False

    _around(pool, "register_full_blocks", around)


@mutant("partial-promotion-keeps-key", "a block keyed on a partial prefix keeps that key when "
        "a longer partial entry promotes it, and files the longer one beside it",
        bug="vLLM 0.34.0 block_pool.py:525 `n * hbs` -> `n - hbs` (docs/mutation.md, S32)",
        configs=("qwen3_next_mtp",))
def _partial_promotion_keeps_key(side: KvcacheSide) -> None:
    pool = side.manager.block_pool

    def around(original, request, block, num_tokens, key, replace_existing_hashes=False):
        if replace_existing_hashes:
            return original(request, block, num_tokens, key, replace_existing_hashes)
        pool._insert_block_hash(key, block, num_tokens)  # no removal of the shorter key first
        return key

    _around(pool, "register_partial_block", around)


@mutant("resumed-checkpoint-dropped", "a Mamba prefill checkpoint on a block end that is not "
        "the prompt's is never retained, so a resumed request's re-prefill drops its state there",
        bug="vLLM 0.34.0 single_type_kv_cache_manager.py:2060 `% bs` -> `* bs` "
        "(docs/mutation.md, S31)",
        configs=("qwen3_5_checkpoint", "nemotron_h_checkpoint", "qwen3_next_checkpoint"))
def _resumed_checkpoint_dropped(side: KvcacheSide) -> None:
    for single in _singles(side):
        if hasattr(single, "_is_retained_block_end"):
            single._is_retained_block_end = lambda num_tokens: False


@mutant("one-token-state-unkeyed", "a Mamba align group keys no 1-token state: the partial "
        "tail's guard stops at 1 token, so with hash blocks of 1 a 2-token prompt's state at "
        "token 1 is left unkeyed",
        bug="vLLM 0.34.0 single_type_kv_cache_manager.py:2090 `<= 0` -> `<= 1` "
        "(docs/mutation.md, S6)",
        configs=("mamba_hbs1",))
def _one_token_state_unkeyed(side: KvcacheSide) -> None:
    def around(original, request, num_tokens):
        return None if num_tokens <= 1 else original(request, num_tokens)

    for single in _singles(side):
        if hasattr(single, "_cache_state_tail_block"):
            _around(single, "_cache_state_tail_block", around)


def _release(ordered_blocks: Any) -> list[Any]:
    """Drop one reference per non-null block; the blocks that reach zero, in order."""
    released = []
    for block in ordered_blocks:
        if block.is_null:
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            released.append(block)
    return released


@mutant("uncached-to-tail", "freed blocks without a key go to the queue tail (FIFO reuse)",
        bug="docs/bugs.md #12, #13")
def _uncached_to_tail(side: KvcacheSide) -> None:
    pool = _pool(side)
    pool.release = lambda ordered: pool.free_block_queue.append_n(_release(ordered))


@mutant("cached-to-head", "freed cached blocks go to the queue head, evicted before uncached "
        "ones", bug="docs/spec.md §3.6 / docs/bugs.md #13")
def _cached_to_head(side: KvcacheSide) -> None:
    pool = _pool(side)
    pool.release = lambda ordered: pool.free_block_queue.prepend_n(_release(ordered))


@mutant("touch-before-check", "hit blocks are touched before the capacity check and not "
        "released on None", bug="docs/bugs.md #10")
def _touch_before_check(side: KvcacheSide) -> None:
    pool = _pool(side)

    def around(original, request, num_new_tokens, *args, **kwargs):
        hits = kwargs.get("new_computed_blocks")
        held = [b for group in hits.blocks for b in group if not b.is_null] if hits else []
        pool.touch(held)
        result = original(request, num_new_tokens, *args, **kwargs)
        if result is not None:
            for b in held:
                b.ref_cnt -= 1
        return result

    _around(side.manager, "allocate_slots", around)


@mutant("stale-hash-on-evict", "evicting one of several blocks under a key leaves its hash "
        "set", bug="docs/bugs.md #8")
def _stale_hash_on_evict(side: KvcacheSide) -> None:
    pool = _pool(side)

    def around(original, block):
        cache_map = pool.cached_block_hash_to_block
        if block.block_hash in cache_map._dup_ids:
            cache_map.pop(block.block_hash, block.block_id)
            return
        original(block)

    _around(pool, "_remove_cached_block_hashes", around)


@mutant("no-eviction-on-pop", "get_new_blocks hands out cached blocks without evicting their "
        "keys", bug="v0 PR #4761 / kvcached #362")
def _no_eviction_on_pop(side: KvcacheSide) -> None:
    pool = _pool(side)

    def around(original, num_blocks):
        caching, pool.enable_caching = pool.enable_caching, False
        try:
            return original(num_blocks)
        finally:
            pool.enable_caching = caching

    _around(pool, "get_new_blocks", around)


@mutant("capped-step-predictor", "the per-step predictor applies the admission cap meant only for "
        "the full-sequence gate", bug="docs/bugs.md #2",
        configs=("sliding_window", "chunked_local"))
def _capped_step_predictor(side: KvcacheSide) -> None:
    # The flag arrives positionally or by name: binding the signature catches both.
    def around(original, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
               num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
               prefill_end=0):
        return original(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                        num_local_computed_tokens, num_tokens_main_model, True, prefill_end)

    for single in _singles(side):
        _around(single, "get_num_blocks_to_allocate", around)


@mutant("window-never-freed", "remove_skipped_blocks never frees blocks that left the window",
        bug="docs/bugs.md #3", configs=("sliding_window", "chunked_local", "hybrid", "hybrid3"))
def _window_never_freed(side: KvcacheSide) -> None:
    for single in _singles(side):
        single.remove_skipped_blocks = lambda *args, **kwargs: None


@mutant("null-block-queued", "freeing keeps a window table's leading nulls and queues the null "
        "block", bug="docs/spec.md §10.8",
        configs=("sliding_window", "chunked_local", "hybrid", "hybrid3"))
def _null_block_queued(side: KvcacheSide) -> None:
    pool = _pool(side)

    def free(request_id: str, m: Any) -> None:
        blocks = m.req_to_blocks.get(request_id, [])
        has_null = any(b.is_null for b in blocks)
        m.block_pool.free_blocks(reversed(m.pop_blocks_for_free(request_id)))
        if has_null and pool.null_block.prev_free_block is None:
            pool.free_block_queue.append(pool.null_block)

    for single in _singles(side):
        single.free = functools.partial(free, m=single)


@mutant("reset-while-held", "reset_prefix_cache clears the cache even while blocks are held",
        bug="docs/bugs.md #23")
def _reset_while_held(side: KvcacheSide) -> None:
    pool = _pool(side)

    def replacement():
        pool.cached_block_hash_to_block.clear()
        pool.cached_block_hashes_by_block.clear()
        for block in pool.blocks:
            block.reset_hash()
        return True

    pool.reset_prefix_cache = replacement


@mutant("watermark-ignored", "the watermark is not applied to waiting requests",
        bug="docs/spec.md §10.19", configs=("watermark",))
def _watermark_ignored(side: KvcacheSide) -> None:
    side.manager.watermark_blocks = 0


@mutant("watermark-subtracted", "an admission needs `needed - watermark` free blocks instead of "
        "`needed + watermark`", bug="vLLM 0.34.0 kv_cache_manager.py:606, survivor #11 "
        "(docs/mutation.md)", configs=("watermark",))
def _watermark_subtracted(side: KvcacheSide) -> None:
    side.manager.watermark_blocks = -side.manager.watermark_blocks


def _overshooting_null_head_len(blocks: list[Any], null_block: Any) -> int:
    """vLLM 0.34.0's `null_head_len` (kv_cache_utils.py:223-240) with its search stepping
    `lo = mid + 2`: past a table of nulls alone, whose fallback scan raises StopIteration."""
    if not blocks or blocks[0] is not null_block:
        return 0
    lo, hi = 1, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid] is null_block:
            lo = mid + 2
        else:
            hi = mid
    if blocks[:lo].count(null_block) == lo:
        return lo
    return next(i for i, block in enumerate(blocks) if block is not null_block)


@mutant("null-head-overshoot", "a freed table's leading nulls are counted by a search that "
        "steps past them, raising on a table of 2, 3, 6 or 7 nulls alone",
        bug="vLLM 0.34.0 kv_cache_utils.py:231, survivor #12 (docs/mutation.md)",
        configs=("chunked_local", "hybrid3"))
def _null_head_overshoot(side: KvcacheSide) -> None:
    null_block = _pool(side).null_block

    def counted(request_id: str, m: Any, original: Callable[[str], Any]) -> Any:
        _overshooting_null_head_len(m.req_to_blocks.get(request_id) or [], null_block)
        return original(request_id)

    for single in _singles(side):
        for name in ("free", "pop_blocks_for_free"):
            setattr(single, name, functools.partial(counted, m=single,
                                                    original=getattr(single, name)))


def _per_group_lookup(coordinator: Any, *, margin_everywhere: bool = False,
                      hashed_or: bool = False) -> Callable[..., Any]:
    """kvcache's per-group lookup of a connector offer (`find_longest_cache_hit_per_group`) with
    one of vLLM 0.34.0's survivors: EAGLE's margin added to every attention group
    (kv_cache_coordinator.py:961 `and` -> `or`), or the margin capped at `len(hashes) | hash
    block size` instead of `*` (:970)."""
    def lookup(block_hashes: Any, max_cache_hit_length: int) -> Any:
        hit_blocks: list[list[Any]] = [[] for _ in coordinator.single_type_managers]
        hit_lengths = [0] * len(coordinator.single_type_managers)
        hbs = coordinator.hash_block_size
        hashed = len(block_hashes) | hbs if hashed_or else len(block_hashes) * hbs
        for spec, group_ids, manager_cls, use_eagle, _ in coordinator.attention_groups:
            max_length = max_cache_hit_length
            if use_eagle or margin_everywhere:  # the margin is 0 on a state group
                max_length = min(max_length + coordinator._eagle_margin(spec, manager_cls),
                                 hashed)
            blocks, hit_length = manager_cls.find_longest_cache_hit(
                block_hashes, max_length, group_ids, coordinator.block_pool, spec, use_eagle,
                coordinator._cache_hit_alignment_tokens)
            for group_id, group_blocks in zip(group_ids, blocks):
                hit_blocks[group_id] = group_blocks
                hit_lengths[group_id] = hit_length
        return tuple(hit_blocks), tuple(hit_lengths)

    return lookup


def _replace_per_group_lookup(**mutation: bool) -> Callable[[KvcacheSide], None]:
    def patch(side: KvcacheSide) -> None:
        coordinator = side.manager.coordinator
        coordinator.find_longest_cache_hit_per_group = _per_group_lookup(coordinator, **mutation)

    return patch


mutant("offer-margin-everywhere", "a connector offer's per-group lookup adds EAGLE's margin to "
       "every attention group, so a group without EAGLE hits past the lookup's bound",
       bug="vLLM 0.34.0 kv_cache_coordinator.py:961, survivor #9 (docs/mutation.md)",
       configs=("nemotron_h_connector",))(_replace_per_group_lookup(margin_everywhere=True))
mutant("offer-margin-cap-or", "a connector offer's per-group EAGLE lookup caps its margin at "
       "`len(hashes) | hash block size` tokens instead of `*`",
       bug="vLLM 0.34.0 kv_cache_coordinator.py:970, survivor #10 (docs/mutation.md)",
       configs=("qwen3_next_eagle_connector",))(_replace_per_group_lookup(hashed_or=True))


@mutant("cow-unretained", "the copy-on-write block gets no extra reference for the pending copy",
        bug="docs/spec.md §4.5 / §10.12", configs=("partial_hits",))
def _cow_unretained(side: KvcacheSide) -> None:
    def around(original, request_id, block_idx, source_block, cow_block):
        original(request_id, block_idx, source_block, cow_block)
        cow_block.ref_cnt -= 1

    for single in _singles(side):
        _around(single, "_apply_cow", around)


# ----- Content plants: the counts stay right, the bytes do not (caught by properties.data) -----


@mutant("hit-swaps-block", "the last block of a prefix hit is swapped for another cached block of "
        "the same group with the same ref count and queue state", bug="docs/bugs.md #16 / I13")
def _hit_swaps_block(side: KvcacheSide) -> None:
    from kvfuzz.kvcache.kv_cache_utils import get_group_id

    pool = _pool(side)

    def around(original, request, max_cache_hit_length=None):
        hits, num_hit_tokens, boundary = original(request, max_cache_hit_length)
        groups = [list(blocks) for blocks in hits.blocks]
        for g, blocks in enumerate(groups):
            if not blocks or blocks[-1].is_null:
                continue
            last = blocks[-1]
            swap = next((b for b in pool.blocks if b.block_hash is not None
                         and b.block_hash != last.block_hash and b not in blocks
                         and get_group_id(b.block_hash) == g and b.ref_cnt == last.ref_cnt), None)
            if swap is not None:
                blocks[-1] = swap
        return side.manager.create_kv_cache_blocks(tuple(groups)), num_hit_tokens, boundary

    _around(side.manager, "get_computed_blocks", around)


@mutant("boundary-before-hit", "the single-group coordinator reports -1 uncached tokens, so "
        "get_computed_blocks puts the shared-prefix boundary one token before the hit",
        bug="kvfuzz mutate survivor, kv_cache_coordinator.py (docs/mutation.md) / I20")
def _boundary_before_hit(side: KvcacheSide) -> None:
    def around(original, request, max_cache_hit_length=None):
        hits, num_hit_tokens, boundary = original(request, max_cache_hit_length)
        return hits, num_hit_tokens, boundary or num_hit_tokens - 1

    _around(side.manager, "get_computed_blocks", around)


@mutant("boundary-one-short", "a hybrid lookup's shared-prefix boundary is one token short of "
        "the longest single-group hit (still past the hit, so only the reference sees it)",
        bug="docs/spec.md §6.3 step 3 / DIFF-probe", configs=("hybrid", "hybrid3", "partial_hits"))
def _boundary_one_short(side: KvcacheSide) -> None:
    def around(original, request, max_cache_hit_length=None):
        hits, num_hit_tokens, boundary = original(request, max_cache_hit_length)
        return hits, num_hit_tokens, boundary - 1 if boundary > num_hit_tokens + 1 else boundary

    _around(side.manager, "get_computed_blocks", around)


@mutant("cow-skipped", "a partial (sub-block) hit is adopted without its private copy: the hitter "
        "writes into the shared tail block", bug="docs/spec.md §4.5 / I11", configs=("partial_hits",))
def _cow_skipped(side: KvcacheSide) -> None:
    # Both the predictor (argument 5) and the adoption (argument 3) see the local hit rounded
    # up to a whole block, so neither counts nor makes the copy; window groups are aligned
    # (their block size is hbs under partial hits), so their skipped counts do not change.
    def rounded(position: int, bs: int):
        def around(original, *args, **kwargs):
            args = list(args)
            args[position] = -(-args[position] // bs) * bs
            return original(*args, **kwargs)

        return around

    for single in _singles(side):
        _around(single, "get_num_blocks_to_allocate", rounded(4, single.block_size))
        _around(single, "add_local_computed_blocks", rounded(2, single.block_size))


@mutant("cow-redirect-late", "the worker learns of a copy-on-write redirect one pass late: the "
        "admission's forward pass writes through the source block, which its owner still uses",
        bug="docs/spec.md §4.5", configs=("partial_hits",), needs_data=True)
def _cow_redirect_late(side: KvcacheSide) -> None:
    stale: dict[str, list[tuple[int, int, int]]] = {}

    def cow(group: int):
        def around(original, request_id, block_idx, source_block, cow_block):
            original(request_id, block_idx, source_block, cow_block)
            stale.setdefault(request_id, []).append((group, block_idx, source_block.block_id))

        return around

    for group, single in enumerate(_singles(side)):
        _around(single, "_apply_cow", cow(group))

    def tables(original, request_id):
        ids = tuple(list(group) for group in original(request_id))
        for group, block_idx, source in stale.pop(request_id, ()):
            ids[group][block_idx] = source
        return ids

    _around(side.manager, "get_block_ids", tables)


@mutant("copy-one-step-late", "the driver executes a step's copy-on-write copies one step late "
        "(after the forward pass wrote the copy), keeping both endpoints retained until then",
        bug="docs/spec.md §4.5 / §7", configs=("partial_hits",))
def _copy_one_step_late(side: KvcacheSide) -> None:
    if side.level != "scheduler":
        return
    held: list[Any] = [[], []]

    def around(original):
        copies, retained = original()
        late, held[:] = list(held), [copies, retained]
        side.retained_pairs[:] = [(int(src), int(dst)) for src, dst in copies]
        return late[0], late[1]

    _around(side.manager, "take_kv_cache_block_copies", around)


@mutant("cache-ahead-of-schedule", "blocks are hashed up to the end of the block holding the last "
        "scheduled token, before all of their KV is scheduled", bug="docs/bugs.md #6")
def _cache_ahead_of_schedule(side: KvcacheSide) -> None:
    for single in _singles(side):
        def ahead(original, request, num_tokens, bs=single.block_size):
            return original(request, min(-(-num_tokens // bs) * bs, request.num_tokens))

        _around(single, "cache_blocks", ahead)


_STATE_CONFIGS = ("mamba", "jamba", "qwen3_5", "mamba_small_blocks")


def _state_managers(side: KvcacheSide) -> list[Any]:
    return [s for s in _singles(side) if type(s).__name__ == "MambaManager"]


@mutant("state-predictor-under-count", "a state group's get_num_blocks_to_allocate counts one "
        "block too few for a request's first allocation", bug="docs/bugs.md #21",
        configs=_STATE_CONFIGS)
def _state_predictor_under_count(side: KvcacheSide) -> None:
    def around(original, request_id, *args, **kwargs):
        value = original(request_id, *args, **kwargs)
        first = request_id not in single.num_cached_block
        return value - 1 if first and value > 0 else value

    for single in _state_managers(side)[:1]:
        _around(single, "get_num_blocks_to_allocate", around)


@mutant("state-released-early", "a state group releases the block holding the last computed "
        "token's state, which the next step resumes from", bug="docs/bugs.md #28",
        configs=("mamba_small_blocks",))  # the only one whose requests pass a state block
def _state_released_early(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        single.get_num_skipped_tokens = lambda num_computed_tokens, bs=single.block_size: (
            num_computed_tokens + bs - 1
        )


_ALIGN_CONFIGS = ("qwen3_5_align", "nemotron_h_align", "granite4")
"""Mamba "align" configs with sub-block hits, so copy-on-write happens."""


@mutant("state-allocation-asserts-growth", "a state group's allocation asserts that its table "
        "only grows: a table over-allocated for draft (lookahead) tokens trips "
        "`num_required_blocks < len(req_blocks)`", bug="docs/bugs.md #27",
        configs=("mamba_small_blocks",))  # state blocks small enough for lookahead to cross
def _state_allocation_asserts_growth(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        def around(original, request_id, num_tokens, num_tokens_main_model, m=single):
            table = m.req_to_blocks.get(request_id, [])
            required = (-(-num_tokens_main_model // m.block_size) + m.num_speculative_blocks
                        if m.align else -(-(num_tokens + m._speculative_tokens) // m.block_size))
            assert not required < len(table), "num_required_blocks < len(req_blocks)"
            return original(request_id, num_tokens, num_tokens_main_model)

        _around(single, "allocate_new_blocks", around)


@mutant("state-hit-misplaced", "an align-mode state hit is padded with one null too few, so "
        "the hit request resumes from the position before its state block",
        bug="docs/bugs.md #28", configs=("mamba_align",) + _ALIGN_CONFIGS)
def _state_hit_misplaced(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        def around(original, *args, **kwargs):
            computed, hit_length = original(*args, **kwargs)
            for blocks in computed:
                if len(blocks) > 1:
                    del blocks[0]
            return computed, hit_length

        _around(single, "find_longest_cache_hit", around)


@mutant("align-cow-forgets-pending-copy", "an align-mode copy-on-write takes its references "
        "but forgets to queue the copy: the private copy is never filled",
        bug="docs/spec.md §11.3", configs=_ALIGN_CONFIGS)
def _align_cow_forgets_pending_copy(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        def around(original, *args, m=single, **kwargs):
            original(*args, **kwargs)
            m._pending_cow_copies.pop()

        _around(single, "_apply_cow", around)
        _around(single, "_move_cached_state", around)


@mutant("eagle-checkpoint-ignored", "with EAGLE, Mamba align groups still cache the prompt's "
        "state at `(P - 1) // hbs * hbs` rather than one hash block below `P // hbs * hbs`, "
        "EAGLE's replay boundary", bug="docs/spec.md §11.3", configs=("qwen3_next_eagle",))
def _eagle_checkpoint_ignored(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        single.drop_eagle_checkpoint_block = False


@mutant("checkpoint-not-rekeyed", "a prefill checkpoint block keeps the full-block key "
        "registered in its step rather than being re-keyed at its checkpoint position: the key "
        "names a state the block does not hold, and the checkpoint itself is never cached",
        bug="docs/spec.md §11.6", configs=("nemotron_h_checkpoint",))
def _checkpoint_not_rekeyed(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        single._cache_checkpoint_block = lambda *args, **kwargs: None


@mutant("rswa-gap-kept", "an R-SWA group never releases the blocks between the prompt and the "
        "decode window", bug="docs/spec.md §12.2", configs=("rswa", "full_rswa"))
def _rswa_gap_kept(side: KvcacheSide) -> None:
    for single in _singles(side):
        if type(single).__name__ == "RSWAManager":
            single.remove_skipped_blocks = lambda *args, **kwargs: None


@mutant("ring-block-per-step", "a circular buffer claims another ring block at every allocation "
        "while its predictor still counts one per request", bug="docs/spec.md §12.3",
        configs=("full_ring",))
def _ring_block_per_step(side: KvcacheSide) -> None:
    for single in _singles(side):
        if type(single).__name__ == "CircularBufferManager":
            def grow(request_id, num_tokens, num_tokens_main_model, m=single):
                new_blocks = m.block_pool.get_new_blocks(1)
                m.req_to_blocks.setdefault(request_id, []).extend(new_blocks)
                return new_blocks

            single.allocate_new_blocks = grow


@mutant("encoder-only-takes-blocks", "an encoder-only group predicts and allocates blocks as "
        "full attention does, though its layers keep no KV", bug="docs/spec.md §12.4",
        configs=("bert", "colqwen3_5"))
def _encoder_only_takes_blocks(side: KvcacheSide) -> None:
    for single in _singles(side):
        if type(single).__name__ == "EncoderOnlyAttentionManager":
            base = type(single).__mro__[1]  # SingleTypeKVCacheManager: tables follow tokens
            single.get_num_blocks_to_allocate = base.get_num_blocks_to_allocate.__get__(single)
            single.allocate_new_blocks = base.allocate_new_blocks.__get__(single)


@mutant("retention-ignored", "sliding-window groups ignore the prefix-cache retention interval "
        "and key every block a dense hit could end at", bug="docs/spec.md §4.9.2",
        configs=("gemma3_retention", "swa_replay_only"))
def _retention_ignored(side: KvcacheSide) -> None:
    for single in _singles(side):
        if type(single).__name__ == "SlidingWindowManager":
            single.retention_interval = None


@mutant("state-retention-ignored", "Mamba 'align' groups ignore the prefix-cache retention "
        "interval and key the state at every block end a chunk reaches",
        bug="docs/spec.md §11.3", configs=("qwen3_5_retention",))
def _state_retention_ignored(side: KvcacheSide) -> None:
    for single in _singles(side):
        if type(single).__name__ == "MambaManager":
            single.retention_interval = None


@mutant("negative-external-accepted", "allocate_slots accepts a negative external-token count "
        "and takes a negative number of blocks for it: the free count grows by them",
        bug="docs/bugs.md #5", configs=("connector",))
def _negative_external_accepted(side: KvcacheSide) -> None:
    manager = side.manager
    block_size = manager.coordinator.single_type_managers[0].block_size

    def around(original, request, *args, num_external_computed_tokens=0, **kwargs):
        if num_external_computed_tokens >= 0:
            return original(request, *args,
                            num_external_computed_tokens=num_external_computed_tokens, **kwargs)
        result = original(request, *args, **kwargs)
        if result is not None:
            manager.block_pool.free_block_queue.num_free_blocks -= (
                num_external_computed_tokens // block_size)
        return result

    _around(manager, "allocate_slots", around)


@mutant("external-state-block-uncounted", "a state group's predictor caps a first allocation "
        "with external tokens at one state block, as vLLM's align mode does: the external "
        "state's block and the step's own count as one", bug="docs/bugs.md #21",
        configs=("nemotron_h_connector",))
def _external_state_block_uncounted(side: KvcacheSide) -> None:
    def around(original, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
               num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        value = original(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                         num_local_computed_tokens, num_tokens_main_model, *args, **kwargs)
        external = (request_id not in single.req_to_blocks
                    and total_computed_tokens > num_local_computed_tokens)
        crosses = -(-num_tokens_main_model // single.block_size) > (
            -(-total_computed_tokens // single.block_size))
        return value - 1 if external and crosses and value > 0 else value

    for single in _state_managers(side):
        _around(single, "get_num_blocks_to_allocate", around)


@mutant("aborted-load-holds-blocks", "a request aborted while waiting for remote KV is never "
        "freed when its load ends: it holds its blocks forever", bug="docs/bugs.md #22",
        configs=("connector",))
def _aborted_load_holds_blocks(side: KvcacheSide) -> None:
    aborted = side.request_status.FINISHED_ABORTED

    def around(original, request):
        if request.status != aborted:  # only the driver's end of an aborted load frees these
            original(request)

    _around(side.manager, "free", around)


@mutant("load-rollback-into-window", "a short KV load on a lone sliding-window group keeps the "
        "blocks before the first it did not fill even when the window of that point lies in "
        "nulls the load never wrote (vLLM's scheduler does this)",
        bug="docs/findings/016-short-load-window-unloaded.md", configs=("mistral_connector",),
        needs_data=True)
def _load_rollback_into_window(side: KvcacheSide) -> None:
    build = side.build_scheduler

    def build_scheduler(config: Config) -> Any:
        scheduler = build(config)

        def valid_prefix(request_id: str, num_loaded_tokens: int) -> int:
            single = scheduler.manager.coordinator.single_type_managers[0]
            table = single.req_to_blocks[request_id]
            nulls = next((i for i, b in enumerate(table) if not b.is_null), len(table))
            return max(num_loaded_tokens // single.block_size, nulls) * single.block_size

        scheduler._valid_prefix = valid_prefix
        return scheduler

    side.build_scheduler = build_scheduler


@mutant("failed-load-blocks-keyed", "the blocks a failing synchronous KV load left invalid keep "
        "their keys as vLLM's scheduler keeps them: all under \"recompute\" (rewritten while "
        "keyed), a sharer's under \"fail\" (computed on the invalid KV)",
        bug="docs/findings/029-recompute-failed-blocks-keyed.md", configs=("connector",))
def _failed_load_blocks_keyed(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        fail = scheduler._fail_sync_loads

        def fail_sync_loads(scheduled: Any, failing: Any) -> Any:
            before = {r.request_id: r.num_computed_tokens for r, _, _ in scheduled}
            evict = scheduler.manager.evict_blocks
            scheduler.manager.evict_blocks = lambda block_ids: None
            try:
                affected = fail(scheduled, failing)
            finally:
                scheduler.manager.evict_blocks = evict
            if scheduler.fail_short_loads:  # vLLM: the tables of the requests that marked one
                single = scheduler.manager.coordinator.single_type_managers[0]
                evict({b.block_id for r in affected
                       if r.num_computed_tokens != before[r.request_id]
                       for b in single.req_to_blocks[r.request_id][
                           r.num_computed_tokens // single.block_size:]})
            return affected

        scheduler._fail_sync_loads = fail_sync_loads

    _on_scheduler(side, patch)


@mutant("sync-failure-first-group-only", "a failing synchronous KV load on several KV cache "
        "groups is rolled back on the first group alone: the blocks it did not fill in the "
        "other groups keep their keys, and their rollback points are not counted",
        configs=("gpt_oss_connector",))
def _sync_failure_first_group_only(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        fail = scheduler._fail_sync_loads

        def fail_sync_loads(scheduled: Any, failing: Any) -> Any:
            coordinator = scheduler.manager.coordinator
            singles = coordinator.single_type_managers
            coordinator.single_type_managers = singles[:1]
            try:
                return fail(scheduled, failing)
            finally:
                coordinator.single_type_managers = singles

        scheduler._fail_sync_loads = fail_sync_loads

    _on_scheduler(side, patch)


@mutant("failed-load-report-rounds-up", "the report of a failing synchronous KV load starts at "
        "the first block wholly past what it filled: the block it filled part of stays valid, "
        "and the request reads its unfilled tail", configs=("connector",), needs_data=True)
def _failed_load_report_rounds_up(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        fail = scheduler._fail_sync_loads

        def fail_sync_loads(scheduled: Any, failing: Any) -> Any:
            size = scheduler.manager.coordinator.single_type_managers[0].block_size
            return fail(scheduled, {rid: (-(-valid // size) * size, end)
                                    for rid, (valid, end) in failing.items()})

        scheduler._fail_sync_loads = fail_sync_loads

    _on_scheduler(side, patch)


@mutant("sync-failure-resumes-over-window", "under \"recompute\" a failing synchronous KV load "
        "on a lone sliding-window group resumes its request at the first block it did not "
        "fill even where that point's window reaches nulls nothing loaded (vLLM's scheduler "
        "does this)", bug="docs/findings/016-short-load-window-unloaded.md",
        configs=("mistral_connector",), needs_data=True)
def _sync_failure_resumes_over_window(side: KvcacheSide) -> None:
    _on_scheduler(side, lambda scheduler: setattr(scheduler, "_window_unloaded",
                                                  lambda request: False))


_MTP_CONFIGS = ("deepseek_v3_mtp", "deepseek_v3_mtp3", "qwen3_next_mtp")


@mutant("lookahead-unhashed", "block hashes leave out the tokens after the block an MTP "
        "drafter's KV depends on (still hashed only once those tokens exist): a block is "
        "shared with a prompt that goes on differently", bug="docs/spec.md §5.7",
        configs=_MTP_CONFIGS)
def _lookahead_unhashed(side: KvcacheSide) -> None:
    from kvfuzz.kvcache.kv_cache_utils import get_request_block_hasher

    config = side.config
    hbs, lookahead = config.resolved_hash_block_size, config.num_hash_lookahead_tokens
    plain = get_request_block_hasher(hbs, None, 0, none_hash_seed=config.none_hash_seed)

    def hasher(request):
        ready = max(request.num_tokens - lookahead, 0) // hbs - len(request.block_hashes)
        return plain(request)[:max(ready, 0)]

    hasher.yields_digests = True
    side._hasher = hasher


@mutant("reprefillable-cached", "the tokens a multi-module MTP drafter may re-prefill "
        "(num_prefill_lookahead − 1) are cached as if final", bug="docs/spec.md §5.7",
        configs=("deepseek_v3_mtp3",))
def _reprefillable_cached(side: KvcacheSide) -> None:
    side.manager.coordinator.num_reprefillable_tokens = 0


@mutant("output-unpublished", "on a Mamba hybrid with prefix caching the driver caches "
        "nothing after a request's output (vLLM 0.34's `update_from_output` publishes): under "
        "hash lookahead the block a sampled token completes is never cached when its request "
        "finishes", bug="docs/spec.md §5.7", configs=("qwen3_next_mtp",))
def _output_unpublished(side: KvcacheSide) -> None:
    _on_scheduler(side, lambda scheduler: setattr(scheduler, "publish_after_output", False))


@mutant("async-output-unpublished", "under async scheduling the driver caches nothing after a "
        "request's output (vLLM 0.33+'s `update_from_output` publishes for a request with "
        "output placeholders): under hash lookahead the block a sampled token completes is "
        "never cached when its request finishes", bug="docs/spec.md §5.7")
def _async_output_unpublished(side: KvcacheSide) -> None:
    config = side.config
    synchronous = config.replace(scheduler=dataclasses.replace(config.scheduler,
                                                               async_scheduling=False))
    _on_scheduler(side, lambda scheduler: setattr(
        scheduler, "publish_after_output", publishes_after_output(synchronous)))


@mutant("landed-load-first", "a landed KV load goes first in line, ahead of the loads that "
        "started before it (the driver's rule before vLLM 0.34's `kv_holding_waiting` order)",
        bug="docs/spec.md §13.2", configs=("connector",))
def _landed_load_first(side: KvcacheSide) -> None:
    def patch(scheduler: Any) -> None:
        finish = scheduler.finish_load

        def finish_load(request_id: str, num_loaded_tokens: int | None = None) -> int:
            out = finish(request_id, num_loaded_tokens)
            request = scheduler._requests[request_id]
            if request in scheduler._waiting:
                scheduler._waiting.remove(request)
                scheduler._waiting.appendleft(request)
            return out

        scheduler.finish_load = finish_load

    _on_scheduler(side, patch)


def _on_scheduler(side: KvcacheSide, patch: Callable[[Any], None]) -> None:
    """`patch` each driver the side builds."""
    build = side.build_scheduler

    def build_scheduler(config: Config) -> Any:
        scheduler = build(config)
        patch(scheduler)
        return scheduler

    side.build_scheduler = build_scheduler


@mutant("junction-state-unkeyed", "with enable_mamba_shared_prefix_checkpoint the scheduler "
        "stops a prompt chunk at the junction, but the Mamba groups never register the state "
        "there: the chunk stop is spent and a sibling resumes lower",
        bug="docs/bugs.md #29", configs=("qwen3_next_junction",))
def _junction_state_unkeyed(side: KvcacheSide) -> None:
    for single in _state_managers(side):
        single.shared_prefix_checkpoint = False


@mutant("sync-load-ignored", "the driver admits a request offered a synchronous KV load "
        "without it: the external tokens are computed again from the local hit",
        bug="docs/spec.md §13.3", configs=("connector",))
def _sync_load_ignored(side: KvcacheSide) -> None:
    _on_scheduler(side, lambda scheduler: setattr(scheduler, "_sync_offers", _Forgetful()))


class _Forgetful(dict):  # type: ignore[type-arg]
    """A dict of offers that takes each one and holds none."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


@mutant("one-new-block-reads-none", "the KVCacheBlocks allocate_slots returns answers "
        "get_block_ids(allow_none=True) with None when every group got exactly one new block, "
        "so a scheduler would tell the worker of none (the vLLM 0.34.0 mutant len == 0 -> "
        "len == 1 at kv_cache_manager.py:105)", bug="docs/mutation.md S3")
def _one_new_block_reads_none(side: KvcacheSide) -> None:
    from kvfuzz.kvcache.kv_cache_manager import KVCacheBlocks

    class OneReadsNone(KVCacheBlocks):
        __slots__ = ()

        def get_block_ids(self, allow_none: bool = False, *,
                          group_ids: Any = None) -> tuple[list[int], ...] | None:
            if allow_none and all(len(group) == 1 for group in self.blocks):
                return None
            return super().get_block_ids(allow_none, group_ids=group_ids)

    def around(original, *args, **kwargs):
        out = original(*args, **kwargs)
        return OneReadsNone(out.blocks) if out is not None and any(out.blocks) else out

    _around(side.manager, "allocate_slots", around)
