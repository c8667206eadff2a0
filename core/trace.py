"""Trace files: the versioned JSON format of docs/traces.md, with a schema check on load.

An op is a plain dict; `normalize_op` checks its fields and fills the defaults, so every side
receives ops with every field present.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvfuzz import versions
from kvfuzz.core.config import Config
from kvfuzz.core.errors import ConfigError, TraceFormatError
from kvfuzz.core.limits import (MAX_INT, MAX_OPS, MAX_REQUESTS, MAX_TOKEN_ID, read_document,
                                 shown)

FORMAT = "kvfuzz-trace"
VERSION = 1
LEVELS = ("api", "scheduler")

Op = dict[str, Any]

_INT, _BOOL, _STR, _INTS, _OPT_STR, _OPT_INT = "int", "bool", "str", "ints", "str?", "int?"
_OPT_INTS, _TRIPLES, _COUNTS = "ints?", "triples", "counts"

_REQUEST_FIELDS = {
    "request_id": (_STR, None),
    "prompt": (_INTS, None),
    "cache_salt": (_OPT_STR, None),
    "priority": (_INT, 0),
    "max_tokens": (_INT, 16),
    "skip_reading_prefix_cache": (_BOOL, False),
    "num_encoder_tokens": (_INT, 0),
    "prefix_cache_hit_limit": (_OPT_INT, None),
    # Extra hash keys (docs/spec.md §2.3); absent on a plain request.
    "lora_name": (_OPT_STR, None),
    "lora_id": (_OPT_INT, None),
    "lora_path": (_OPT_STR, None),
    "mm_inputs": (_TRIPLES, None),
    "prompt_embeds": (_OPT_INTS, None),
}

OP_SCHEMAS: dict[str, dict[str, dict[str, tuple[str, Any]]]] = {
    "api": {
        "add_request": _REQUEST_FIELDS,
        "get_computed_blocks": {"request_id": (_STR, None),
                                "max_cache_hit_length": (_OPT_INT, None)},
        "get_num_cached_tokens": {"request_id": (_STR, None)},
        "allocate_slots": {
            "request_id": (_STR, None),
            "num_new_tokens": (_INT, None),
            "use_lookup": (_BOOL, False),
            "num_lookahead_tokens": (_INT, 0),
            "full_sequence_must_fit": (_BOOL, False),
            "reserved_blocks": (_INT, 0),
            "has_scheduled_reqs": (_BOOL, True),
            "num_encoder_tokens": (_INT, 0),
            "num_external_computed_tokens": (_INT, 0),
            "delay_cache_blocks": (_BOOL, False),
        },
        "free": {"request_id": (_STR, None), "preempt": (_BOOL, False)},
        "append_tokens": {"request_id": (_STR, None), "tokens": (_INTS, None)},
        "cache_blocks": {"request_id": (_STR, None), "num_computed_tokens": (_OPT_INT, None)},
        "evict_blocks": {"block_ids": (_INTS, None)},
        "reset_prefix_cache": {},
        "take_new_block_ids": {},
        "take_kv_cache_block_copies": {},
        "release_copies": {},
        "new_step_starts": {},
        "take_events": {},
        "free_deferred": {"request_id": (_STR, None)},
        "release_deferred": {"evict_first": (_BOOL, False)},
    },
    "scheduler": {
        "add_request": _REQUEST_FIELDS,
        "step": {"sample": (_INT, 0), "in_flight": (_BOOL, False), "accept": (_OPT_INT, None),
                 "draft": (_INT, 0), "drafted": (_COUNTS, None)},
        "complete_step": {},
        "abort": {"request_id": (_STR, None)},
        "finish": {"request_id": (_STR, None)},
        "load_remote": {"request_id": (_STR, None), "num_external_tokens": (_INT, None),
                        "sync": (_BOOL, False), "num_loaded_tokens": (_OPT_INT, None)},
        "finish_load": {"request_id": (_STR, None), "num_loaded_tokens": (_OPT_INT, None)},
        "reset_prefix_cache": {"reset_running_requests": (_BOOL, False)},
        "take_events": {},
    },
}


# Fields added to an op after trace digests were first written: left out of the digest at their
# default, so that a trace that does not use them keeps the digest (and file name) it had.
_LATER_FIELDS = {"step": ("accept", "draft", "drafted"),
                 "load_remote": ("sync", "num_loaded_tokens")}

# Fields whose schema default is None but which must be given.
_MANDATORY = {"request_id", "prompt", "num_new_tokens", "tokens", "block_ids",
              "num_external_tokens"}


def _is_ints(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


_EXPECTED = {
    _INT: "an int",
    _BOOL: "true or false",
    _STR: "a string",
    _OPT_STR: "a string or null",
    _OPT_INT: "an int or null",
    _INTS: "a list of ints",
    _OPT_INTS: "a list of ints or null",
    _TRIPLES: "a list of [int, int, int] or null",
    _COUNTS: "an object of request id -> int, or null",
}
_TOKEN_LISTS = ("prompt", "tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_value(where: str, kind: str, value: Any, key: str) -> None:
    ok = {
        _INT: _is_int(value),
        _BOOL: isinstance(value, bool),
        _STR: isinstance(value, str),
        _OPT_STR: value is None or isinstance(value, str),
        _OPT_INT: value is None or _is_int(value),
        _INTS: _is_ints(value),
        _OPT_INTS: value is None or _is_ints(value),
        _TRIPLES: value is None or isinstance(value, list)
        and all(_is_ints(v) and len(v) == 3 for v in value),
        _COUNTS: value is None or isinstance(value, dict)
        and all(_is_int(v) for v in value.values()),
    }[kind]
    if not ok:
        got = "a list holding " + ", ".join(sorted({type(v).__name__ for v in value})) if (
            isinstance(value, list)) else shown(value)
        raise TraceFormatError(f"{where} must be {_EXPECTED[kind]}, got {got}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise TraceFormatError(f"{where} must be text, got {value!r} (a lone "
                                   "surrogate)") from None
    elif kind == _TRIPLES and value:
        for triple in value:
            _check_value(where, _INTS, triple, "")
    elif kind == _COUNTS and value:
        for request_id, count in value.items():
            _check_value(f"{where}[{shown(request_id)}]", _STR, request_id, "")
            _check_value(f"{where}[{shown(request_id)}]", _INT, count, "")
    elif isinstance(value, list):
        # A negative token is an i64 the reference model refuses where it stands (InvalidTrace).
        low, high = -MAX_INT - 1, MAX_TOKEN_ID if key in _TOKEN_LISTS else MAX_INT
        if value and not low <= min(value) <= max(value) <= high:
            bad = next(v for v in value if not low <= v <= high)
            if key in _TOKEN_LISTS and bad > MAX_TOKEN_ID:
                raise TraceFormatError(f"{where}: token id {shown(bad)} exceeds {MAX_TOKEN_ID}, "
                                       "the largest id vLLM stores (int32)")
            raise TraceFormatError(f"{where} holds {shown(bad)}, outside the i64 range")
    elif _is_int(value) and not -MAX_INT - 1 <= value <= MAX_INT:
        raise TraceFormatError(f"{where} must be an i64, got {shown(value)}")


def normalize_op(raw: Any, level: str, where: str = "op") -> Op:
    """Check an op against its schema and return it with every default filled in."""
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{where} must be an object, got {raw!r}")
    name = raw.get("op")
    schemas = OP_SCHEMAS[level]
    if not isinstance(name, str) or name not in schemas:
        raise TraceFormatError(
            f"{where}: unknown {level}-level op {shown(name)} (known: {', '.join(schemas)})"
        )
    schema = schemas[name]
    unknown = sorted(map(repr, set(raw) - set(schema) - {"op"}))
    if unknown:
        raise TraceFormatError(f"{where} ({name}): unknown field(s) {', '.join(unknown)}")
    op: Op = {"op": name}
    for key, (kind, default) in schema.items():
        if key in raw:
            _check_value(f"{where} ({name}).{key}", kind, raw[key], key)
            value = raw[key]
            op[key] = (
                [list(v) if isinstance(v, list) else v for v in value]
                if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
            )
        elif key in _MANDATORY:
            raise TraceFormatError(f"{where} ({name}) needs field {key!r}")
        else:
            op[key] = default
    return op


def compact_op(op: Op, level: str) -> Op:
    """The op with fields at their default value left out (for readable files)."""
    schema = OP_SCHEMAS[level][op["op"]]
    out: Op = {"op": op["op"]}
    for key, (_, default) in schema.items():
        if key in _MANDATORY or op.get(key, default) != default:
            out[key] = op[key]
    return out


def op_text(op: Op, level: str) -> str:
    """The op as one line of JSON, fields at their default left out."""
    return json.dumps(compact_op(op, level))


@dataclass
class Trace:
    """A config, a level and the ops to run from a fresh manager."""

    config: Config
    level: Literal["api", "scheduler"]
    ops: list[Op] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def prefix(self, n: int) -> Trace:
        """The trace cut after its first n ops."""
        return Trace(self.config, self.level, [dict(op) for op in self.ops[:n]], dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "level": self.level,
            "config": self.config.to_dict(),
            "ops": [compact_op(op, self.level) for op in self.ops],
            "meta": self.meta,
        }

    def to_json(self) -> str:
        """One op per line: diffable, and readable in a terminal."""
        data = self.to_dict()
        ops = data.pop("ops")
        head = json.dumps(data, sort_keys=False)[:-1]
        body = ",\n".join("    " + json.dumps(op) for op in ops)
        return f'{head}, "ops": [\n{body}\n]}}\n' if ops else f'{head}, "ops": []}}\n'

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        if not isinstance(data, dict):
            raise TraceFormatError(f"a trace must be a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise TraceFormatError(f"format must be {FORMAT!r}, got {data.get('format')!r}")
        version = data.get("version")
        if type(version) is not int or version != VERSION:  # true and 1.0 equal 1 in Python
            raise TraceFormatError(
                f"unsupported trace version {version!r}: this kvfuzz reads version {VERSION} "
                "(the integer)"
            )
        unknown = sorted(set(data) - {"format", "version", "level", "config", "ops", "meta"})
        if unknown:
            raise TraceFormatError(f"unknown top-level field(s) {', '.join(map(repr, unknown))}")
        missing = [key for key in ("level", "config", "ops") if key not in data]
        if missing:
            raise TraceFormatError(f"missing field(s) {', '.join(map(repr, missing))}")
        level = data.get("level")
        if level not in LEVELS:
            raise TraceFormatError(f"level must be one of {LEVELS}, got {level!r}")
        try:
            config = Config.from_dict(data.get("config"))
        except ConfigError as exc:
            raise TraceFormatError(f"config: {exc}") from None
        ops = data.get("ops")
        if not isinstance(ops, list):
            raise TraceFormatError(f"ops must be a list, got {shown(ops)}")
        if len(ops) > MAX_OPS:
            raise TraceFormatError(f"ops lists {len(ops)} ops, at most {MAX_OPS}")
        meta = data.get("meta", {})
        check_meta(meta)
        normalized = [normalize_op(op, level, f"ops[{i}]") for i, op in enumerate(ops)]
        requests = sum(op["op"] == "add_request" for op in normalized)
        if requests > MAX_REQUESTS:
            raise TraceFormatError(f"ops add {requests} requests, at most {MAX_REQUESTS} "
                                   "(docs/traces.md, Bounds)")
        return cls(config, level, normalized, meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace file; TraceFormatError says what is wrong and where."""
        p = Path(path)
        data = read_document(p)
        try:
            return cls.from_dict(data)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{p}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically: a reader never sees a half-written file."""
        return write_atomic(path, self.to_json())

    def digest(self) -> str:
        """A short digest of what the trace runs (config, level, ops), its meta left out: the
        same trace found under another seed or run has the same digest."""
        ops = [{k: v for k, v in op.items() if k not in _LATER_FIELDS.get(op["op"], ())
                or v != OP_SCHEMAS[self.level][op["op"]][k][1]} for op in self.ops]
        content = json.dumps([self.config.to_dict(), self.level, ops], sort_keys=True)
        return hashlib.sha256(content.encode()).hexdigest()[:10]


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` atomically, with the usual permissions (0666 less the umask)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


META_TYPES: dict[str, tuple[type, str]] = {
    **{key: (str, "a string") for key in ("check", "message", "target", "data", "config",
                                          "level")},
    "plugins": (list, "a list of module names"),
    "seed": (int, "an int"),
    "versions": (dict, "an object"),
}
"""The meta keys kvfuzz reads or writes (docs/traces.md, Meta), with their types."""


def check_meta(meta: Any) -> None:
    """`meta` is an object whose known keys have their documented types."""
    if not isinstance(meta, dict):
        raise TraceFormatError(f"meta must be an object, got {shown(meta)}")
    for key, (kind, expected) in META_TYPES.items():
        if key not in meta:
            continue
        value = meta[key]
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if key == "plugins":
            ok = ok and all(isinstance(m, str) for m in value)
        if not ok:
            raise TraceFormatError(f"meta.{key} must be {expected}, got {shown(value)}")


def save_finding(trace: Trace, directory: str | os.PathLike[str]) -> Path:
    """Atomically write a finding as `<check>-<config>-<digest>.json` in `directory` (the
    digest of what it runs, `Trace.digest`), its meta recording the versions of kvfuzz and
    Hypothesis that found it (`versions`)."""
    digest = trace.digest()
    check = _file_part(str(trace.meta.get("check", "finding")))
    config = _file_part(str(trace.meta.get("config", trace.config.name)))
    trace.meta["versions"] = versions()
    return trace.save(Path(directory) / f"{check}-{config}-{digest}.json")


def _file_part(name: str) -> str:
    """`name` as part of a file name that `corpus/*.json` lists: a character outside letters,
    digits and `_+=.-` becomes `-`, and no leading dot hides the file."""
    return re.sub(r"[^\w+=.-]", "-", name, flags=re.ASCII).lstrip(".") or "finding"
