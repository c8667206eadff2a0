"""Exporting a scheduler-level trace as a plain vLLM regression test of vLLM's own Scheduler.

`render_scheduler_test` writes a pytest module that imports only `vllm`, `torch` and `pytest`,
builds vLLM's `Scheduler` as vLLM's tests/v1/core/utils.py `create_scheduler` does (written out,
with the model described by a local config.json: no weights, no tokenizer, no network), and
plays the trace: `add_request`, then per `step` one `schedule()`, the forward pass and one
`update_from_output()`, `finish_requests` for `abort` / `finish`. What it asserts follows the
trace's check:

- `D1` (data): the test keeps the KV each forward pass writes into the full-attention blocks
  (a tensor holding, per slot, which prefix wrote it; the step's block copies applied first, as
  vLLM's worker applies them) and asserts that every position a scheduled request reads holds
  the KV of its own prefix;
- `DIFF-state`: after the last op, which blocks carry a cache key (the reference model's
  answer, replayed at export time).

The test runs on vLLM's own scheduler, so a finding whose bug lives in the scheduler (or in the
worker's copies) fails on every release that has it and passes where it is fixed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvfuzz.core.trace import Trace, normalize_op
from kvfuzz.fuzz.vllm_test_export import (
    SPEC_CLASSES,
    VllmTestUnsupported,
    _finding_doc,
    _ident,
    _spec,
    _title,
)
from kvfuzz.harness.executor import Counterexample, Execution

CHECKS = {
    "D1": "It keeps the KV each step writes into the full-attention blocks (after the step's "
          "block copies, applied as vLLM's worker applies them) and asserts that every position "
          "a scheduled request reads holds the KV of its own prefix.",
    "DIFF-state": "It asserts which blocks carry a cache key after the steps.",
}
"""The checks a scheduler-level vLLM test asserts, and what it asserts for each."""

_RESERVED = {"scheduler", "kv", "contents", "model_dir", "keyed", "step", "add", "pytest",
             "torch", "json", "inspect", "sha256", "tmp_path", "monkeypatch"}
"""Names a generated test uses itself, which a request id must not take."""

TINY_MODEL = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 8,
              "num_attention_heads": 1, "num_hidden_layers": 1, "ffn_dim": 8,
              "word_embed_proj_dim": 8, "do_layer_norm_before": True}
"""The config.json of the model a test's ModelConfig reads: an OPT shape (the scheduler reads
only its length limits and kind), vocabulary and positions filled in per trace."""


def _refuse_config(trace: Trace) -> None:
    """Raise VllmTestUnsupported where vLLM's Scheduler cannot be set up for the config from its
    settings alone, or the test could not say what it asserts."""
    from kvfuzz.harness.vllm_scheduler_target import unsupported_reason

    config = trace.config
    reason = unsupported_reason(config)
    if reason is not None:
        raise VllmTestUnsupported(f"vLLM's Scheduler is not set up with {reason}")
    if config.num_hash_lookahead_tokens or config.num_prefill_lookahead:
        raise VllmTestUnsupported("MTP lookahead: a generated test's Scheduler would take it "
                                  "from a drafter's SpeculativeConfig, which needs the model")
    if config.kv_connector:  # target vllm-scheduler plays it with kvfuzz's own connector
        raise VllmTestUnsupported("a generated test's Scheduler is not set up with a KV "
                                  "connector (kvfuzz's connector is not written into tests)")
    if config.partial_hits:
        raise VllmTestUnsupported("config option partial_hits forces vLLM internals; not exported")
    for group in config.groups:
        if group.kind in ("sliding_window", "chunked_local") and (
                (config.max_in_flight_tokens or config.max_model_len)
                != config.scheduler.token_budget):
            raise VllmTestUnsupported(
                "a windowed group with max_in_flight_tokens other than the token budget "
                "(vLLM's Scheduler derives it from the budget)")
        if group.kind not in SPEC_CLASSES:
            raise VllmTestUnsupported(f"group kind {group.kind!r}: a vLLM test builds "
                                      f"{', '.join(SPEC_CLASSES)} groups")
    check = str(trace.meta.get("check") or "")
    if check not in CHECKS:
        raise VllmTestUnsupported(
            f"check {check or '(none)'!r}: a scheduler-level vLLM test asserts "
            f"{' or '.join(CHECKS)}")
    if check == "D1" and not any(g.kind == "full" for g in config.groups):
        raise VllmTestUnsupported("check D1 on a config without a full-attention group (the "
                                  "test reads positions through full-attention blocks)")


class _SchedulerWriter:
    """Builds the test body from the trace, replayed on the reference model at export time."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.names: dict[str, str] = {}
        self.lines: list[str] = []
        self.finishes = False

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def play(self) -> Any:
        """The ops as calls; returns the model's snapshot after the last op."""
        execution = Execution(self.trace.config, "scheduler", [], model=True)
        for step, raw in enumerate(self.trace.ops):
            op = normalize_op(raw, "scheduler", f"step {step}")
            kind = op["op"]
            try:
                execution.apply(raw)
            except Counterexample as exc:
                raise VllmTestUnsupported(
                    f"the trace fails on the reference model, so no outcome can be expected "
                    f"of vLLM: {exc.finding.headline()}") from None
            if kind == "add_request":
                self._add_request(op, step)
            elif kind == "step":
                if op["in_flight"]:
                    raise VllmTestUnsupported(f"step {step}: a step left in flight is not "
                                              "exported")
                sample = f", sample={op['sample']}" if op["sample"] else ""
                self.emit(f"step(scheduler{sample})")
            elif kind in ("abort", "finish"):
                status = "FINISHED_ABORTED" if kind == "abort" else "FINISHED_STOPPED"
                self.finishes = True
                self.emit(f"scheduler.finish_requests({op['request_id']!r}, "
                          f"RequestStatus.{status})")
            else:
                raise VllmTestUnsupported(
                    f"step {step}: op {kind!r}; a scheduler-level vLLM test plays add_request, "
                    "step, abort and finish")
        return execution.state

    def _add_request(self, op: dict[str, Any], step: int) -> None:
        for field in ("lora_name", "mm_inputs", "prompt_embeds", "skip_reading_prefix_cache",
                      "prefix_cache_hit_limit", "num_encoder_tokens"):
            if op[field]:
                raise VllmTestUnsupported(f"step {step}: add_request with {field} is not exported")
        rid = op["request_id"]
        name = _ident(rid, set(self.names.values()) | _RESERVED)
        self.names[rid] = name
        args = [repr(rid), repr(list(op["prompt"])), f"arrival_time={len(self.names) - 1}"]
        if op["max_tokens"] != 1:
            args.append(f"max_tokens={op['max_tokens']}")
        if op["priority"]:
            args.append(f"priority={op['priority']}")
        if op["cache_salt"] is not None:
            args.append(f"cache_salt={op['cache_salt']!r}")
        self.emit(f"scheduler.add_request(make_request({', '.join(args)}))")


