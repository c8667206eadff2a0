"""Finding 030 tolerated on vLLM's own Scheduler: an encoder-decoder input's room in the encoder
cache is given back after every output, not once.

vLLM's `EncoderDecoderCacheManager` takes an input's embeddings from `num_free_slots` once
(`allocate`, 0.34.0 `encoder_cache_manager.py:415-420`) but gives them back on every call of
`free_encoder_input` (`:439-441`): `Scheduler._free_encoder_inputs` calls it after each output
of a request that has computed a token (`scheduler.py:2975-2978`, from `update_from_output`,
`:2434-2435`), `get_cached_input_ids` names the input every time (`:426-427`), and `free` at
preemption, finish or a failed admission credits it once more (`:422-424`; `scheduler.py:1522`
for an input never allocated). The free count grows past the cache size, and an encoder cache
bound (`scheduler.encoder_cache_size`) stops binding. kvfuzz's driver and the model give the
room back once (docs/spec.md §7.2). Target `vllm-scheduler` credits each allocation once, as
vllm-project/vllm#51228 would, and names only the requests whose encoder input vLLM's grown
count would have let in where the cache had no room; `vllm-scheduler-strict` and
`--no-tolerate 030` report the difference.
"""

from __future__ import annotations

from typing import Any

SLOTS_CREDITED_TWICE = "encoder-decoder-slots-credited-twice"
"""The deviation's name (docs/findings/030-encoder-decoder-slots-credited-twice.md)."""


def credit_once(manager: Any, tolerated: set[str]) -> None:
    """Make vLLM's `EncoderDecoderCacheManager` `manager` give an input's room back only once
    per allocation; the ids of the requests whose input the credits withheld would have let
    in go into `tolerated`."""
    allocate, credit, can_allocate = (manager.allocate, manager.free_encoder_input,
                                      manager.can_allocate)
    held: set[tuple[str, int]] = set()
    withheld = 0
    """The slots vLLM's own count would hold beyond this one's."""

    def can_allocate_once(request: Any, *args: Any) -> bool:
        fits = can_allocate(request, *args)
        manager.num_free_slots += withheld
        try:
            if can_allocate(request, *args) != fits:
                tolerated.add(request.request_id)
        finally:
            manager.num_free_slots -= withheld
        return fits

    def allocate_once(request: Any, input_id: int) -> None:
        allocate(request, input_id)
        held.add((request.request_id, input_id))

    def free_encoder_input(request: Any, input_id: int) -> None:
        nonlocal withheld
        key = (request.request_id, input_id)
        if key not in held:
            withheld += request.get_num_encoder_embeds(input_id)
            return
        held.discard(key)
        credit(request, input_id)

    manager.can_allocate = can_allocate_once
    manager.allocate = allocate_once
    manager.free_encoder_input = free_encoder_input
