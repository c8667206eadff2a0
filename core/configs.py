"""Built-in configs: the shapes every campaign and state machine explores.

Pools are small on purpose, so that shortage, eviction and preemption happen all the time.
"""

from __future__ import annotations

from dataclasses import replace

from kvfuzz.core.config import Config, GroupConfig, SchedulerConfig
from kvfuzz.core.errors import KvfuzzError


class UnknownConfig(KvfuzzError):
    """No built-in config has that name."""


def _full(bs: int = 4) -> GroupConfig:
    return GroupConfig("full", bs)


def _swa(bs: int, window: int) -> GroupConfig:
    return GroupConfig("sliding_window", bs, sliding_window=window)


def _local(bs: int, chunk: int) -> GroupConfig:
    return GroupConfig("chunked_local", bs, attention_chunk_size=chunk)


def _mamba(bs: int, speculative: int = 0) -> GroupConfig:
    return GroupConfig("mamba", bs, num_speculative_blocks=speculative)


def _attention_mamba(
    name: str, num_blocks: int, num_mamba_groups: int, speculative: int = 0, state_bs: int = 64
) -> Config:
    """One full-attention group beside `num_mamba_groups` state groups, prefix caching off.

    vLLM groups layers in equal-sized groups, so a model with a:m attention:Mamba layers has
    m/a state groups per attention group. With caching off vLLM's state block spans the whole
    context (max_model_len), so a request holds 1 + speculative state blocks per group.
    """
    groups = (_full(4),) + tuple(_mamba(state_bs, speculative) for _ in range(num_mamba_groups))
    return Config(num_blocks, groups, name=name, max_model_len=64, enable_caching=False)


def _attention_mamba_align(
    name: str, num_blocks: int, num_mamba_groups: int, bs: int, hbs: int, speculative: int = 0,
    use_eagle: bool = False, retention: int | None = None,
    checkpoint_alignment: int | None = None,
) -> Config:
    """Full attention beside `num_mamba_groups` Mamba "align" groups, prefix caching on.

    In align mode vLLM gives attention and state layers one block size (the attention block is
    padded up to the state page), while prompts are hashed in smaller blocks: `bs / hbs` hash
    blocks per state block, so sub-block hits (and their copy-on-write) are on. With
    `checkpoint_alignment` each state group has one prefill checkpoint block, exported on that
    alignment (Mamba2 and Gated DeltaNet kernels that can, docs/spec.md §11.6).
    """
    checkpoints = ({} if checkpoint_alignment is None else
                   {"num_prefill_checkpoint_blocks": 1,
                    "prefill_checkpoint_alignment": checkpoint_alignment})
    groups = (GroupConfig("full", bs),) + tuple(
        GroupConfig("mamba", bs, mamba_cache_mode="align", num_speculative_blocks=speculative,
                    **checkpoints)
        for _ in range(num_mamba_groups)
    )
    return Config(num_blocks, groups, name=name, max_model_len=64, hash_block_size=hbs,
                  use_eagle=use_eagle, prefix_cache_retention_interval=retention)


def _qwen3_next_mtp(name: str, lookahead_hashes: bool = True) -> Config:
    """Qwen3-Next-shaped with 2 MTP modules (prefill lookahead 2): full (bs 8, the MTP layer's
    EAGLE group) + 3 Gated DeltaNet align groups (bs 8, 2 speculative blocks), hash blocks of 2.
    As vLLM's Scheduler builds its manager (vllm/v1/core/sched/scheduler.py:342-345 in 0.34.0):
    with lookahead hashes (its default) each hash covers the next 2 tokens and no block is
    dropped; without (`disable_lookahead_block_hashes`) EAGLE's block is dropped instead."""
    return replace(_attention_mamba_align(name, 60, 3, 8, 2, speculative=2,
                                          use_eagle=not lookahead_hashes),
                   groups=(GroupConfig("full", 8, eagle=True),) + tuple(
                       GroupConfig("mamba", 8, mamba_cache_mode="align",
                                   num_speculative_blocks=2) for _ in range(3)),
                   num_hash_lookahead_tokens=2 if lookahead_hashes else 0,
                   num_prefill_lookahead=2)