_HEADER = '''"""{title}

kvfuzz finding {finding}, exported by `kvfuzz export {source} --vllm-test`.
It drives vLLM's own Scheduler as an engine does: add_request, then per step schedule(), the
forward pass and update_from_output() with one sampled token per request that needs one.
{property}
It needs only vllm, torch and pytest (and the standard library), and fails while the bug is present.
"""

import inspect
import json

import torch

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched import scheduler as scheduler_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import {specs}
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

try:
    from vllm.utils.hashing import sha256
except ImportError:  # older releases
    from vllm.utils import sha256

DTYPE = torch.float16
BLOCK_SIZE = {block_size}
HASH_BLOCK_SIZE = {hash_block_size}
NUM_BLOCKS = {num_blocks}
MAX_MODEL_LEN = {max_model_len}
VOCAB_SIZE = {vocab_size}
MODEL = {model}
"""A model's config.json (OPT's shape): the Scheduler reads only its kind and lengths."""


def create_scheduler(model_dir, monkeypatch) -> Scheduler:
    """vLLM's Scheduler as tests/v1/core/utils.py create_scheduler builds it, on the CPU, for
    a model described by a local config.json (no weights, no tokenizer, no network)."""
    (model_dir / "config.json").write_text(json.dumps(MODEL))
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16",
                               max_model_len=MAX_MODEL_LEN, seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs={max_num_seqs},
        max_num_batched_tokens={token_budget},
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy={policy!r},
        watermark={watermark},
        scheduler_reserve_full_isl={full_isl},
    ){chunked_prefill}
    cache_config = CacheConfig(block_size=BLOCK_SIZE,
                               enable_prefix_caching={enable_caching}{cache_extra})
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, device_config=DeviceConfig(device="cpu"))
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],{config_extra}
        kv_cache_groups=[
{groups}
        ],
    ){eagle}
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=HASH_BLOCK_SIZE,
        log_stats=False,
    ){after}
    return scheduler


def make_request(request_id: str, prompt: list[int], arrival_time: float,
                 max_tokens: int = 1, **kwargs) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
        arrival_time=arrival_time, block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
        **kwargs,
    )


def model_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """The forward pass's output; releases before 0.34 also take each request's index."""
    extra = {{}}
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
        extra["req_id_to_index"] = {{r: i for i, r in enumerate(req_ids)}}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)
'''

