"""The request state the manager and the driver read, with vLLM's attribute names."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from kvfuzz.kvcache.kv_cache_utils import BlockHash


class RequestStatus(enum.IntEnum):
    """vLLM 0.34.0's members, order and values (vllm/v1/request.py:424-438): IntEnum compares
    by value, so statuses set from here work on vLLM requests and managers too.
    """

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: int) -> bool:
        """Finished means strictly after PREEMPTED."""
        return status > RequestStatus.PREEMPTED


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with (vLLM's fields): its name and path key its blocks, as in
    vLLM 0.34, so one name and id loaded from another path never shares KV."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass(frozen=True)
class MultiModalFeature:
    """One multimodal input: its content identifier and where its placeholders sit."""

    identifier: str
    offset: int
    length: int


def _check_extras(lora_request: LoRARequest | None, num_prompt_tokens: int,
                  **per_position: list[int] | list[bool] | None) -> None:
    """ValueError unless the adapter id is >= 1 and its path not empty, and each per-position
    list fits the prompt."""
    if lora_request is not None and lora_request.lora_int_id < 1:
        raise ValueError(f"lora_int_id must be >= 1, got {lora_request.lora_int_id!r}")
    if lora_request is not None and not lora_request.lora_path:
        raise ValueError(f"lora_path cannot be empty (adapter {lora_request.lora_name!r})")
    for name, values in per_position.items():
        if values is not None and len(values) != num_prompt_tokens:
            raise ValueError(
                f"{name} has {len(values)} entries for {num_prompt_tokens} prompt tokens"
            )


class ConstantList(Sequence[int]):
    """Read-only view of a list that keeps growing underneath."""

    __slots__ = ("_items",)

    def __init__(self, items: list[int]) -> None:
        self._items = items

    @overload
    def __getitem__(self, idx: int) -> int: ...

    @overload
    def __getitem__(self, idx: slice) -> list[int]: ...

    def __getitem__(self, idx: int | slice) -> int | list[int]:
        return self._items[idx]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._items == other._items
        return self._items == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ConstantList({self._items!r})"


class Request:
    """A prompt plus sampled tokens; hashes its full hash blocks as tokens arrive."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: Any = None,
        pooling_params: Any = None,
        client_index: int = 0,
        arrival_time: float | None = 0.0,
        prompt_embeds: Any = None,
        prompt_is_token_ids: list[bool] | None = None,
        mm_features: list[Any] | None = None,
        lora_request: Any = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: Any = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        resumable: bool = False,
        session_id: str | None = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: Any = None,
        abort_immediately: bool = False,
        kv_hints: Any = None,
        block_hashes: list[BlockHash] | None = None,
        *,
        max_tokens: int = 16,
        skip_reading_prefix_cache: bool = False,
        num_encoder_tokens: int = 0,
        prefix_cache_hit_limit: int | None = None,
        kv_cache_report_mode: str = "incremental",
    ) -> None:
        """vLLM 0.34's parameters, in its order (vllm/v1/request.py:64-87), then kvcache's own
        keyword-only ones. Given vLLM's `sampling_params` or `pooling_params`, those decide
        `max_tokens`, `skip_reading_prefix_cache` and `prefix_cache_hit_limit` as in vLLM; the
        engine's own parameters (`client_index`, `trace_headers`, `resumable`,
        `reasoning_*`, `abort_immediately`, `kv_hints`) are taken and not read; `session_id`
        is kept for the KV events to name. `arrival_time`
        None is now, as in vLLM; kvcache's default is 0.0, for determinism.
        """
        if sampling_params is not None or pooling_params is not None:
            max_tokens, skip_reading_prefix_cache, prefix_cache_hit_limit = _from_vllm_params(
                sampling_params, pooling_params)
        if arrival_time is None:
            arrival_time = time.time()
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not isinstance(num_encoder_tokens, int) or num_encoder_tokens < 0:
            raise ValueError(f"num_encoder_tokens must be an int >= 0, got {num_encoder_tokens!r}")
        if prompt_token_ids is None:  # vLLM's: the embeddings alone, each position's id 0
            if prompt_embeds is None:
                raise ValueError("neither prompt_token_ids nor prompt_embeds was given")
            num_prompt_tokens = len(prompt_embeds)
        else:
            num_prompt_tokens = len(prompt_token_ids)
        if lora_request is not None or prompt_embeds is not None or (
            prompt_is_token_ids is not None
        ):
            _check_extras(lora_request, num_prompt_tokens,
                          prompt_embeds=prompt_embeds, prompt_is_token_ids=prompt_is_token_ids)
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.session_id = session_id
        # "full": a prefix hit re-announces the blocks it reuses (vllm/v1/request.py:130-134).
        self.kv_cache_report_mode = (
            (getattr(sampling_params, "extra_args", None) or {}).get(
                "kv_cache_report_mode", "incremental")
            if sampling_params is not None else kv_cache_report_mode)
        self.priority = priority
        self.arrival_time = arrival_time
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        if prefix_cache_hit_limit is not None and (
            type(prefix_cache_hit_limit) is not int or prefix_cache_hit_limit < 0
        ):
            raise ValueError(
                f"prefix_cache_hit_limit must be None or an int >= 0, got {prefix_cache_hit_limit!r}"
            )
        # Leading tokens the prefix cache may serve (None: unbounded), as vLLM 0.34's requests
        # carry it (0 when skipping cache reads, the first scored row for prompt scoring).
        self.prefix_cache_hit_limit = 0 if skip_reading_prefix_cache else prefix_cache_hit_limit
        self.num_encoder_tokens = num_encoder_tokens
        self.lora_request = lora_request
        self.mm_features = mm_features or []
        self.prompt_embeds = prompt_embeds
        """One value per prompt position standing in for its embedding vector, or None."""
        self.prompt_is_token_ids = prompt_is_token_ids
        """Per prompt position: it holds a token id, not an embedding (mixed prompts)."""
        # Each hash block's embeddings digest, by (start, end), as vLLM memoizes them.
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Scheduled but not yet settled; always 0 in a synchronous driver.
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        self.shared_prefix_boundary = 0
        self._all_token_ids = (
            [0] * num_prompt_tokens if prompt_token_ids is None else list(prompt_token_ids)
        )
        self._output_token_ids: list[int] = []
        self.all_token_ids = ConstantList(self._all_token_ids)
        self.output_token_ids = ConstantList(self._output_token_ids)
        if block_hashes is not None and type(block_hashes) is not list:
            raise ValueError(f"block_hashes must be None or a list, got {block_hashes!r}")
        # Prompt hashes a frontend computed with this hasher (vLLM 0.34): hashing goes on after.
        self.block_hashes: list[BlockHash] = (
            [] if block_hashes is None else _checked_hashes(request_id, block_hashes)
        )
        self._block_hasher = block_hasher
        # Tokens per hash block, where the hasher says (0: call it whenever tokens come).
        self._hash_block_size: int = getattr(block_hasher, "hash_block_size", 0)
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def get_max_cache_hit_length(self, bound: int | None = None) -> int:
        """The longest prefix hit allowed: the last token is always recomputed, and the hit
        limit and `bound` can only lower it."""
        limit = self.num_tokens - 1
        hit_limit = self.prefix_cache_hit_limit
        if hit_limit is not None and hit_limit < limit:
            limit = hit_limit
        return bound if bound is not None and bound < limit else limit

    @property
    def skip_reading_external_kv(self) -> bool:
        """vLLM 0.34's (request.py:358-362): a request whose prefix-cache hits are bounded reads
        no KV from a connector, whose hits the bound does not limit."""
        return self.prefix_cache_hit_limit is not None

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens including draft tokens, which are never hashed."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Append the hashes of newly completed hash blocks (the trailing partial block has
        none). Preemption does not clear them.
        """
        hasher = self._block_hasher
        if hasher is None:
            return
        hash_block_size = self._hash_block_size
        if hash_block_size and (
            (len(self.block_hashes) + 1) * hash_block_size > len(self._all_token_ids)
        ):
            return  # no hash block has completed: most decode steps, short prompts
        new_hashes = hasher(self)
        # A hasher of get_request_block_hasher's yields digests; any other one is checked.
        if not getattr(hasher, "yields_digests", False):
            new_hashes = _checked_hashes(self.request_id, new_hashes)
        self.block_hashes.extend(new_hashes)

    def truncate_block_hashes(self, hash_block_size: int,
                              num_hash_lookahead_tokens: int = 0) -> None:
        """Drop the hashes of blocks no longer complete after tokens were taken off the end."""
        num_valid = max(0, self.num_tokens - num_hash_lookahead_tokens) // hash_block_size
        del self.block_hashes[num_valid:]
        self._prompt_embeds_per_block_hashes.clear()

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def _from_vllm_params(sampling_params: Any, pooling_params: Any) -> tuple[int, bool, int | None]:
    """(max_tokens, skip_reading_prefix_cache, prefix_cache_hit_limit) from vLLM's parameters,
    as vLLM 0.34 derives them (vllm/v1/request.py:113-136, 364-377): a pooling request makes
    one token, prompt log-probs bound the prefix cache's hits to their first scored row."""
    params = sampling_params if sampling_params is not None else pooling_params
    skip = bool(getattr(params, "skip_reading_prefix_cache", False))
    limit = None
    if sampling_params is not None and (
        getattr(sampling_params, "prompt_logprobs", None) is not None
        or getattr(sampling_params, "prompt_logprob_token_ids", None) is not None
    ):
        limit = getattr(sampling_params, "prompt_logprob_start", 0) or 0
    if pooling_params is not None:
        return 1, skip, limit
    if sampling_params.max_tokens is None:
        raise ValueError("sampling_params.max_tokens must be set")
    return sampling_params.max_tokens, skip, limit


def _checked_hashes(request_id: str, hashes: Sequence[BlockHash]) -> list[BlockHash]:
    """`hashes` as a list, each checked to be what vLLM's hash functions return (non-empty
    bytes) or an int (Python's `hash`, which vLLM's tests hash with). The manager caches only
    under bytes (`check_cache_keys`)."""
    hashes = list(hashes)
    for block_hash in hashes:
        kind = type(block_hash)
        if not ((kind is bytes and block_hash) or kind is int):
            raise ValueError(
                f"request {request_id!r}: block hash {block_hash!r} is neither non-empty "
                "bytes nor an int"
            )
    return hashes
