"""Exporting a manager-level (api) trace as a plain vLLM regression test.

`export_vllm_test` writes a pytest module in the style of vLLM's tests/v1/core: it imports
only `vllm`, `torch` and `pytest`, builds the manager with vLLM's own classes and hasher, plays
the trace's ops as calls (the scheduler's bookkeeping after each call written out), and asserts
in plain words what the spec (docs/spec.md) expects. The expected outcomes come from replaying
the trace on kvcache and the reference model at export time, so the test fails on a vLLM that
has the finding's bug and passes on one (or on kvcache through the drop-in) that does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfuzz.core.trace import Op, Trace, normalize_op, write_atomic
from kvfuzz.fuzz.vllm_test_text import (
    SHA256_IMPORT,
    VllmTestUnsupported,
    docstring,
    function_name,
    group_specs,
    ident,
    retention_arg,
    spec,
    spec_imports,
    title,
)
from kvfuzz.harness.executor import Counterexample, Execution

OPS = ("add_request", "get_computed_blocks", "allocate_slots", "cache_blocks", "free",
       "evict_blocks", "new_step_starts", "get_num_cached_tokens")
"""The trace ops a generated test can play (docs/traces.md)."""


_RESERVED = {"manager", "out", "hit", "blocks", "cached", "removed", "keyed", "taken", "count",
             "counted", "free_before", "group", "request", "lookup", "schedule", "make_manager",
             "make_request", "pytest", "torch", "inspect", "sha256", "held", "stored", "event",
             "hashes", "tokens"}
"""Names a generated test uses itself, which a request id must not take."""


def _refused(expected: Any) -> bool:
    """Whether the reference's result of an op is an error (the spec refuses the call)."""
    return isinstance(expected, dict) and "error" in expected