_DATA_HELPERS = '''

FULL_ATTENTION_GROUPS = {full_groups}
"""(group index, block size) of each full-attention group: the positions a request reads."""


def apply_copies(kv: torch.Tensor, copies) -> None:
    """The step's block copies as vLLM's worker applies them before the forward pass
    (`copy_kv_cache_blocks_inplace`, vllm/v1/worker/utils.py): `blocks[dst] = blocks[src]`,
    every source gathered before any destination is written."""
    if copies:
        src, dst = torch.tensor([list(c) for c in copies]).unbind(dim=1)
        kv[dst] = kv[src]


class ForwardPass:
    """The KV the forward passes write: per block slot, the prefix (cache salt, tokens up to
    and including that position) whose KV it holds; 0 means never written."""

    def __init__(self) -> None:
        self.kv = torch.zeros((NUM_BLOCKS, BLOCK_SIZE), dtype=torch.long)
        self.contents: list = [None]

    def prefix(self, request: Request, position: int) -> int:
        key = (request.cache_salt, tuple(request.all_token_ids[:position + 1]))
        if key not in self.contents:
            self.contents.append(key)
        return self.contents.index(key)

    def run(self, scheduler: Scheduler, output) -> None:
        apply_copies(self.kv, output.kv_cache_block_copies or [])
        for req_id, n in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            start = request.num_computed_tokens - n  # schedule() has already advanced it
            tables = scheduler.kv_cache_manager.get_block_ids(req_id)
            for group, size in FULL_ATTENTION_GROUPS:
                table = tables[group]
                for position in range(start):
                    block, slot = table[position // size], position % size
                    held = self.contents[int(self.kv[block, slot])]
                    assert held == self.contents[self.prefix(request, position)], (
                        f"{{req_id}} reads position {{position}} of group {{group}} through block "
                        f"{{block}}, which holds "
                        f"{{'KV never written' if held is None else f'the KV of {{held}}'}}, "
                        f"not the KV of its own prefix")
                for position in range(start, start + n):
                    block, slot = table[position // size], position % size
                    self.kv[block, slot] = self.prefix(request, position)
'''

_STEP = '''

def step(scheduler: Scheduler{forward_arg}, sample: int = 0) -> None:
    """One engine step: schedule(), the forward pass, update_from_output(); a request that has
    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE."""
    output = scheduler.schedule(){forward}
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([(sample + request.num_tokens) % VOCAB_SIZE] if done else [])
    scheduler.update_from_output(output, model_output(req_ids, sampled))
'''


