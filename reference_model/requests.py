"""The harness-side request (docs/traces.md "Requests", docs/spec.md §2.7), with content keys instead of
block hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfuzz.core.extra_keys import Extras, key_identity
from kvfuzz.core.snapshot import CacheKey

WAITING_STATES = ("WAITING", "PREEMPTED")


@dataclass(eq=False)
class Request:
    """One request (compared by identity). Its hash list is implicit: hash unit k (docs/spec.md §2.3) exists for every
    k < num_tokens // hbs and fingerprints the prefix of (k+1)·hbs tokens plus the salt."""

    request_id: str
    prompt: list[int]
    salt: str | None
    """The cache salt; "" is stored as None (no salt)."""
    priority: int
    arrival_time: float
    max_tokens: int
    skip_reading_prefix_cache: bool
    num_encoder_tokens: int
    hbs: int = 1
    """The hash block size: extra keys are per hash block."""
    lookahead: int = 0
    """num_hash_lookahead_tokens: the tokens after a hash block its key covers too (§5.7)."""
    extras: Extras | None = None
    """LoRA adapter, multimodal inputs, prompt embeddings (docs/spec.md §2.3); None for none."""
    tokens: list[int] = field(default_factory=list)
    prefix_cache_hit_limit: int | None = None
    """Leading tokens the prefix cache may serve (None: unbounded; vLLM 0.34's per-request
    limit, e.g. the first scored prompt row of prompt scoring)."""
    """all_token_ids: the prompt followed by the output tokens."""
    num_computed_tokens: int = 0
    status: str = "WAITING"
    num_preemptions: int = 0
    num_in_flight_tokens: int = 0
    """Tokens scheduled by steps still in flight (docs/spec.md §7.1)."""
    spec: list[int | None] = field(default_factory=list)
    """Draft tokens proposed after its last step, verified by its next one (spec decode); None:
    a placeholder, sampled if kept."""
    shared_prefix_boundary: int = 0
    """The junction of the driver's last lookup for it (docs/spec.md §6.3, §7); 0 at the api
    level, where no driver writes it."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def is_finished(self) -> bool:
        return self.status.startswith("FINISHED")

    def hashed_tokens(self, hbs: int) -> int:
        """len(block_hashes) · hbs: tokens covered by full hash blocks whose lookahead tokens
        exist too (docs/spec.md §2.3, §5.7)."""
        return max(len(self.tokens) - self.lookahead, 0) // hbs * hbs

    def key(self, group_id: int, num_tokens: int) -> CacheKey:
        """The content key of this request's prefix of num_tokens tokens in a group."""
        if self.extras is None and not self.lookahead:
            return (group_id, self.salt, tuple(self.tokens[:num_tokens]))
        ident = key_identity(self.salt, self.extras, self.tokens, num_tokens, self.hbs,
                             self.lookahead)
        return (group_id, ident, tuple(self.tokens[:num_tokens]))