class _Writer:
    """Builds the test's text from the trace and kvcache's replay of it."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.config = trace.config
        self.check = str(trace.meta.get("check") or "")
        self.names: dict[str, str] = {}
        self.lines: list[str] = []
        self.needs: set[str] = set()
        self.waiting: set[str] = set()  # refused, never admitted: the spec keeps no table
        self.lookup_of: dict[str, tuple[str, str]] = {}

    def name(self, rid: str) -> str:
        return self.names[rid]

    def emit(self, line: str = "") -> None:
        self.lines.append(("    " + line) if line else "")

    def play(self) -> None:
        execution = Execution(self.config, self.trace.level, ["kvcache"], model=True,
                              meta=self.trace.meta)
        self.side = execution.targets[0].side
        if self.config.kv_events:
            self._count_removals(self.side.manager)
        for step, raw in enumerate(self.trace.ops):
            op = normalize_op(raw, self.trace.level, f"step {step}")
            if self.check == "EV4" and step == len(self.trace.ops) - 1:
                self.emit("manager.take_events()  # the events of the calls before the last")
            if op["op"] not in OPS:
                raise VllmTestUnsupported(
                    f"step {step}: op {op['op']!r}; a vLLM test plays the manager ops "
                    f"{', '.join(OPS)} (api-level traces)")
            try:
                expected = execution.apply(raw)
            except Counterexample as exc:
                raise VllmTestUnsupported(
                    f"the trace fails on kvcache or the reference model, so no outcome can be "
                    f"expected of vLLM: {exc.finding.headline()}") from None
            getattr(self, "_" + op["op"])(op, expected, step)
        self.execution = execution
        self._final_checks()

    # --- ops -----------------------------------------------------------------------------
    def _add_request(self, op: Op, expected: Any, step: int) -> None:
        rid = op["request_id"]
        name = ident(rid, set(self.names.values()) | _RESERVED)
        self.names[rid] = name
        args = [repr(rid), repr(list(op["prompt"]))]
        if op["max_tokens"] != 1:
            args.append(f"max_tokens={op['max_tokens']}")
        for field in ("cache_salt", "prefix_cache_hit_limit"):
            if op[field] is not None:
                args.append(f"{field}={op[field]!r}")
                if field == "prefix_cache_hit_limit":
                    self.needs.add("hit_limit")
        if op["priority"]:
            args.append(f"priority={op['priority']}")
        embeds = op["prompt_embeds"]
        if embeds is not None:
            self.needs.add("prompt_embeds")
            args.append(f"prompt_embeds={list(embeds)!r}")
        for field in ("lora_name", "mm_inputs", "skip_reading_prefix_cache"):
            if op[field]:
                raise VllmTestUnsupported(f"step {step}: add_request with {field} is not "
                                          "exported")
        if op["num_encoder_tokens"]:
            raise VllmTestUnsupported(f"step {step}: encoder tokens are not exported")
        self.emit(f"{name} = make_request({', '.join(args)})")

    def _get_computed_blocks(self, op: Op, expected: Any, step: int) -> None:
        name = self.name(op["request_id"])
        bound = op["max_cache_hit_length"]
        if bound is not None:
            self.needs.add("lookup_bound")
        call = f"lookup(manager, {name}{'' if bound is None else f', {bound}'})"
        self.emit(f"{name}_hit_blocks, {name}_hit = {call}")
        self.lookup_of[op["request_id"]] = (f"{name}_hit_blocks", f"{name}_hit")
        if self.check == "I12":
            self.emit(f"assert {name}_hit <= {name}.num_tokens - 1, (")
            self.emit(f"    f\"a lookup bounded by {bound} hits {{{name}_hit}} of {name}'s "
                      f"{{{name}.num_tokens}} tokens: none is left to compute its logits\")")

    def _allocate_slots(self, op: Op, expected: Any, step: int) -> None:
        rid = op["request_id"]
        name = self.name(rid)
        args = [name, str(op["num_new_tokens"])]
        hit = "0"
        if op["use_lookup"]:
            blocks_var, hit = self.lookup_of.pop(rid)
            args += [f"num_new_computed_tokens={hit}", f"new_computed_blocks={blocks_var}"]
        for field in ("num_lookahead_tokens", "num_external_computed_tokens", "num_encoder_tokens",
                      "reserved_blocks"):
            if op[field]:
                args.append(f"{field}={op[field]}")
        for field, default in (("full_sequence_must_fit", False), ("has_scheduled_reqs", True),
                               ("delay_cache_blocks", False)):
            if op[field] != default:
                args.append(f"{field}={op[field]}")
        call = f"manager.allocate_slots({', '.join(args)})"
        if _refused(expected):
            self._call(call, expected)
            return
        if self.check == "P1":
            self.emit("free_before = manager.block_pool.get_num_free_blocks()")
        self.emit(f"out = {call}")
        if expected is None:
            self.emit(f"assert out is None, \"{name} does not fit: allocate_slots refuses it\"")
            if self.side.requests[rid].num_computed_tokens == 0:
                self.waiting.add(rid)
            return
        self.emit(f"assert out is not None, \"{name} fits: allocate_slots must not refuse it\"")
        if self.check == "P1":
            self.emit("taken = free_before - manager.block_pool.get_num_free_blocks()")
            self.emit("assert taken == counted[-1], (")
            self.emit(f"    f\"allocate_slots of {name} took {{taken}} blocks but its admission "
                      "check counted {counted[-1]}: a pool holding only the counted blocks "
                      "raises 'Cannot get N free blocks' mid-allocation\")")
        external = op["num_external_computed_tokens"]
        parts = (hit if hit != "0" else "", str(external) if external else "",
                 str(op["num_new_tokens"]) if op["num_new_tokens"] else "")
        total = " + ".join(x for x in parts if x) or "0"
        self.emit(f"schedule({name}, {total})")
        self.waiting.discard(rid)

    def _cache_blocks(self, op: Op, expected: Any, step: int) -> None:
        name = self.name(op["request_id"])
        n = op["num_computed_tokens"]
        self._call(f"manager.cache_blocks({name}, "
                   f"{f'{name}.num_computed_tokens' if n is None else n})", expected)

    def _free(self, op: Op, expected: Any, step: int) -> None:
        name = self.name(op["request_id"])
        self.emit(f"manager.free({name})")
        if op["preempt"]:
            self.emit(f"{name}.status = RequestStatus.PREEMPTED")
            self.emit(f"{name}.num_computed_tokens = 0")
        else:
            self.emit(f"{name}.status = RequestStatus.FINISHED_STOPPED")

    def _evict_blocks(self, op: Op, expected: Any, step: int) -> None:
        self._call(f"manager.evict_blocks({set(op['block_ids'])!r})", expected)

    def _new_step_starts(self, op: Op, expected: Any, step: int) -> None:
        self.emit("manager.new_step_starts()")

    def _get_num_cached_tokens(self, op: Op, expected: Any, step: int) -> None:
        name = self.name(op["request_id"])
        self.needs.add("cached_tokens_probe")
        self.emit(f"cached = manager.get_num_cached_tokens({name})")
        self.emit(f"_, hit = lookup(manager, {name})")
        self.emit("assert cached == hit, (")
        self.emit(f"    f\"get_num_cached_tokens({name}) says {{cached}} tokens are cached, but "
                  f"get_computed_blocks, which it mirrors, hits {{hit}}\")")

    def _call(self, call: str, expected: Any) -> None:
        """The call, inside pytest.raises where the spec refuses it."""
        if _refused(expected):
            self.emit(f"with pytest.raises({expected['error']}):  # the spec refuses it and "
                      "changes nothing")
            call = "    " + call
        self.emit(call)

    # --- the property checked at the end -------------------------------------------------
    def _final_checks(self) -> None:
        state = self.execution.state
        if self.check == "I16":
            for rid in sorted(self.waiting):
                name = self.name(rid)
                self.emit("for group in manager.coordinator.single_type_managers:")
                self.emit(f"    assert {rid!r} not in group.req_to_blocks, (")
                self.emit(f"        \"{name} was refused and holds no block, yet the manager "
                          "keeps a table for it\")")
        elif self.check == "I1":
            self.emit("assert manager.block_pool.null_block.ref_cnt == 0, (")
            self.emit("    f\"the null block is neither queued nor counted, but its ref_cnt is "
                      "{manager.block_pool.null_block.ref_cnt}\")")
        elif self.check == "H1":
            self._distinct_keys()
        elif self.check == "EV2":
            removed = self.removed
            self.emit("removed = [h for event in manager.take_events()")
            self.emit("           if type(event).__name__ == \"BlockRemoved\" "
                      "for h in event.block_hashes]")
            self.emit(f"assert len(removed) == {removed}, (")
            self.emit("    f\"BlockRemoved announced {len(removed)} key(s), but another block "
                      "still holds every key that lost a copy: a KV-event consumer now misses "
                      "a cached prefix\")")
        elif self.check == "EV3":
            self.emit("for event in manager.take_events():")
            self.emit("    if type(event).__name__ != \"BlockStored\":")
            self.emit("        continue")
            self.emit("    hashes, tokens = len(event.block_hashes), len(event.token_ids)")
            self.emit("    assert tokens == hashes * event.block_size, (")
            self.emit("        f\"a BlockStored names {hashes} block hash(es) of {event.block_size} "
                      "tokens but carries {tokens} token ids: a KV-event consumer that pairs "
                      "each hash with its block_size slice of the token ids keys a cached "
                      "block under the wrong prefix\")")
        elif self.check == "EV4":
            self._stored_keys_held()
        elif self.check == "DIFF-state":
            keyed = [i for i, key in enumerate(state.block_keys) if key is not None]
            self.emit("keyed = [block.block_id for block in manager.block_pool.blocks")
            self.emit("         if block.block_hash is not None]")
            self.emit(f"assert keyed == {keyed!r}, (")
            self.emit(f"    f\"blocks {{keyed}} carry a cache key where only {keyed} hold the "
                      "state their key names: a later hit resumes from the wrong state\")")

    def _stored_keys_held(self) -> None:
        self.emit("held = {(maybe_convert_block_hash(get_block_hash(block.block_hash)),")
        self.emit("         get_group_id(block.block_hash))")
        self.emit("        for block in manager.block_pool.blocks if block.block_hash is not None}")
        self.emit("for event in manager.take_events():")
        self.emit("    if type(event).__name__ != \"BlockStored\":")
        self.emit("        continue")
        self.emit("    stored = {(h, event.group_idx or 0) for h in event.block_hashes}")
        self.emit("    assert stored <= held, (")
        self.emit("        f\"a BlockStored announces {len(stored - held)} key(s) that no block "
                  "holds: a KV-event consumer believes a prefix cached that the engine no "
                  "longer has\")")

    def _distinct_keys(self) -> None:
        requests = self.side.requests
        rids = list(self.names)
        for i, x in enumerate(rids):
            for y in rids[i + 1:]:
                hx, hy = requests[x].block_hashes, requests[y].block_hashes
                for b in range(min(len(hx), len(hy))):
                    if hx[b] != hy[b]:
                        nx, ny = self.name(x), self.name(y)
                        self.emit(f"assert {nx}.block_hashes[{b}] != {ny}.block_hashes[{b}], (")
                        self.emit(f"    \"block {b} of {nx} and of {ny} hold different model "
                                  "inputs but get the same key: one is served the other's KV\")")
                        break

    def _count_removals(self, manager: Any) -> None:
        """Count the keys kvcache's BlockRemoved events name (the replay drains them per op)."""
        self.removed = 0
        take = manager.take_events

        def take_and_count() -> list[Any]:
            events = take()
            self.removed += sum(len(e.block_hashes) for e in events
                                if type(e).__name__ == "BlockRemoved")
            return events

        manager.take_events = take_and_count