def render_scheduler_test(trace: Trace, source: Path) -> str:
    """The text of the vLLM regression test for scheduler-level `trace`, read from `source`."""
    _refuse_config(trace)
    config = trace.config
    check = str(trace.meta["check"])
    writer = _SchedulerWriter(trace)
    state = writer.play()
    s = config.scheduler
    align = any(g.mamba_cache_mode == "align" for g in config.groups)
    specs = sorted({SPEC_CLASSES[g.kind] for g in config.groups})
    groups = "\n".join(f"            KVCacheGroupSpec([\"layer.{i}\"], {_spec(g)}),"
                       for i, g in enumerate(config.groups))
    after = ""
    if s.num_lookahead_tokens:
        after += ("\n    # The KV slots a drafter reserves past the scheduled tokens (vLLM sets "
                  "them\n    # from a draft model's SpeculativeConfig).\n"
                  f"    scheduler.num_lookahead_tokens = {s.num_lookahead_tokens}")
    eagle = ""
    if config.use_eagle:
        eagle = ("\n    # EAGLE: vLLM builds the manager with use_eagle from an EAGLE drafter's "
                 "SpeculativeConfig,\n    # which needs the drafter's weights; here the manager "
                 "class is given use_eagle=True.\n"
                 "    manager_cls = scheduler_module.KVCacheManager\n"
                 "    monkeypatch.setattr(scheduler_module, \"KVCacheManager\", "
                 "lambda *args, **kwargs: manager_cls(\n"
                 "        *args, **{**kwargs, \"use_eagle\": True}))")
        after += "\n    scheduler.use_eagle_block_drop = True  # the Mamba chunk split drops it too"
    model = dict(TINY_MODEL, vocab_size=s.vocab_size, max_position_embeddings=config.max_model_len)
    title, finding = _title(trace, _finding_doc(trace, source))
    text = _HEADER.format(
        title=title, finding=finding,
        source=source.as_posix(), property=CHECKS[check],
        specs=", ".join(["KVCacheConfig", "KVCacheGroupSpec", *specs]),
        block_size=config.scheduler_block_size, hash_block_size=config.resolved_hash_block_size,
        num_blocks=config.num_blocks, max_model_len=config.max_model_len,
        vocab_size=s.vocab_size, model=repr(model), max_num_seqs=s.max_running,
        token_budget=s.token_budget, policy=s.policy, watermark=config.watermark,
        full_isl=s.full_sequence_must_fit,
        chunked_prefill=("" if s.chunked_prefill else
                         "\n    scheduler_config.enable_chunked_prefill = False"),
        enable_caching=config.enable_caching,
        cache_extra=", mamba_cache_mode=\"align\"" if align else "",
        config_extra=("" if config.prefix_cache_retention_interval is None else
                      f"\n        prefix_cache_retention_interval="
                      f"{config.prefix_cache_retention_interval},"),
        groups=groups, eagle=eagle, after=after)
    if check == "D1":
        full = [(i, g.block_size) for i, g in enumerate(config.groups) if g.kind == "full"]
        text += _DATA_HELPERS.format(full_groups=full)
        text += _STEP.format(forward_arg=", forward: ForwardPass",
                             forward="\n    forward.run(scheduler, output)")
    else:
        text += _STEP.format(forward_arg="", forward="")
    if not config.use_eagle:
        text = text.replace("from vllm.v1.core.sched import scheduler as scheduler_module\n", "")
        text = text.replace("def create_scheduler(model_dir, monkeypatch)",
                            "def create_scheduler(model_dir)")
    if not writer.finishes:
        text = text.replace("import Request, RequestStatus", "import Request")
    test_name = "test_" + re.sub(r"\W", "_", finding if finding != "(no finding doc)"
                                 else "exported_trace").lower().lstrip("0123456789_")
    fixtures = "tmp_path, monkeypatch" if config.use_eagle else "tmp_path"
    body = [f"def {test_name}({fixtures}):", f"    scheduler = create_scheduler({fixtures})"]
    if check == "D1":
        body.append("    forward = ForwardPass()")
        writer.lines = [line.replace("step(scheduler", "step(scheduler, forward")
                        for line in writer.lines]
    body += writer.lines
    if check == "DIFF-state":
        keyed = [i for i, key in enumerate(state.block_keys) if key is not None]
        body += ["    keyed = [block.block_id",
                 "             for block in scheduler.kv_cache_manager.block_pool.blocks",
                 "             if block.block_hash is not None]",
                 f"    assert keyed == {keyed!r}, (",
                 f"        f\"blocks {{keyed}} carry a cache key, but blocks {keyed} hold what "
                 "their keys name: a later request with the same prefix misses or is served "
                 "the wrong blocks\")"]
    return text + "\n\n" + "\n".join(body) + "\n"