BUILTIN: dict[str, tuple[str, Config]] = {
    c.name: (description, c)
    for description, c in [
        ("single full-attention group", Config(16, (_full(),), name="full", max_model_len=64)),
        (
            "full attention, prefix caching off",
            Config(12, (_full(),), name="no_cache", max_model_len=64, enable_caching=False),
        ),
        (
            "single sliding-window group (window 8)",
            Config(12, (_swa(4, 8),), name="sliding_window", max_model_len=64,
                   max_in_flight_tokens=16),
        ),
        (
            "single chunked-local group (chunk 8)",
            Config(12, (_local(4, 8),), name="chunked_local", max_model_len=64,
                   max_in_flight_tokens=16),
        ),
        (
            "full attention (bs 8) + sliding window (bs 4, window 8): different block sizes",
            Config(20, (_full(8), _swa(4, 8)), name="hybrid", max_model_len=64),
        ),
        (
            "full + sliding window + chunked local: the multi-round fixed point",
            Config(24, (_full(4), _swa(4, 6), _local(4, 8)), name="hybrid3", max_model_len=64),
        ),
        (
            "decoder full attention + cross attention, caching off, an encoder budget of 12 "
            "encoder tokens a step",
            Config(16, (_full(), GroupConfig("cross", 4)), name="cross", max_model_len=64,
                   enable_caching=False, scheduler=SchedulerConfig(encoder_budget=12)),
        ),
        (
            "Tier B: full (bs 8) + sliding window (bs 4), sub-block hits and copy-on-write",
            Config(24, (_full(8), _swa(4, 4)), name="partial_hits", max_model_len=64,
                   partial_hits=True),
        ),
        (
            "watermark 0.1, 1 reserved block, full-sequence gate, 1 lookahead slot",
            Config(20, (_full(),), name="watermark", max_model_len=64, watermark=0.1,
                   scheduler=SchedulerConfig(reserved_blocks=1, full_sequence_must_fit=True,
                                             num_lookahead_tokens=1)),
        ),
        (
            "Tier B: EAGLE last-block drop on a full-attention group",
            Config(16, (_full(),), name="eagle", max_model_len=64, use_eagle=True),
        ),
        (
            "fixed drafts: full attention (bs 4), 2 placeholder drafts per sampling request each "
            "step and one-token admissions (a full hit) padded to them, as vLLM's async "
            "scheduling with a SpeculativeConfig",
            Config(16, (_full(),), name="fixed_drafts", max_model_len=64,
                   scheduler=SchedulerConfig(num_speculative_tokens=2)),
        ),
        (
            "dynamic drafts: EAGLE on full attention (bs 4), up to 3 placeholder drafts a step "
            "by its batch size (1 request: 3, 2-3: 2, 4: none), no admission padded, a "
            "budget of 8 tokens, as vLLM's num_speculative_tokens_per_batch_size",
            Config(20, (_full(),), name="dynamic_drafts", max_model_len=64, use_eagle=True,
                   scheduler=SchedulerConfig(
                       token_budget=8, num_speculative_tokens=3,
                       num_speculative_tokens_per_batch_size=((1, 1, 3), (2, 2, 2), (4, 4, 0)))),
        ),
        (
            "deferred frees (pop_blocks_for_free, released later): full (bs 8) + sliding window "
            "(bs 4), so the per-group release order shows",
            Config(20, (_full(8), _swa(4, 8)), name="deferred", max_model_len=64,
                   deferred_frees=True),
        ),
        (
            "KV cache events on (take_events), a small pool so that copies and evictions happen",
            Config(12, (_full(),), name="events", max_model_len=64, kv_events=True),
        ),
        (
            "KV cache events with Tier-B partial entries: partial_hits' full (bs 8) + sliding "
            "window (bs 4), so partial keys are announced, promoted and removed",
            Config(24, (_full(8), _swa(4, 4)), name="events_partial", max_model_len=64,
                   partial_hits=True, kv_events=True),
        ),
        (
            "KV cache events with multi-tenant extra keys (LoRA adapters, multimodal inputs, "
            "prompt embeddings, cache salts) and kv_cache_report_mode \"full\": each "
            "BlockStored names its blocks' extra keys, and a prefix hit re-announces the "
            "blocks it reuses",
            Config(16, (_full(),), name="events_tenants", max_model_len=64, kv_events=True,
                   extra_keys=True, kv_cache_report_mode="full"),
        ),
        (
            "KV connector: requests load remote KV (external tokens, uncached until the load "
            "lands, whole, short or failed); full attention (bs 4)",
            Config(16, (_full(),), name="connector", max_model_len=64, kv_connector=True),
        ),
        (
            "KV connector on a gpt-oss-shaped hybrid: full attention (bs 4) + sliding window "
            "(bs 4, window 8; gpt-oss alternates full and 128-token window layers); a short or "
            "failed load fails the whole request, as vLLM requires with several groups",
            Config(24, (_full(4), _swa(4, 8)), name="gpt_oss_connector", max_model_len=64,
                   kv_connector=True),
        ),
        (
            "deferred frees behind steps in flight with a KV connector: full (bs 8) + sliding "
            "window (bs 4), a budget of 4 so that prompts take several chunks; vLLM's "
            "AsyncScheduler defers frees with a consumer connector, as kvfuzz's driver does",
            Config(20, (_full(8), _swa(4, 8)), name="deferred_connector", max_model_len=64,
                   deferred_frees=True, kv_connector=True,
                   scheduler=SchedulerConfig(token_budget=4)),
        ),
        (
            "KV connector on a Mistral-7B-v0.1-shaped model: every layer a sliding window "
            "(bs 4, window 8; Mistral's 4096), one group, so a short load keeps the blocks "
            "before the first it did not fill when their window was loaded",
            Config(16, (_swa(4, 8),), name="mistral_connector", max_model_len=64,
                   max_in_flight_tokens=16, kv_connector=True),
        ),
        (
            "multi-tenant: LoRA adapters, multimodal inputs (an encoder budget of 3 embeddings "
            "a step, an encoder cache of 4), prompt embeddings, cache salts",
            Config(16, (_full(),), name="tenants", max_model_len=64, extra_keys=True,
                   scheduler=SchedulerConfig(encoder_budget=3, encoder_cache_size=4)),
        ),
        (
            "Mamba-only (Mamba-Codestral-like): one state group, state block = max_model_len",
            Config(6, (_mamba(64),), name="mamba", max_model_len=64, enable_caching=False),
        ),
        (
            "Jamba-shaped: 1 attention : 7 Mamba layers -> full (bs 4) + 7 state groups",
            _attention_mamba("jamba", 40, 7),
        ),
        (
            "Nemotron-H-shaped: 1 attention : 6 Mamba2 layers -> full (bs 4) + 6 state groups",
            _attention_mamba("nemotron_h", 36, 6),
        ),
        (
            "Qwen3.5-shaped: 1 gated attention : 3 Gated DeltaNet, MTP draft -> full (bs 4) + "
            "3 state groups with 2 speculative blocks each",
            _attention_mamba("qwen3_5", 40, 3, speculative=2),
        ),
        (
            "state groups with small blocks (bs 4, 1 speculative) beside full attention: "
            "exercises releasing state blocks behind the last computed token",
            _attention_mamba("mamba_small_blocks", 20, 2, speculative=1, state_bs=4),
        ),
        (
            "Qwen3.5-shaped, Mamba align mode: 1 gated attention : 3 Gated DeltaNet with MTP "
            "-> full (bs 8) + 3 state groups (bs 8, 2 speculative blocks), hash blocks of 2",
            _attention_mamba_align("qwen3_5_align", 60, 3, 8, 2, speculative=2),
        ),
        (
            "Qwen3-Next-shaped with its MTP drafter (EAGLE-style, use_eagle), Mamba align mode: "
            "1 gated attention : 3 Gated DeltaNet -> full (bs 8) + 3 state groups (bs 8, 1 "
            "speculative block), hash blocks of 2; state checkpoints follow EAGLE's replay "
            "boundary",
            _attention_mamba_align("qwen3_next_eagle", 60, 3, 8, 2, speculative=1,
                                   use_eagle=True),
        ),
        (
            "Nemotron-H-shaped, Mamba align mode: 1 attention : 6 Mamba2 -> full (bs 8) + 6 "
            "state groups (bs 8), hash blocks of 4",
            _attention_mamba_align("nemotron_h_align", 64, 6, 8, 4),
        ),
        (
            "Nemotron-H-shaped with Mamba2's prefill checkpoint blocks: nemotron_h_align's "
            "groups (full bs 8 + 6 align state groups, hash blocks of 4), each state group "
            "with one checkpoint block on alignment 1; a prompt's last chunk is not split at "
            "its checkpoint",
            _attention_mamba_align("nemotron_h_checkpoint", 64, 6, 8, 4, checkpoint_alignment=1),
        ),
        (
            "Qwen3.5-shaped with Gated DeltaNet prefill checkpoint blocks: qwen3_5_align's "
            "groups (full bs 8 + 3 align state groups, 2 speculative blocks, hash blocks of "
            "2), one checkpoint block each on the hash-block grid (alignment 2)",
            _attention_mamba_align("qwen3_5_checkpoint", 60, 3, 8, 2, speculative=2,
                                   checkpoint_alignment=2),
        ),
        (
            "Qwen3.5-shaped with Gated DeltaNet prefill checkpoint blocks and retention 0: "
            "qwen3_5_checkpoint's groups (full bs 8 + 3 align state groups, 2 speculative "
            "blocks, hash blocks of 2, checkpoints on alignment 2); only the chunk reaching a "
            "prompt's (or a resumed request's) prefill end reserves and keeps its checkpoint",
            _attention_mamba_align("qwen3_5_checkpoint_replay", 60, 3, 8, 2, speculative=2,
                                   retention=0, checkpoint_alignment=2),
        ),
        (
            "Qwen3-Next-shaped with its MTP drafter and Gated DeltaNet prefill checkpoint "
            "blocks: qwen3_next_eagle's groups (full bs 8 + 3 align state groups, 1 "
            "speculative block, hash blocks of 2), one checkpoint block each on alignment 2; "
            "checkpoints at EAGLE's replay boundary",
            _attention_mamba_align("qwen3_next_checkpoint", 60, 3, 8, 2, speculative=1,
                                   use_eagle=True, checkpoint_alignment=2),
        ),
        (
            "Nemotron-H-shaped with a KV connector (NIXL-style disaggregated prefill), Mamba "
            "align mode: full (bs 8) + 6 state groups (bs 8), hash blocks of 4; loads pass "
            "state hits and report diverging per-group hits; a short load fails its request "
            "(kv_load_failure_policy fail, vLLM's default)",
            replace(_attention_mamba_align("nemotron_h_connector", 64, 6, 8, 4),
                    kv_connector=True, scheduler=SchedulerConfig(kv_load_failure_policy="fail")),
        ),
        (
            "Qwen3-Next-shaped with its MTP drafter and a KV connector: qwen3_next_eagle's "
            "groups (full bs 8 + 3 align state groups, 1 speculative block, hash blocks of 2); "
            "the connector's per-group lookups drop EAGLE's last unit as the fixed point does",
            replace(_attention_mamba_align("qwen3_next_eagle_connector", 60, 3, 8, 2,
                                           speculative=1, use_eagle=True), kv_connector=True),
        ),
        (
            "Qwen3.5-shaped with a KV connector, prefix caching off: full (bs 4) + 3 state "
            "groups with 2 speculative blocks each; every admission may load remote KV",
            replace(_attention_mamba("qwen3_5_connector", 40, 3, speculative=2),
                    kv_connector=True),
        ),
        (
            "Granite-4.0-H-shaped, Mamba align mode, state block 4 hash blocks of 2: 1 "
            "attention : 9 Mamba2 -> full (bs 8) + 9 state groups (bs 8)",
            _attention_mamba_align("granite4", 80, 9, 8, 2),
        ),
        (
            "Mamba-only with prefix caching (Mamba-Codestral-like, align mode, bs 4): state "
            "hits at block ends only",
            Config(16, (GroupConfig("mamba", 4, mamba_cache_mode="align"),), name="mamba_align",
                   max_model_len=64),
        ),
        (
            "full (bs 4) + sliding window (bs 8, window 8) + Mamba align (bs 8, 1 speculative "
            "block): the window's block is not the hash block, so vLLM turns sub-block hits "
            "off and hits land on multiples of 8",
            Config(48, (_full(4), _swa(8, 8), GroupConfig("mamba", 8, mamba_cache_mode="align",
                                                          num_speculative_blocks=1)),
                   name="swa_mamba_align", max_model_len=64),
        ),
        (
            "full (bs 8) + sliding window (bs 2, window 4) + Mamba align (bs 8), hash blocks of "
            "2: sub-block hits stay on, and three spec groups make the fixed point run rounds",
            Config(56, (_full(8), _swa(2, 4), GroupConfig("mamba", 8, mamba_cache_mode="align")),
                   name="swa_mamba_align_fine", max_model_len=64),
        ),
        (
            "MLA (DeepSeek-V2/V3-shaped): latent attention, managed as full attention",
            Config(16, (GroupConfig("mla", 4),), name="mla", max_model_len=64),
        ),
        (
            "full attention + MLA (bs 8): two full-attention spec groups in one hybrid lookup",
            Config(24, (_full(4), GroupConfig("mla", 8)), name="full_mla", max_model_len=64),
        ),
        (
            "full attention + sink full attention (8 sink tokens, static-sink attention)",
            Config(24, (_full(4), GroupConfig("sink_full", 4, sink_len=8)), name="sink_full",
                   max_model_len=64),
        ),
        (
            "R-SWA (bs 2, window 2): the prompt stays, decode keeps its last 2 tokens",
            Config(24, (GroupConfig("rswa", 2, rswa_window=2),), name="rswa", max_model_len=32),
        ),
        (
            "full attention (bs 4) + R-SWA (bs 2, window 2): gap blocks released beside a full "
            "group",
            Config(32, (_full(4), GroupConfig("rswa", 2, rswa_window=2)), name="full_rswa",
                   max_model_len=32),
        ),
        (
            "full attention + a circular buffer (bs 8), shaped like GLM-5.3-Flash's indexer "
            "tail: one ring block per request, out of every lookup",
            Config(24, (_full(4), GroupConfig("circular_buffer", 8)), name="full_ring",
                   max_model_len=64),
        ),
        (
            "BERT-shaped encoder-only model (bge/e5 embeddings): bidirectional attention keeps "
            "no KV cache; vLLM turns prefix caching and chunked prefill off for it",
            Config(8, (GroupConfig("encoder_only", 16),), name="bert", max_model_len=64,
                   enable_caching=False, scheduler=SchedulerConfig(chunked_prefill=False)),
        ),
        (
            "ColQwen3.5-shaped retriever: 1 encoder-only attention : 3 Gated DeltaNet -> "
            "encoder-only (bs 16) + 3 state groups; caching and chunked prefill off",
            Config(24, (GroupConfig("encoder_only", 16),) + tuple(_mamba(64) for _ in range(3)),
                   name="colqwen3_5", max_model_len=64, enable_caching=False,
                   scheduler=SchedulerConfig(chunked_prefill=False)),
        ),
        (
            "Gemma-3-shaped with prefix-cache retention: 5 local : 1 global -> full (bs 4) + "
            "sliding window (bs 4, window 8); window blocks keep keys only at 16-token segment "
            "ends and replay boundaries",
            Config(24, (_full(4), _swa(4, 8)), name="gemma3_retention", max_model_len=64,
                   prefix_cache_retention_interval=16),
        ),
        (
            "sliding window (bs 4, window 5) alone, retention 0: its blocks keep keys only at "
            "each prompt's replay boundary",
            Config(16, (_swa(4, 5),), name="swa_replay_only", max_model_len=64,
                   max_in_flight_tokens=16, prefix_cache_retention_interval=0),
        ),
        (
            "sliding window (bs 4, window 8) alone with EAGLE, retention 0: the replay "
            "boundaries an EAGLE lookup needs (the block below each) keep their keys",
            Config(16, (_swa(4, 8),), name="swa_eagle_replay", max_model_len=64,
                   use_eagle=True, prefix_cache_retention_interval=0),
        ),
        (
            "Qwen3.5-shaped, Mamba align mode with prefix-cache retention 16: 1 gated "
            "attention : 3 Gated DeltaNet with MTP -> full (bs 8) + 3 state groups (bs 8, 2 "
            "speculative blocks), hash blocks of 2; a state block keeps its key only at a "
            "16-token segment end or the prompt's replay boundary",
            _attention_mamba_align("qwen3_5_retention", 60, 3, 8, 2, speculative=2,
                                   retention=16),
        ),
        (
            "Tier B: EAGLE on a hybrid model with sub-block hits, full attention (bs 16) + two "
            "sliding windows (bs 4, windows 8 and 12): the fixed point's rounds with EAGLE drops, "
            "EAGLE with partial tails, 16-token blocks at a 4-token alignment",
            Config(40, (_full(16), _swa(4, 8), _swa(4, 12)), name="eagle_hybrid",
                   max_model_len=64, use_eagle=True, partial_hits=True),
        ),
        (
            "DeepSeek-V3-shaped with its MTP module, as vLLM's engine builds it: one MLA group "
            "(bs 4) holding the drafter's layer too (an EAGLE group), block hashes covering the "
            "next token in place of EAGLE's block drop (num_hash_lookahead_tokens 1, "
            "num_prefill_lookahead 1, use_eagle off; docs/spec.md §5.7)",
            Config(16, (GroupConfig("mla", 4, eagle=True),), name="deepseek_v3_mtp",
                   max_model_len=64, num_hash_lookahead_tokens=1, num_prefill_lookahead=1),
        ),
        (
            "DeepSeek-V3-shaped with 3 chained MTP modules (multi-module MTP), as vLLM's engine "
            "builds it: one MLA group (bs 4, an EAGLE group), hashes covering the next 3 tokens "
            "in place of EAGLE's block drop, the last 2 computed tokens re-prefillable and "
            "never cached",
            Config(16, (GroupConfig("mla", 4, eagle=True),), name="deepseek_v3_mtp3",
                   max_model_len=64, num_hash_lookahead_tokens=3, num_prefill_lookahead=3),
        ),
        (
            "Qwen3-Next-shaped with 2 MTP modules, Mamba align mode, as vLLM's engine builds it: "
            "1 gated attention (bs 8, the MTP layer's EAGLE group) : 3 Gated DeltaNet (bs 8, 2 "
            "speculative blocks), hash blocks of 2 covering the next 2 tokens in place of "
            "EAGLE's block drop; state checkpoints leave them to come",
            _qwen3_next_mtp("qwen3_next_mtp"),
        ),
        (
            "qwen3_next_mtp with lookahead hashes off (vLLM's disable_lookahead_block_hashes): "
            "EAGLE's block drop instead, so the EAGLE group caches no re-prefillable token",
            _qwen3_next_mtp("qwen3_next_mtp_eagle", lookahead_hashes=False),
        ),
        (
            "Qwen3-Next-shaped with its MTP drafter and shared-prefix junction checkpoints: "
            "qwen3_next_eagle's groups (full bs 8 + 3 align state groups, hbs 2, EAGLE) with "
            "enable_mamba_shared_prefix_checkpoint: a chunk stops at a request's junction and "
            "the state there is registered (docs/spec.md §11.3)",
            replace(_attention_mamba_align("qwen3_next_junction", 60, 3, 8, 2, speculative=1,
                                           use_eagle=True),
                    enable_mamba_shared_prefix_checkpoint=True),
        ),
        (
            "qwen3_next_junction with KV cache events: the partial entry keying a junction's "
            "state lies inside the prompt, so its BlockStored names a parent that the request "
            "holds further hashes past",
            replace(_attention_mamba_align("qwen3_next_junction_events", 60, 3, 8, 2,
                                           speculative=1, use_eagle=True),
                    enable_mamba_shared_prefix_checkpoint=True, kv_events=True),
        ),
        (
            "EAGLE on a hybrid with the drafter's layer in one group: eagle_hybrid's groups "
            "(full bs 16 + windows 8 and 12 at bs 4) with only the full group an EAGLE group, "
            "so the windows keep their last hit block",
            Config(40, (GroupConfig("full", 16, eagle=True), _swa(4, 8), _swa(4, 12)),
                   name="eagle_one_group", max_model_len=64, use_eagle=True, partial_hits=True),
        ),
        (
            "full attention (bs 16) + sliding window (bs 4, window 8): a window block a quarter "
            "of the hit alignment, so a window run's end off by two blocks shows",
            Config(40, (_full(16), _swa(4, 8)), name="full16_swa4", max_model_len=64),
        ),
        (
            "EAGLE on full attention (bs 16) + a Mamba align group (bs 8, 1 speculative "
            "block), hash blocks of 8 (vLLM's default, the gcd): the state block equals the "
            "hash block and sits below the hit alignment, so hits land on 16",
            Config(60, (_full(16), GroupConfig("mamba", 8, mamba_cache_mode="align",
                                               num_speculative_blocks=1)),
                   name="full16_mamba8_align", max_model_len=64, hash_block_size=8,
                   use_eagle=True),
        ),
        (
            "full (bs 4), a circular buffer (bs 8), then a sliding window (bs 4, window 8) "
            "keeping 2 tokens more below it: the lookup skips the ring between cacheable "
            "groups, and the window's retained tokens (multi-module MTP's re-prefill) count",
            Config(32, (_full(4), GroupConfig("circular_buffer", 8),
                        GroupConfig("sliding_window", 4, sliding_window=8,
                                    extra_retained_tokens=2)),
                   name="ring_swa_retained", max_model_len=64),
        ),
        (
            "Qwen3-Next-shaped with its MTP drafter and retention 0: qwen3_next_eagle's groups "
            "(full bs 8 + 3 align state groups, 1 speculative block, hash blocks of 2); the "
            "retained replay boundaries sit a block below EAGLE's last hash boundary",
            _attention_mamba_align("qwen3_next_eagle_replay", 60, 3, 8, 2, speculative=1,
                                   use_eagle=True, retention=0),
        ),
        (
            "long prompts with prefill checkpoints: full (bs 64) + one Mamba align group (bs "
            "64, 2 speculative blocks, a checkpoint on alignment 16), hash blocks of 16, "
            "max_model_len 1024 and a budget of 512, so positions pass 256",
            Config(96, (GroupConfig("full", 64),
                        GroupConfig("mamba", 64, mamba_cache_mode="align",
                                    num_speculative_blocks=2, num_prefill_checkpoint_blocks=1,
                                    prefill_checkpoint_alignment=16)),
                   name="long_checkpoint", max_model_len=1024, hash_block_size=16,
                   scheduler=SchedulerConfig(token_budget=512, max_running=4)),
        ),
        (
            "priority scheduling, no chunked prefill",
            Config(16, (_full(),), name="priority", max_model_len=64,
                   scheduler=SchedulerConfig(policy="priority", chunked_prefill=False)),
        ),
        (
            "full attention (bs 4) + a Mamba align group (bs 4), hash blocks of 1: a state is "
            "keyable at every token, so a 2-token prompt keys its state at token 1",
            Config(40, (_full(4), GroupConfig("mamba", 4, mamba_cache_mode="align")),
                   name="mamba_hbs1", max_model_len=64, hash_block_size=1),
        ),
    ]
}


def builtin_config(name: str) -> Config:
    try:
        return BUILTIN[name][1]
    except KeyError:
        raise UnknownConfig(
            f"unknown config {name!r}; built-in configs: {', '.join(BUILTIN)}"
        ) from None
