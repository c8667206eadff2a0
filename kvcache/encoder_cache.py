"""The encoder side of a multimodal request's step (docs/spec.md §7.2): an encoder compute budget
per step and an encoder cache, as vLLM 0.34's Scheduler keeps them (`_try_schedule_encoder_inputs`,
`sched/scheduler.py:2064-2256`; `EncoderCacheManager`, `core/encoder_cache_manager.py`).

A multimodal input is computed by the encoder whole, in the step whose chunk first overlaps it,
and its output waits in the encoder cache (keyed by the input's identifier, shared by every
request naming it) until the request has computed past the input. A chunk that reaches an input
the budget or the cache cannot take stops just before it (or, starting inside it, schedules
nothing). Entries no request references stay cached, evictable oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvfuzz.kvcache.kv_cache_utils import _mm_span


class EncoderCache:
    """Encoder outputs by identifier, `capacity` embeddings in all (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.free_slots = capacity
        self.reclaimable = capacity
        """Free slots plus those of unreferenced entries (None: unbounded)."""
        self.holders: dict[str, set[str]] = {}
        """Cached identifier -> the requests referencing it (empty: evictable)."""
        self.sizes: dict[str, int] = {}
        self.unreferenced: OrderedDict[str, int] = OrderedDict()
        """Evictable entries, oldest first -> their size."""
        self.inputs: dict[str, set[int]] = {}
        """Request id -> the indices of its inputs it holds an entry for."""
        self.uses: dict[str, dict[str, int]] = {}
        """Request id -> identifier -> how many of its held inputs name it."""
        self.encoder_decoder: dict[str, int] = {}
        """Request id -> the room its encoder-decoder input holds (given back once)."""

    def hit(self, request: Any, index: int) -> bool:
        """Whether input `index`'s output is cached; if so the request references it."""
        ident = request.mm_features[index].identifier
        if ident not in self.holders:
            return False
        if not self.holders[ident]:
            size = self.unreferenced.pop(ident)
            if self.reclaimable is not None:
                self.reclaimable -= size
        self.holders[ident].add(request.request_id)
        self._hold(request.request_id, index, ident)
        return True

    def fits(self, size: int, budget: int | None, pending: int) -> bool:
        """Whether an input of `size` embeddings fits the step's remaining `budget` and, with
        `pending` embeddings already taken for the request's inputs this step, the cache
        (evicting unreferenced entries, oldest first, as far as needed)."""
        if budget is not None and size > budget:
            return False
        if self.free_slots is None or self.reclaimable is None:
            return True
        need = size + pending
        if need <= self.free_slots:
            return True
        if need > self.reclaimable:
            return False
        while need > self.free_slots:
            ident, freed = self.unreferenced.popitem(last=False)
            del self.holders[ident], self.sizes[ident]
            self.free_slots += freed
        return True

    def store(self, request: Any, index: int) -> None:
        """Take room for input `index`'s output (after `fits`); the request references it."""
        ident = request.mm_features[index].identifier
        size = _mm_span(request.mm_features[index])[1]
        self.holders.setdefault(ident, set()).add(request.request_id)
        self.sizes.setdefault(ident, size)
        self._hold(request.request_id, index, ident)
        if self.free_slots is not None and self.reclaimable is not None:
            self.free_slots -= size
            self.reclaimable -= size

    def _hold(self, request_id: str, index: int, ident: str) -> None:
        held = self.inputs.setdefault(request_id, set())
        if index not in held:
            held.add(index)
            uses = self.uses.setdefault(request_id, {})
            uses[ident] = uses.get(ident, 0) + 1

    def release(self, request: Any, index: int) -> None:
        """The request no longer needs input `index`: its reference to the entry goes when none
        of its held inputs names the identifier any more (the entry then becomes evictable
        once no request references it)."""
        rid = request.request_id
        ident = request.mm_features[index].identifier
        held = self.inputs.get(rid)
        if held is not None and index in held:
            held.remove(index)
            uses = self.uses[rid]
            uses[ident] -= 1
            if not uses[ident]:
                del uses[ident]
            if not held:
                del self.inputs[rid], self.uses[rid]
        if not self.holders.get(ident) or ident in self.uses.get(rid, ()):
            return
        self.holders[ident].discard(rid)
        if not self.holders[ident]:
            self.unreferenced[ident] = self.sizes[ident]
            if self.reclaimable is not None:
                self.reclaimable += self.sizes[ident]

    def store_encoder_decoder(self, request_id: str, size: int) -> None:
        """An encoder-decoder request's input is encoded: it holds `size` slots until its
        output (or its end) gives them back, once."""
        self.encoder_decoder[request_id] = size
        if self.free_slots is not None and self.reclaimable is not None:
            self.free_slots -= size
            self.reclaimable -= size

    def _release_encoder_decoder(self, request_id: str) -> None:
        size = self.encoder_decoder.pop(request_id, 0)
        if self.free_slots is not None and self.reclaimable is not None:
            self.free_slots += size
            self.reclaimable += size

    def release_all(self, request: Any) -> None:
        """Every input the request holds (it finished, was preempted or failed admission)."""
        self._release_encoder_decoder(request.request_id)
        for index in sorted(self.inputs.get(request.request_id, ())):
            self.release(request, index)

    def release_computed(self, request: Any, settled: int) -> None:
        """After a step's output: the inputs that end by the request's `settled` tokens (an
        encoder-decoder input once the request has computed a token)."""
        if request.num_computed_tokens > 0:
            self._release_encoder_decoder(request.request_id)
        for index in sorted(self.inputs.get(request.request_id, ())):
            offset, length = _mm_span(request.mm_features[index])
            if offset + length <= settled:
                self.release(request, index)


def schedule_encoder_inputs(cache: EncoderCache, request: Any, start: int, num_new_tokens: int,
                            budget: int | None, shift: int = 0
                            ) -> tuple[int, list[int], list[int], int]:
    """The inputs a chunk of `num_new_tokens` from `start` overlaps (its window reaching
    `shift` tokens further, a drafter's read-ahead), in order: a cached one is referenced,
    a repeated identifier rides on its first, the others are computed if the `budget`
    and the cache take them. At the first that does not fit the chunk stops before it (0
    when it starts inside it). Returns (the chunk's tokens, the inputs to compute, the
    repeats, the embeddings computed)."""
    if num_new_tokens == 0:
        return 0, [], [], 0
    to_compute: list[int] = []
    repeats: list[int] = []
    taken: set[str] = set()
    spent = 0
    end = start + num_new_tokens + shift
    for index, feature in enumerate(request.mm_features):
        offset, length = _mm_span(feature)
        if not (offset < end and start < offset + length):
            continue
        if feature.identifier in taken:
            repeats.append(index)
            continue
        if cache.hit(request, index):
            continue
        left = None if budget is None else budget - spent
        if not cache.fits(length, left, spent):
            num_new_tokens = min(num_new_tokens, offset - start) if start < offset else 0
            break
        taken.add(feature.identifier)
        to_compute.append(index)
        spent += length
    return num_new_tokens, to_compute, repeats, spent


def schedule_encoder_decoder_input(num_encoder_tokens: int, start: int, num_new_tokens: int,
                                   budget: int | None, free: int | None = None
                                   ) -> tuple[int, int]:
    """An encoder-decoder request's encoder input (its `num_encoder_tokens`, at offset 0):
    computed with its chunk from 0 computed tokens against the step's `budget` and the
    cache's `free` slots (None: unbounded; vLLM's `EncoderDecoderCacheManager` never hits),
    nothing once decoding started. Returns (the chunk's tokens, 0 where the budget or the
    cache cannot take the input; the embeddings computed)."""
    if not num_encoder_tokens or start > 0 or num_new_tokens == 0:
        return num_new_tokens, 0
    if any(bound is not None and num_encoder_tokens > bound for bound in (budget, free)):
        return 0, 0
    return num_new_tokens, num_encoder_tokens