_HEADER = '''import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import {specs}
from vllm.v1.request import Request, RequestStatus

{sha256_import}
DTYPE = torch.float16
HASH_BLOCK_SIZE = {hash_block_size}


def make_manager() -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks={num_blocks},
        kv_cache_tensors=[],{config_extra}
        kv_cache_groups=[
{groups}
        ],
    )
    return KVCacheManager(
        config,
        max_model_len={max_model_len},
        scheduler_block_size={scheduler_block_size},
        hash_block_size=HASH_BLOCK_SIZE,
        max_in_flight_tokens={max_in_flight_tokens},
        enable_caching={enable_caching},
        use_eagle={use_eagle},
        watermark={watermark},{manager_extra}
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 1, **kwargs) -> Request:
    init_none_hash(sha256)
    limit = kwargs.pop("prefix_cache_hit_limit", None)
    embeds = kwargs.pop("prompt_embeds", None)
    if embeds is not None:  # -1 marks a token-id position (its row is ignored, filled with 0)
        kwargs["prompt_is_token_ids"] = [v < 0 for v in embeds]
        kwargs["prompt_embeds"] = torch.tensor([[float(max(v, 0))] for v in embeds])
    request = Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens{sampling_extra}), None,
        block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256), **kwargs,
    )
    if limit is not None:  # what vLLM derives from prompt-scoring parameters
        request.prefix_cache_hit_limit = limit
    return request


def lookup(manager: KVCacheManager, request: Request, bound: int | None = None):
    """get_computed_blocks as (blocks, hit); newer releases return a third value."""
    args = () if bound is None else (bound,)
    result = manager.get_computed_blocks(request, *args)
    return result[0], result[1]


def schedule(request: Request, num_tokens: int) -> None:
    """What the scheduler does after a successful allocate_slots."""
    request.num_computed_tokens += num_tokens
    request.status = RequestStatus.RUNNING
'''

