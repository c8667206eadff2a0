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
  answer, replayed at export time); where the finding's difference is in the requests
  (its `dedup_key` ends in `/requests`), each request's `num_computed_tokens` instead;
- `P1`, where the prediction is below 0 (its message says so): every count of new blocks a KV
  cache group's manager returns (`get_num_blocks_to_allocate`) is at least 0.
- `I10` (a step raised): that no step raises, each being one the reference model takes;
- `DIFF-result`, where the difference is in what a step schedules: each step's tokens per
  request; where it is in the requests a step finishes: each step's finished requests (those
  that left the Scheduler).

A trace with a KV connector (`load_remote`, `finish_load`; check `D1`) gets a small connector
class written into the test on vLLM's `KVConnectorBase_V1`, set up through `KVTransferConfig`
(policy "recompute") as a user sets up an external connector: it offers the request the
trace's external tokens as an asynchronous load, and the test reports the load's end as a
worker does (`finished_recving`; a short load names the blocks it did not fill,
`invalid_block_ids`), writing the KV the load landed into the blocks that hold it. A window
group's reads are the window behind each position. A synchronous load (`load_remote {sync:
true}`; check `DIFF-state`, one group) is offered at the request's lookups until a step admits
it, and that step's output reports the blocks it failed to fill, under the trace's
`kv_load_failure_policy`; on several groups (check `DIFF-result` in the finished requests) it
reports the request instead (`failed_recving`: vLLM's block ids are unique only per group).

A scheduler rule the test's Scheduler cannot be given (it runs the release's own) is refused:
`scheduler.async_scheduling`, `in_flight_sampling` "wait" beside steps in flight, a
`self_preemption` or `blocked_waiting` other than 0.33+'s, a `settled_blocks` other than
0.34's.

A step with spec-decode drafts (`step {draft, accept}`) is played as the `vllm-scheduler`
target plays it: the requests that sample return the first `accept` of the drafts vLLM
scheduled for them (`scheduled_spec_decode_tokens`) and one sampled token, and then every
request of the batch is handed `draft` proposals (`update_draft_token_ids`), a request the
step's `drafted` names only the first `drafted[request]` of them.

The test runs on vLLM's own scheduler, so a finding whose bug lives in the scheduler (or in the
worker's copies) fails on every release that has it and passes where it is fixed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvfuzz.core.trace import Trace, normalize_op
from kvfuzz.fuzz.vllm_encoder_decoder_test_text import (
    cross_group_specs,
    cross_spec_imports,
    with_encoder_decoder,
)
from kvfuzz.fuzz.vllm_test_text import (
    SHA256_IMPORT,
    SPEC_CLASSES,
    VllmTestUnsupported,
    docstring,
    function_name,
    group_specs,
    ident,
    retention_arg,
    spec_imports,
    title,
)
from kvfuzz.harness.executor import Counterexample, Execution

CHECKS = {
    "D1": "It keeps the KV each step writes into the full-attention blocks (after the step's "
          "block copies, applied as vLLM's worker applies them) and asserts that every position "
          "a scheduled request reads holds the KV of its own prefix.",
    "DIFF-state": "It asserts which blocks carry a cache key after the steps.",
    "DIFF-result": "It asserts what each step schedules (tokens per request), as the reference "
                   "model schedules it.",
    "P1": "It records every count of new blocks a KV cache group's manager returns "
          "(get_num_blocks_to_allocate) and asserts that none is below 0.",
    "I10": "It asserts that no step raises: each is a valid step the reference model takes.",
}
"""The checks a scheduler-level vLLM test asserts, and what it asserts for each."""

_DRIVES = ("It drives vLLM's own Scheduler as an engine does: add_request, then per step "
           "schedule(), the",
           "forward pass and update_from_output() with one sampled token per request that "
           "needs one.")
"""The lines of every scheduler-level test's docstring that say how it plays the trace."""

_REQUESTS_PROPERTY = ("It asserts each request's num_computed_tokens after the steps: every "
                      "token whose KV the steps computed, no more.")
"""What a DIFF-state test whose difference is in the requests asserts."""

_FINISHED_PROPERTY = ("It asserts which requests each step finishes (those that leave the "
                      "Scheduler), as the reference model finishes them.")
"""What a DIFF-result test whose difference is in the finished requests asserts."""

_FREE_QUEUE_PROPERTY = ("It asserts the order of the free queue after the steps: the order in "
                        "which the freed blocks reached it, which is the order they are evicted.")
"""What a DIFF-state test whose difference is in the free queue asserts."""

_RESERVED = {"scheduler", "kv", "contents", "model_dir", "keyed", "step", "add", "pytest",
             "torch", "json", "inspect", "sha256", "tmp_path", "monkeypatch", "in_flight",
             "complete"}
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
    check = str(trace.meta.get("check") or "")
    _refuse_scheduler_rules(trace)
    loads = any(op.get("op") == "finish_load" or op.get("op") == "load_remote"
                and not op.get("sync") for op in trace.ops)
    if config.kv_connector and loads and (check != "D1" or len(config.groups) != 1):
        raise VllmTestUnsupported("a trace with KV loads is exported with check D1 on one KV "
                                  "cache group (a short load names its blocks there)")
    if _sync_loads(trace) and not (check == "DIFF-state" and len(config.groups) == 1
                                   or _diff_in_finished(trace) and len(config.groups) > 1):
        raise VllmTestUnsupported("a trace with synchronous KV loads is exported with check "
                                  "DIFF-state on one KV cache group (a failing one names its "
                                  "blocks there) or DIFF-result in the finished requests on "
                                  "several (a failing one names its request there)")
    if _sync_loads(trace) and _in_flight(trace):
        raise VllmTestUnsupported("synchronous KV loads beside steps in flight are not exported "
                                  "(a step's report of its failed loads is taken at once)")
    if check == "P1" and not _NEGATIVE_COUNT.search(str(trace.meta.get("message") or "")):
        raise VllmTestUnsupported("check P1: a scheduler-level vLLM test asserts it only where "
                                  "the prediction is below 0 (its message names a negative "
                                  "count)")
    in_flight = _in_flight(trace)
    if in_flight and (check != "DIFF-state" or not config.kv_connector):
        raise VllmTestUnsupported("a trace with steps in flight is exported with check "
                                  "DIFF-state and a KV connector (vLLM defers frees behind "
                                  "them only for a consumer connector)")
    batches = 2 if in_flight else 1
    if config.partial_hits:
        raise VllmTestUnsupported("config option partial_hits forces vLLM internals; not exported")
    for group in config.groups:
        if group.kind in ("sliding_window", "chunked_local") and (
                (config.max_in_flight_tokens or config.max_model_len)
                != batches * config.scheduler.token_budget):
            raise VllmTestUnsupported(
                f"a windowed group with max_in_flight_tokens other than "
                f"{'twice ' if batches == 2 else ''}the token budget (vLLM's Scheduler derives "
                "it from the budget and the batches in flight: two with async scheduling)")
        if group.kind == "cross" and check != "DIFF-result":
            raise VllmTestUnsupported("a cross-attention group is exported with check "
                                      "DIFF-result (what each step schedules)")
        if group.kind not in SPEC_CLASSES and group.kind != "cross":
            raise VllmTestUnsupported(f"group kind {group.kind!r}: a vLLM test builds "
                                      f"{', '.join(SPEC_CLASSES)} groups")
    if check == "DIFF-result" and not (_diff_in_scheduled(trace) or _diff_in_finished(trace)):
        raise VllmTestUnsupported("check DIFF-result: a scheduler-level vLLM test asserts it "
                                  "only where the difference is in what a step schedules or "
                                  "which requests it finishes")
    if _diff_in_finished(trace) and any(op.get("op") == "step" and (
            op.get("draft") or op.get("accept") is not None) for op in trace.ops):
        raise VllmTestUnsupported("check DIFF-result in the finished requests beside drafts "
                                  "is not exported")
    if check == "DIFF-result" and in_flight:
        raise VllmTestUnsupported("check DIFF-result beside steps in flight is not exported")
    if check not in CHECKS:
        raise VllmTestUnsupported(
            f"check {check or '(none)'!r}: a scheduler-level vLLM test asserts "
            f"{' or '.join(CHECKS)}")
    if check == "D1" and not any(g.kind in _READ_KINDS for g in config.groups):
        raise VllmTestUnsupported("check D1 on a config without a full or sliding-window "
                                  "attention group (the test reads positions through their "
                                  "blocks)")


_NEGATIVE_COUNT = re.compile(r"predicted -\d+ blocks")
"""A P1 message whose prediction is below 0: what a P1 test asserts against."""


def _refuse_scheduler_rules(trace: Trace) -> None:
    """Raise VllmTestUnsupported where the trace names a scheduler rule a generated test does
    not set: the test's Scheduler follows the release's own rule, so it would assert the
    model's outcome under another."""
    s = trace.config.scheduler
    if s.async_scheduling:
        raise VllmTestUnsupported("scheduler.async_scheduling true (the encoder release and "
                                  "output publishing rules of vLLM's AsyncScheduler) is not "
                                  "exported")
    if _in_flight(trace) and s.in_flight_sampling != "placeholders":
        raise VllmTestUnsupported(f"scheduler.in_flight_sampling {s.in_flight_sampling!r} "
                                  "beside steps in flight (a test's AsyncScheduler counts "
                                  "output placeholders) is not exported")
    for name, default, since in (("self_preemption", "continue", "0.33"),
                                 ("blocked_waiting", "skip", "0.33"),
                                 ("settled_blocks", "at_output", "0.34")):
        if getattr(s, name) != default:
            raise VllmTestUnsupported(f"scheduler.{name} {getattr(s, name)!r} is not exported "
                                      f"(a test runs the release's own rule; {since}+: "
                                      f"{default!r})")


def _sync_loads(trace: Trace) -> bool:
    """Whether the trace offers synchronous KV loads (`load_remote {sync: true}`): its test's
    connector offers them and its steps report what they failed to fill."""
    return any(op.get("op") == "load_remote" and op.get("sync") for op in trace.ops)


def _in_flight(trace: Trace) -> bool:
    """Whether the trace leaves steps in flight (`step {in_flight: true}`, `complete_step`):
    its test drives vLLM's AsyncScheduler."""
    return any(op.get("op") == "complete_step" or op.get("in_flight") for op in trace.ops)


def _diff_in_scheduled(trace: Trace) -> bool:
    """Whether a DIFF-result finding's difference is in what a step scheduled (`dedup_key`)."""
    key = str(trace.meta.get("dedup_key") or "")
    return trace.meta.get("check") == "DIFF-result" and key.endswith("/scheduled")


def _diff_in_finished(trace: Trace) -> bool:
    """Whether a DIFF-result finding's difference is in which requests a step finished."""
    key = str(trace.meta.get("dedup_key") or "")
    return trace.meta.get("check") == "DIFF-result" and key.endswith("/finished")


def _diff_in_free_queue(trace: Trace) -> bool:
    """Whether a DIFF-state finding's difference is in the free queue (its `dedup_key`)."""
    key = str(trace.meta.get("dedup_key") or "")
    return trace.meta.get("check") == "DIFF-state" and key.endswith("/free_queue")


_READ_KINDS = ("full", "sliding_window")
"""The groups through which a D1 test reads positions: all of them before a position (full),
the window behind it (sliding window); other groups are not read."""


class _SchedulerWriter:
    """Builds the test body from the trace, replayed on the reference model at export time."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.names: dict[str, str] = {}
        self.lines: list[str] = []
        self.finishes = False
        self.drafts = False
        self.drafted = False
        self.held = 0
        self.keep_requests = _diff_in_requests(trace)
        self.assert_scheduled = _diff_in_scheduled(trace)
        self.assert_finished = _diff_in_finished(trace)

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def play(self) -> Any:
        """The ops as calls; returns the model's snapshot after the last op."""
        execution = Execution(self.trace.config, "scheduler", [], model=True)
        for step, raw in enumerate(self.trace.ops):
            op = normalize_op(raw, "scheduler", f"step {step}")
            kind = op["op"]
            try:
                result = execution.apply(raw)
            except Counterexample as exc:
                raise VllmTestUnsupported(
                    f"the trace fails on the reference model, so no outcome can be expected "
                    f"of vLLM: {exc.finding.headline()}") from None
            if kind == "add_request":
                self._add_request(op, step)
            elif kind == "step":
                args = [f"sample={op['sample']}"] if op["sample"] else []
                if op["drafted"] is not None and not op["draft"]:
                    raise VllmTestUnsupported(f"step {step}: a drafter's count per request "
                                              "(drafted) is exported with the step's draft")
                if op["in_flight"] and (op["draft"] or op["accept"] is not None):
                    raise VllmTestUnsupported(f"step {step}: a step in flight with drafts is "
                                              "not exported")
                if op["in_flight"]:
                    self.held += 1
                    args.append("in_flight=in_flight")
                for _ in range(0 if op["in_flight"] else self.held):
                    self.emit("complete(scheduler, in_flight)")
                self.held = self.held if op["in_flight"] else 0
                if op["draft"] or op["accept"] is not None:
                    self.drafts = True
                    args += [f"draft={op['draft']}"] if op["draft"] else []
                    if op["drafted"] is not None:
                        self.drafted = True
                        args.append(f"drafted={dict(op['drafted'])!r}")
                    args += [] if op["accept"] is None else [f"accept={op['accept']}"]
                call = f"step({', '.join(['scheduler', *args])})"
                if self.assert_scheduled:
                    self._assert_scheduled(call, step, result)
                elif self.assert_finished:
                    self._assert_finished(call, step, result)
                else:
                    self.emit(call)
            elif kind == "complete_step":
                self.held -= 1
                self.emit("complete(scheduler, in_flight)")
            elif kind in ("load_remote", "finish_load"):
                self._load(op, step, execution, result)
            elif kind in ("abort", "finish"):
                status = "FINISHED_ABORTED" if kind == "abort" else "FINISHED_STOPPED"
                self.finishes = True
                self.emit(f"scheduler.finish_requests({op['request_id']!r}, "
                          f"RequestStatus.{status})")
            elif kind == "reset_prefix_cache":
                self.emit(f"assert scheduler.reset_prefix_cache(reset_running_requests="
                          f"{op['reset_running_requests']}) is {result}")
            else:
                raise VllmTestUnsupported(
                    f"step {step}: op {kind!r}; a scheduler-level vLLM test plays add_request, "
                    "step, complete_step, abort, finish, reset_prefix_cache, load_remote and "
                    "finish_load")
        return execution.state

    def _assert_scheduled(self, call: str, step: int, result: Any) -> None:
        """The step, asserting it schedules what the reference model scheduled (tokens per
        request)."""
        want = {rid: n for rid, n, _ in _scheduled(result)}
        shown = repr(want).replace("{", "{{").replace("}", "}}")
        self.emit(f"scheduled = {call}")
        self.emit(f"assert scheduled == {want!r}, (")
        self.emit(f"    f\"trace op {step + 1} scheduled {{scheduled}}; the reference model "
                  f"schedules {shown}\")")

    def _assert_finished(self, call: str, step: int, result: Any) -> None:
        """The step, asserting it finishes the requests the reference model finished."""
        want = sorted(result["finished"] if isinstance(result, dict) else result.finished)
        self.emit(f"finished = {call}")
        self.emit(f"assert finished == {want!r}, (")
        self.emit(f"    f\"trace op {step + 1} finished {{finished}}; the reference model "
                  f"finishes {want}\")")

    def _load(self, op: dict[str, Any], step: int, execution: Execution, result: Any) -> None:
        """A KV load's start or end, played with the request alone: vLLM's Scheduler would
        schedule any other request in the same step, which the trace's op does not."""
        rid = op["request_id"]
        if op["op"] == "load_remote" and op["sync"]:
            if result is None:
                raise VllmTestUnsupported(f"step {step}: a synchronous load_remote the model "
                                          "refuses is not exported")
            loaded = op["num_loaded_tokens"]
            self.emit(f"sync_load(scheduler, {rid!r}, {op['num_external_tokens']}"
                      f"{'' if loaded is None else f', {loaded}'})")
            return
        if op["op"] == "load_remote" and result is None:
            raise VllmTestUnsupported(f"step {step}: a load_remote that starts no load is not "
                                      "exported (vLLM's Scheduler would schedule the request)")
        others = [r for r, view in execution.state.requests.items()
                  if r != rid and not view.status.startswith("FINISHED")]
        if others:
            raise VllmTestUnsupported(f"step {step}: {op['op']} beside other unfinished "
                                      f"requests ({', '.join(others)}) is not exported")
        if op["op"] == "load_remote":
            self.emit(f"load_remote(scheduler, {rid!r}, {op['num_external_tokens']})")
            return
        loaded = op["num_loaded_tokens"]
        self.emit(f"finish_load(scheduler, forward, {rid!r}"
                  f"{'' if loaded is None else f', {loaded}'})")

    def _add_request(self, op: dict[str, Any], step: int) -> None:
        for field in ("lora_name", "mm_inputs", "prompt_embeds", "skip_reading_prefix_cache",
                      "prefix_cache_hit_limit", "num_encoder_tokens"):
            if op[field] and not (field == "num_encoder_tokens"
                                  and self.trace.config.has_cross_attention):
                raise VllmTestUnsupported(f"step {step}: add_request with {field} is not exported")
        rid = op["request_id"]
        name = ident(rid, set(self.names.values()) | _RESERVED)
        self.names[rid] = name
        args = [repr(rid), repr(list(op["prompt"])), f"arrival_time={len(self.names) - 1}"]
        if op["max_tokens"] != 1:
            args.append(f"max_tokens={op['max_tokens']}")
        if op["priority"]:
            args.append(f"priority={op['priority']}")
        if op["cache_salt"] is not None:
            args.append(f"cache_salt={op['cache_salt']!r}")
        if op["num_encoder_tokens"]:
            args.append(f"num_encoder_tokens={op['num_encoder_tokens']}")
        if self.keep_requests:
            self.emit(f"{name} = make_request({', '.join(args)})")
            self.emit(f"scheduler.add_request({name})")
        else:
            self.emit(f"scheduler.add_request(make_request({', '.join(args)}))")

    def assert_requests(self, state: Any) -> list[str]:
        """Each request's num_computed_tokens after the steps, as the reference model has it
        (a finished request has left the Scheduler: the test holds it)."""
        lines = []
        for rid, name in self.names.items():
            view = state.requests[rid]
            lines += [f"    assert {name}.num_computed_tokens == {view.num_computed_tokens}, (",
                      f"        f\"{name} ends {view.status} with {{{name}.num_tokens}} tokens, "
                      f"so num_computed_tokens must be {view.num_computed_tokens}, but it says "
                      f"{{{name}.num_computed_tokens}}: it counts tokens the request does not "
                      "have (a request resumed from it skips them)\")"]
        return lines


def _scheduled(result: Any) -> list[Any]:
    """The (request id, tokens, hit) a step's result lists (a model's dict or a StepOutput)."""
    return list(result["scheduled"] if isinstance(result, dict) else result.scheduled)


def _diff_in_requests(trace: Trace) -> bool:
    """Whether a DIFF-state finding's difference is in the requests (its meta `dedup_key`,
    check/op/snapshot field, names `requests`), not in the cache keys."""
    key = str(trace.meta.get("dedup_key") or "")
    return trace.meta.get("check") == "DIFF-state" and key.endswith("/requests")


_HEADER = '''import inspect
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

{sha256_import}
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

{groups_decl}


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
            {groups_loop}
                table = tables[group]
                for position in range({read_from}start):
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

_FULL_GROUPS = ('''FULL_ATTENTION_GROUPS = {groups}
"""(group index, block size) of each full-attention group: the positions a request reads."""''',
                "for group, size in FULL_ATTENTION_GROUPS:", "")
_WINDOW_GROUPS = ('''ATTENTION_GROUPS = {groups}
"""(group index, block size, sliding window or None) of each attention group: a position reads
the window behind it (None: every position before it)."""''',
                  "for group, size, window in ATTENTION_GROUPS:",
                  "max(start - window + 1, 0) if window else 0, ")
"""The D1 helpers' group list, its loop and the first position a chunk starting at `start`
reads: full attention alone, or with window groups."""

_LOAD = '''
    def load(self, scheduler: Scheduler, request: Request, start: int, end: int) -> None:
        """The KV a connector's load writes: positions start..end-1 of the request, into the
        blocks its tables hold for them (a null block is written by no one)."""
        null = scheduler.kv_cache_manager.block_pool.null_block.block_id
        tables = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        for group, size, _ in ATTENTION_GROUPS:
            for position in range(start, end):
                block = tables[group][position // size]
                if block != null:
                    self.kv[block, position % size] = self.prefix(request, position)
'''

_CONNECTOR = '''

class TraceConnector(KVConnectorBase_V1, SupportsHMA):
    """A scheduler-side KV connector on vLLM's base class, in the consumer role: it offers a
    request the external tokens the test names (if any), as an asynchronous load; the test
    reports the load's end as a worker does (finish_load). It supports hybrid models (each
    group's blocks); it never holds a finished request's blocks. Its worker side never runs."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, int] = {}  # request id -> external tokens at its next lookup
        self.loading: dict[str, int] = {}  # request id -> external tokens of its load

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        offered = self.offers.pop(request.request_id, 0)
        n = min(offered, request.num_tokens - num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        if num_external_tokens:
            self.loading[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        raise NotImplementedError("scheduler side only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("scheduler side only")

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        raise NotImplementedError("scheduler side only")

    def wait_for_save(self) -> None:
        raise NotImplementedError("scheduler side only")
'''
"""What a test with a KV connector adds: the connector (a consumer)."""

_LOAD_OPS = '''

def load_remote(scheduler: Scheduler, request_id: str, num_external_tokens: int) -> None:
    """The connector offers the request num_external_tokens; the engine's next schedule()
    looks it up and starts the load, computing nothing."""
    scheduler.connector.offers[request_id] = num_external_tokens
    output = scheduler.schedule()
    assert not output.num_scheduled_tokens, "a load's step computes nothing"
    scheduler.update_from_output(output, model_output([], []))


def finish_load(scheduler: Scheduler, forward: ForwardPass, request_id: str,
                num_loaded_tokens: int | None = None) -> None:
    """The worker reports the request's load done with its first num_loaded_tokens external
    tokens landed (None: all); a short load names the blocks it did not fill
    (invalid_block_ids), never the null block, as a worker reports what it was asked to fill."""
    request = scheduler.requests[request_id]
    external = scheduler.connector.loading.pop(request_id)
    hit = request.num_computed_tokens - external
    loaded = external if num_loaded_tokens is None else num_loaded_tokens
    forward.load(scheduler, request, hit, hit + loaded)
    report = KVConnectorOutput(finished_recving={request_id})
    if loaded < external:
        (blocks,) = scheduler.kv_cache_manager.get_blocks(request_id).blocks
        unfilled = blocks[(hit + loaded) // BLOCK_SIZE:]
        report.invalid_block_ids = {block.block_id for block in unfilled if not block.is_null}
    output = scheduler.schedule()
    assert not output.num_scheduled_tokens, "the load's end computes nothing"
    runner_output = model_output([], [])
    runner_output.kv_connector_output = report
    scheduler.update_from_output(output, runner_output)
'''
"""What a test with KV loads adds: the two load ops."""

_SYNC_LOADS = '''

class SyncLoadConnector(TraceConnector):
    """The connector offering synchronous loads too: a request it names is offered its
    external tokens at every lookup until a step admits it; the worker loads them in that
    step's forward pass (the request counts them computed at once)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.sync_offers: dict[str, int] = {}  # request id -> external tokens offered
        self.sync_valid: dict[str, int] = {}  # request id -> the external tokens that fill
        self.admitted: dict[str, int] = {}  # request id -> external tokens admitted this step

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if request.request_id in self.sync_offers:
            # vLLM computes at least one token of a request it admits: the last is left.
            n = request.num_tokens - 1 - num_computed_tokens
            return max(min(self.sync_offers[request.request_id], n), 0), False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        if self.sync_offers.pop(request.request_id, None) is not None:
            if num_external_tokens:
                self.admitted[request.request_id] = num_external_tokens
        else:
            super().update_state_after_alloc(request, blocks, num_external_tokens)


def sync_load(scheduler: Scheduler, request_id: str, num_external_tokens: int,
              num_loaded_tokens: int | None = None) -> None:
    """The connector offers the request num_external_tokens, loaded synchronously by the step
    that admits it, of which only the first num_loaded_tokens fill their blocks (None: all)."""
    scheduler.connector.sync_offers[request_id] = num_external_tokens
    if num_loaded_tokens is not None:
        scheduler.connector.sync_valid[request_id] = num_loaded_tokens


def load_failures(scheduler: Scheduler, output, runner_output: ModelRunnerOutput):
    """The worker's report of the synchronous loads the step admitted: the blocks of each that
    failed, from the one holding the end of what it filled to the end of the load
    (invalid_block_ids, never the null block); returns runner_output with it."""
    invalid = set()
    admitted, scheduler.connector.admitted = scheduler.connector.admitted, {}
    for request_id, external in admitted.items():
        valid = scheduler.connector.sync_valid.pop(request_id, external)
        request = scheduler.requests[request_id]
        hit = request.num_computed_tokens - output.num_scheduled_tokens[request_id] - external
        (blocks,) = scheduler.kv_cache_manager.get_blocks(request_id).blocks
        end = -(-(hit + external) // BLOCK_SIZE)
        invalid |= {block.block_id for block in blocks[(hit + valid) // BLOCK_SIZE:end]
                   if valid < external and not block.is_null}
    if invalid:
        runner_output.kv_connector_output = KVConnectorOutput(invalid_block_ids=invalid)
    return runner_output
'''
"""What a test with synchronous KV loads adds: the connector offering them, the op, and the
worker's report of the blocks a failing one did not fill."""

_GROUP_FAILURES = '''

def load_failures(scheduler: Scheduler, output, runner_output: ModelRunnerOutput):
    """The worker's report of the synchronous loads the step admitted, on a model with several
    KV cache groups: each that failed to fill its blocks by its request (failed_recving), as
    vLLM's Scheduler asks of a connector there (block ids are unique only within a group);
    returns runner_output with it."""
    admitted, scheduler.connector.admitted = scheduler.connector.admitted, {}
    failed = {request_id for request_id, external in admitted.items()
              if scheduler.connector.sync_valid.pop(request_id, external) < external}
    if failed:
        runner_output.kv_connector_output = KVConnectorOutput(failed_recving=failed)
    return runner_output
'''
"""What a test with synchronous KV loads on several KV cache groups reports instead."""

_COUNTS = '''

def record_counts(scheduler: Scheduler) -> list:
    """Every count of new blocks a KV cache group's manager returns
    (get_num_blocks_to_allocate, summed by the coordinator into what allocate_slots compares
    with the free blocks), as (group, count), in the order returned."""
    counts = []
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for group, manager in enumerate(managers):
        def counted(*args, _count=manager.get_num_blocks_to_allocate, _group=group, **kwargs):
            n = _count(*args, **kwargs)
            counts.append((_group, n))
            return n
        manager.get_num_blocks_to_allocate = counted
    return counts
'''
"""What a P1 test adds: the groups' counts recorded."""

_COMPLETE = '''

def complete(scheduler: Scheduler, in_flight: list) -> None:
    """The oldest step in flight completes: update_from_output() takes its output (sampled
    now), and the Scheduler returns to the free queue the blocks of requests freed while it
    ran (deferred frees)."""
    output, take_output = in_flight.pop(0)
    scheduler.update_from_output(output, take_output())
'''
"""What a test with steps in flight adds: their completion."""

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

_STEP_DRAFTS = '''

def step(scheduler: Scheduler{forward_arg}, sample: int = 0, draft: int = 0,
         accept: int | None = None) -> None:
    """One engine step with speculative decoding: schedule(), the forward pass, then
    update_from_output() where a request that has computed all its tokens accepts the first
    `accept` (None: all) of the drafts scheduled for it and samples (sample + its token count
    + accepted) mod VOCAB_SIZE; then the drafter proposes `draft` tokens for every request of
    the batch, the i-th (sample + 1 + its token count + i) mod VOCAB_SIZE."""
    output = scheduler.schedule(){forward}
    req_ids = list(output.num_scheduled_tokens)
    requests = [scheduler.requests[req_id] for req_id in req_ids]
    spec = output.scheduled_spec_decode_tokens or {{}}
    sampled = []
    for request in requests:
        accepted = list(spec.get(request.request_id, ()))[:accept]
        done = request.num_computed_tokens >= request.num_tokens
        token = (sample + request.num_tokens + len(accepted)) % VOCAB_SIZE
        sampled.append([*accepted, token] if done else [])
    scheduler.update_from_output(output, model_output(req_ids, sampled))
    if draft:
        proposals = [[(sample + 1 + request.num_tokens + i) % VOCAB_SIZE for i in range(draft)]
                     for request in requests]
        scheduler.update_draft_token_ids(DraftTokenIds(req_ids, proposals))
'''


def _substituted(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """`text` with each (old, new) of `pairs` replaced in turn; each old must be there."""
    for old, new in pairs:
        assert old in text, old
        text = text.replace(old, new)
    return text


def _with_async_scheduler(text: str) -> str:
    """The test's Scheduler made vLLM's AsyncScheduler (async scheduling on), whose step() can
    leave its output in flight (held in a list until complete() takes it)."""
    text = _substituted(text, (
            ("from vllm.v1.core.sched.scheduler import Scheduler\n",
             "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
             "from vllm.v1.core.sched.scheduler import Scheduler\n"),
            ("        scheduler_reserve_full_isl=", "        async_scheduling=True,\n"
                                                  "        scheduler_reserve_full_isl="),
            ("    scheduler = Scheduler(\n", "    scheduler = AsyncScheduler(\n"),
            ("sample: int = 0) -> None:", "sample: int = 0,\n         in_flight: list | None = "
                                          "None) -> None:"),
            ("It drives vLLM's own Scheduler as", "It drives vLLM's own AsyncScheduler as"),
            ("one sampled token per request that needs one.\n",
             "one sampled token per request that needs one;\na step in flight leaves its "
             "output held until the step's completion, as an engine\noverlapping batches "
             "does, and vLLM defers the frees of requests it ran.\n"),
            ("    sampled = []\n"
             "    for req_id in req_ids:\n"
             "        request = scheduler.requests[req_id]\n"
             "        done = request.num_computed_tokens >= request.num_tokens\n"
             "        sampled.append([(sample + request.num_tokens) % VOCAB_SIZE] if done else [])\n"
             "    scheduler.update_from_output(output, model_output(req_ids, sampled))\n",
             "    requests = [scheduler.requests[req_id] for req_id in req_ids]\n"
             "    done = [request.num_computed_tokens >= request.num_tokens for request in requests]\n"
             "\n"
             "    def take_output() -> ModelRunnerOutput:\n"
             "        # Sampled when the output is taken, from the tokens the request has then.\n"
             "        return model_output(req_ids, [\n"
             "            [(sample + request.num_tokens) % VOCAB_SIZE] if d else []\n"
             "            for request, d in zip(requests, done)])\n"
             "\n"
             "    if in_flight is None:\n"
             "        scheduler.update_from_output(output, take_output())\n"
             "    else:\n"
             "        in_flight.append((output, take_output))\n")))
    return text + _COMPLETE


def _with_connector_imports(text: str, loads: bool) -> str:
    """The test's imports and VllmConfig with the connector set up (policy "recompute");
    with `loads`, what reporting a load's end takes too."""
    return _substituted(text, (
            ("from vllm.config import CacheConfig, DeviceConfig, ModelConfig,",
             "from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,"),
            ("from vllm.sampling_params import SamplingParams\n",
             "from vllm.distributed.kv_transfer.kv_connector.v1.base import (\n"
             "    KVConnectorBase_V1,\n    KVConnectorMetadata,\n    SupportsHMA,\n)\n"
             "from vllm.sampling_params import SamplingParams\n"),
            ("from vllm.v1.outputs import ModelRunnerOutput\n",
             "from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput\n"
             if loads else "from vllm.v1.outputs import ModelRunnerOutput\n"),
            ("cache_config=cache_config, device_config=DeviceConfig(device=\"cpu\"))",
             "cache_config=cache_config, device_config=DeviceConfig(device=\"cpu\"),\n"
             "                             kv_transfer_config=KVTransferConfig(\n"
             "                                 kv_connector=\"TraceConnector\", "
             "kv_connector_module_path=__name__,\n"
             "                                 kv_role=\"kv_consumer\", "
             "kv_load_failure_policy=\"recompute\"))")))


def _with_sync_loads(text: str, policy: str, groups: int) -> str:
    """The test's connector offering synchronous loads, under the trace's failure policy, and
    each step reporting the blocks its admitted loads failed to fill (on several KV cache
    groups, the requests)."""
    report = ("scheduler.update_from_output(output, load_failures(\n"
              "        scheduler, output, model_output(req_ids, sampled)))\n")
    text = _substituted(text, (
            ("from vllm.v1.outputs import ModelRunnerOutput\n",
             "from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput\n"),
            ('kv_connector="TraceConnector"', 'kv_connector="SyncLoadConnector"'),
            ('kv_load_failure_policy="recompute"', f'kv_load_failure_policy="{policy}"'),
            ("scheduler.update_from_output(output, model_output(req_ids, sampled))\n", report)))
    if groups == 1:
        return text + _SYNC_LOADS
    return text + _SYNC_LOADS[:_SYNC_LOADS.index("\n\ndef load_failures(")] + _GROUP_FAILURES


def _with_drafted(text: str) -> str:
    """The test's step() taking a drafter's count per request (`drafted`): a request it names
    proposes only the first of its drafts (an n-gram drafter may find fewer)."""
    return _substituted(text, (
            ("         accept: int | None = None) -> None:",
             "         accept: int | None = None, drafted: dict | None = None) -> None:"),
            ("    the batch, the i-th (sample + 1 + its token count + i) mod VOCAB_SIZE.",
             "    the batch, the i-th (sample + 1 + its token count + i) mod VOCAB_SIZE; a request\n"
             "    `drafted` names proposes only the first drafted[request id] of them."),
            ("                     for request in requests]",
             "                     for request in requests]\n"
             "        proposals = [p[:(drafted or {}).get(request.request_id, draft)]\n"
             "                     for p, request in zip(proposals, requests)]")))


def _returning_finished(text: str) -> str:
    """The test's step() returning the requests it finished (those that left the Scheduler)."""
    text = _substituted(text, (
            ("def step(scheduler: Scheduler, sample: int = 0) -> None:",
             "def step(scheduler: Scheduler, sample: int = 0) -> list:"),
            ("    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE.",
             "    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE.\n"
             "    Returns the ids of the requests it finished (that left the Scheduler), sorted."),
            ("    output = scheduler.schedule()\n    req_ids",
             "    before = set(scheduler.requests)\n"
             "    output = scheduler.schedule()\n    req_ids")))
    for end in ("model_output(req_ids, sampled)))\n", "model_output(req_ids, sampled))\n"):
        if end in text:
            returned = "    return sorted(before - set(scheduler.requests))\n"
            return text.replace(end, end + returned, 1)
    raise AssertionError("step() has no update_from_output")


def _returning_scheduled(text: str) -> str:
    """The test's step() returning what it scheduled (tokens per request)."""
    return _substituted(text, (
            ("def step(scheduler: Scheduler, sample: int = 0) -> None:",
             "def step(scheduler: Scheduler, sample: int = 0) -> dict:"),
            ("    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE.",
             "    computed all its tokens samples (sample + its token count) mod VOCAB_SIZE.\n"
             "    Returns the tokens it scheduled per request."),
            ("    scheduler.update_from_output(output, model_output(req_ids, sampled))\n",
             "    scheduler.update_from_output(output, model_output(req_ids, sampled))\n"
             "    return dict(output.num_scheduled_tokens)\n")))


def render_scheduler_test(trace: Trace, source: Path) -> str:
    """The text of the vLLM regression test for scheduler-level `trace`, read from `source`."""
    _refuse_config(trace)
    config = trace.config
    check = str(trace.meta["check"])
    writer = _SchedulerWriter(trace)
    state = writer.play()
    s = config.scheduler
    align = any(g.mamba_cache_mode == "align" for g in config.groups)
    cross = config.has_cross_attention
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
    heading, finding = title(trace, source)
    prop = (_REQUESTS_PROPERTY if writer.keep_requests else _FREE_QUEUE_PROPERTY
            if _diff_in_free_queue(trace) else _FINISHED_PROPERTY if writer.assert_finished
            else CHECKS[check])
    text = docstring(heading, finding, source.as_posix(), *_DRIVES, prop) + _HEADER.format(
        sha256_import=SHA256_IMPORT,
        specs=(cross_spec_imports if cross else spec_imports)(config),
        block_size=config.scheduler_block_size, hash_block_size=config.resolved_hash_block_size,
        num_blocks=config.num_blocks, max_model_len=config.max_model_len,
        vocab_size=s.vocab_size, model=repr(model), max_num_seqs=s.max_running,
        token_budget=s.token_budget, policy=s.policy, watermark=config.watermark,
        full_isl=s.full_sequence_must_fit,
        chunked_prefill=("" if s.chunked_prefill else
                         "\n    scheduler_config.enable_chunked_prefill = False"),
        enable_caching=config.enable_caching,
        cache_extra=(", mamba_cache_mode=\"align\"" if align else "") + (
            ", enable_mamba_shared_prefix_checkpoint=True"
            if config.enable_mamba_shared_prefix_checkpoint else ""),
        config_extra=retention_arg(config),
        groups=(cross_group_specs if cross else group_specs)(config), eagle=eagle,
        after=after)
    step_text = _STEP_DRAFTS if writer.drafts else _STEP
    if check == "D1":
        if config.kv_connector or any(g.kind == "sliding_window" for g in config.groups):
            text = text.replace("into the full-attention blocks", "into the attention blocks")
            decl, loop, read_from = _WINDOW_GROUPS
            groups = [(i, g.block_size, g.sliding_window) for i, g in enumerate(config.groups)
                      if g.kind in _READ_KINDS]
        else:
            decl, loop, read_from = _FULL_GROUPS
            groups = [(i, g.block_size) for i, g in enumerate(config.groups) if g.kind == "full"]
        text += _DATA_HELPERS.format(groups_decl=decl.format(groups=groups), groups_loop=loop,
                                     read_from=read_from)
        if config.kv_connector:
            text += _LOAD
        text += step_text.format(forward_arg=", forward: ForwardPass",
                                 forward="\n    forward.run(scheduler, output)")
        if config.kv_connector:
            text = _with_connector_imports(text + _CONNECTOR + _LOAD_OPS, loads=True)
    else:
        text += step_text.format(forward_arg="", forward="")
        if config.kv_connector:
            text = _with_connector_imports(text + _CONNECTOR, loads=False)
        if _sync_loads(trace):
            text = _with_sync_loads(text, s.kv_load_failure_policy, len(config.groups))
    if _in_flight(trace):
        text = _with_async_scheduler(text)
    if cross:
        text = with_encoder_decoder(text, config)
    if writer.assert_scheduled:
        text = _returning_scheduled(text)
    if writer.assert_finished:
        text = _returning_finished(text)
    if writer.drafted:
        text = _with_drafted(text)
    if writer.drafts:
        text = text.replace("from vllm.v1.outputs import ModelRunnerOutput\n",
                            "from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput\n")
    if not config.use_eagle:
        text = text.replace("from vllm.v1.core.sched import scheduler as scheduler_module\n", "")
        text = text.replace("def create_scheduler(model_dir, monkeypatch)",
                            "def create_scheduler(model_dir)")
    if not writer.finishes:
        text = text.replace("import Request, RequestStatus", "import Request")
    fixtures = "tmp_path, monkeypatch" if config.use_eagle else "tmp_path"
    body = [f"def {function_name(finding)}({fixtures}):",
            f"    scheduler = create_scheduler({fixtures})"]
    if check == "D1":
        body.append("    forward = ForwardPass()")
        writer.lines = [line.replace("step(scheduler", "step(scheduler, forward")
                        for line in writer.lines]
    body += writer.lines
    if _in_flight(trace):
        body.insert(2, "    in_flight = []  # outputs of steps in flight, oldest first")
    if check == "P1":
        body.insert(2, "    counts = record_counts(scheduler)")
        text += _COUNTS
    if writer.keep_requests:
        body += writer.assert_requests(state)
    elif _diff_in_free_queue(trace):
        free = list(state.free_queue)
        body += ["    free = [block.block_id for block in",
                 "            scheduler.kv_cache_manager.block_pool.free_block_queue"
                 ".get_all_free_blocks()]",
                 f"    assert free == {free!r}, (",
                 f"        f\"the free queue is {{free}}, but freeing each KV cache group's blocks "
                 f"tail first, group after group (as a request freed with no step in flight is), "
                 f"leaves {free}: which cached prefix is evicted first depends on whether a step "
                 "was in flight\")"]
    elif check == "P1":
        body += ["    negative = [(group, n) for group, n in counts if n < 0]",
                 "    assert not negative, (",
                 "        f\"(group, count) {negative}: a KV cache group counted fewer than 0 new "
                 "blocks to allocate, so the request's count (the groups' sum) is less than "
                 "what the allocation takes\")"]
    elif check == "DIFF-state":
        keyed = [i for i, key in enumerate(state.block_keys) if key is not None]
        body += ["    keyed = [block.block_id",
                 "             for block in scheduler.kv_cache_manager.block_pool.blocks",
                 "             if block.block_hash is not None]",
                 f"    assert keyed == {keyed!r}, (",
                 f"        f\"blocks {{keyed}} carry a cache key, but blocks {keyed} hold what "
                 "their keys name: a later request with the same prefix misses or is served "
                 "the wrong blocks\")"]
    return text + "\n\n" + "\n".join(body) + "\n"