_GUARDS = {
    "lookup_bound": ("\"max_cache_hit_length\" not in inspect.signature("
                     "KVCacheManager.get_computed_blocks).parameters",
                     "this vLLM has no lookup bound"),
    "cached_tokens_probe": ("not hasattr(KVCacheManager, \"get_num_cached_tokens\")",
                            "this vLLM has no get_num_cached_tokens"),
    "hit_limit": ("not hasattr(Request, \"get_max_cache_hit_length\")",
                  "this vLLM has no per-request prefix-cache hit limit"),
    "prompt_embeds": ("\"prompt_is_token_ids\" not in inspect.signature(Request).parameters",
                      "this vLLM's Request takes no prompt_is_token_ids mask"),
    "kv_events": ("\"enable_kv_cache_events\" not in inspect.signature(KVCacheManager)."
                  "parameters", "this vLLM's manager emits no KV cache events"),
    "checkpoints": ("\"num_prefill_checkpoint_blocks\" not in MambaSpec.__dataclass_fields__",
                    "this vLLM's Mamba spec has no prefill checkpoint blocks"),
    "report_mode": ("not hasattr(BlockPool, \"emit_cached_block_events\")",
                    "this vLLM has no kv_cache_report_mode \"full\""),
    "partial_hits": ("not hasattr(kv_cache_coordinator, \"partial_hash_hits_enabled\")",
                     "this vLLM has no partial (sub-block) prefix hits"),
    "external": ("\"num_external_computed_tokens\" not in inspect.signature("
                 "KVCacheManager.allocate_slots).parameters",
                 "this vLLM's allocate_slots takes no external (KV connector) tokens"),
}
"""What a test needs of vLLM's API, and how it skips (with the reason) on a vLLM without it."""


def render_vllm_test(trace: Trace, source: Path) -> str:
    """The text of the vLLM regression test for `trace`, read from `source` (a scheduler-level
    trace: `fuzz/vllm_scheduler_test_export.py`)."""
    if trace.level == "scheduler":
        from kvfuzz.fuzz.vllm_scheduler_test_export import render_scheduler_test

        return render_scheduler_test(trace, source)
    config = trace.config
    for group in config.groups:
        spec(group)
    writer = _Writer(trace)
    writer.play()
    needs = set(writer.needs)
    if config.kv_events:
        needs.add("kv_events")
    if any(g.num_prefill_checkpoint_blocks for g in config.groups):
        needs.add("checkpoints")
    if any(op.get("num_external_computed_tokens") for op in trace.ops):
        needs.add("external")
    if config.partial_hits:
        needs.add("partial_hits")
    sampling_extra = ""
    if config.kv_cache_report_mode != "incremental":
        needs.add("report_mode")
        sampling_extra = (f", extra_args={{\"kv_cache_report_mode\": "
                          f"{config.kv_cache_report_mode!r}}}")
    manager_extra = "\n        enable_kv_cache_events=True," if config.kv_events else ""
    heading, finding = title(trace, source)
    prop = _PROPERTY.get(writer.check, "It asserts what docs/spec.md expects at each call.")
    text = docstring(heading, finding, source.as_posix(), prop) + _HEADER.format(
        sha256_import=SHA256_IMPORT, specs=spec_imports(config),
        hash_block_size=config.resolved_hash_block_size, num_blocks=config.num_blocks,
        config_extra=retention_arg(config), groups=group_specs(config),
        max_model_len=config.max_model_len,
        scheduler_block_size=config.scheduler_block_size,
        max_in_flight_tokens=config.max_in_flight_tokens, enable_caching=config.enable_caching,
        use_eagle=config.use_eagle, watermark=config.watermark, manager_extra=manager_extra,
        sampling_extra=sampling_extra)
    if needs:
        text = text.replace("import pytest\n", "import inspect\n\nimport pytest\n", 1)
    if "report_mode" in needs:
        text = text.replace("from vllm.v1.core.kv_cache_manager", "from vllm.v1.core.block_pool "
                            "import BlockPool\nfrom vllm.v1.core.kv_cache_manager", 1)
    if config.partial_hits:
        text = text.replace("from vllm.v1.core.kv_cache_manager", "from vllm.v1.core import "
                            "kv_cache_coordinator\nfrom vllm.v1.core.kv_cache_manager", 1)
    if writer.check == "EV4":
        text = text.replace("get_request_block_hasher, init_none_hash", "(\n    "
                            "get_block_hash,\n    get_group_id,\n    get_request_block_hasher,"
                            "\n    init_none_hash,\n    maybe_convert_block_hash,\n)", 1)
    body: list[str] = []
    if needs:
        body += [f"@pytest.mark.skipif({_GUARDS[n][0]}, reason={_GUARDS[n][1]!r})"
                 for n in sorted(needs)]
    body.append(f"def {function_name(finding)}({'monkeypatch' if config.partial_hits else ''}):")
    if config.partial_hits:
        body += _FORCED_PARTIAL_HITS
    body.append("    manager = make_manager()")
    if writer.check == "P1":
        body += ["    counted = []  # what the admission check counts, call by call",
                 "    count = manager.coordinator.get_num_blocks_to_allocate",
                 "    manager.coordinator.get_num_blocks_to_allocate = (",
                 "        lambda *args, **kwargs: counted.append(count(*args, **kwargs)) "
                 "or counted[-1])"]
    body += writer.lines
    return text + "\n\n" + "\n".join(body) + "\n"


_FORCED_PARTIAL_HITS = [
    "    # Partial (sub-block) prefix hits: vLLM turns them on only beside a Mamba \"align\" group",
    "    # (kv_cache_utils.partial_hash_hits_enabled); the trace's groups are attention alone,",
    "    # so the coordinator is told they are on.",
    "    monkeypatch.setattr(kv_cache_coordinator, \"partial_hash_hits_enabled\",",
    "                        lambda *args, **kwargs: True)"]
"""What a test of a config with `partial_hits` does before it builds the manager."""

_PROPERTY = {
    "DIFF-result": "It asserts that the call the spec refuses raises ValueError and that every "
                   "other call succeeds or is refused as the spec says.",
    "I16": "It asserts that a request whose allocation is refused keeps no block table.",
    "I15": "It asserts that cache_blocks refuses to record more than the request holds.",
    "I1": "It asserts that the null block's ref_cnt stays 0.",
    "I12": "It asserts that a lookup leaves at least one token to compute.",
    "P1": "It asserts that allocate_slots takes exactly the blocks its admission check counts.",
    "P5": "It asserts that get_num_cached_tokens agrees with get_computed_blocks.",
    "H1": "It asserts that blocks holding different model inputs get different keys.",
    "EV2": "It asserts that BlockRemoved is announced only when no block holds the key any more.",
    "EV4": "It asserts that the KV events of the last call announce as stored only keys that "
           "a block holds after it.",
    "DIFF-state": "It asserts which blocks carry a cache key after the calls.",
    "EV3": "It asserts that each BlockStored carries block_size token ids per block hash it "
           "names, no more and no fewer.",
    "": "It builds the manager and plays the calls; each must do what the spec says (a trace "
        "without a check records a manager vLLM cannot build).",
}


def export_vllm_test(trace: Trace, out: Path, source: Path) -> Path:
    """Write the vLLM regression test for `trace` (read from `source`) to `out`."""
    text = render_vllm_test(trace, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    return out
