"""The bounds a trace or config file must keep (docs/traces.md, "Bounds"), and the reading of
such a file: a regular file of bounded size, JSON of bounded nesting, strings that are text.

A file outside the bounds is bad input (exit 2), never a finding and never a crash.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from itertools import accumulate
from pathlib import Path
from typing import Any

from kvfuzz.core.errors import TraceFormatError

MAX_FILE_BYTES = 16 * 1024 * 1024
"""A trace or config file is at most 16 MiB."""
MAX_NESTING = 32
"""Objects and lists nest at most 32 deep (a trace needs 5)."""
MAX_OPS = 200_000
"""Ops in one trace."""
MAX_REQUESTS = 1024
"""`add_request` ops in one trace: every op snapshots and checks every request, so a replay's
time grows with the square of the requests (1,000 take about 5 s, 2,000 about 23 s)."""
MAX_NUM_BLOCKS = 1 << 20
"""Pool size N (1,048,576 blocks, a large GPU's pool at block size 16; each costs the manager
and the model memory up front: about 0.7 KB a block for a replay, 1.1 KB for a campaign,
as bench/bench_block_memory.py measures; `kvfuzz run` checks a pool against the memory
available, kvfuzz.fuzz.bounds)."""
MAX_GROUPS = 16
"""KV cache groups in one config."""
MAX_SIZE = 1 << 24
"""Every other size of a config: block sizes (and the scheduler block size, their LCM), windows,
chunks, max_model_len, budgets."""
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are stored as int32 by vLLM 0.34 (`TokenBuffer`); a larger id cannot be stored."""
MAX_INT = (1 << 63) - 1
"""Every other int of an op (counts, priorities, block ids) is an i64; counts are >= 0."""

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def nesting(text: str) -> int:
    """How deep the objects and lists of JSON `text` nest (strings skipped)."""
    brackets = re.sub(r"[^\[\]{}]", "", _STRINGS.sub("", text))
    steps = (1 if c in "[{" else -1 for c in brackets)
    return max(accumulate(steps, initial=0))


def read_document(path: str | os.PathLike[str], what: str = "trace") -> Any:
    """The JSON document in file `path`; TraceFormatError (naming the file and the bad value)
    unless it is a regular file within MAX_FILE_BYTES, UTF-8, JSON nested at most MAX_NESTING,
    every string valid text."""
    return parse_document(read_text(path, what), f"{Path(path)}", what)


def read_text(path: str | os.PathLike[str], what: str = "trace") -> str:
    """The text of a regular file of at most MAX_FILE_BYTES (a FIFO or a device is refused
    before a byte is read)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise TraceFormatError(f"cannot read {p}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise TraceFormatError(f"cannot read {p}: Is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise TraceFormatError(f"{p} is not a regular file: a {what} is read from a file")
        if info.st_size > MAX_FILE_BYTES:
            raise TraceFormatError(f"{p} has {info.st_size} bytes: a {what} file has at most "
                                   f"{MAX_FILE_BYTES} (docs/traces.md, Bounds)")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TraceFormatError(f"cannot read {p}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise TraceFormatError(f"{p} has more than {MAX_FILE_BYTES} bytes (docs/traces.md, Bounds)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"{p} is not a {what}: not UTF-8 JSON ({exc.reason} at byte {exc.start})") from None


def parse_document(text: str, source: str, what: str = "trace", toml: bool = False) -> Any:
    """Parse JSON (TOML if `toml`) `text` within the bounds (see `read_document`)."""
    depth = nesting(text)
    if depth > MAX_NESTING:
        raise TraceFormatError(f"{source}: nested {depth} deep; a {what} nests at most "
                               f"{MAX_NESTING} (docs/traces.md, Bounds)")
    try:
        data = tomllib.loads(text) if toml else json.loads(text, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{source} is not valid JSON (line {exc.lineno}, column "
                               f"{exc.colno}: {exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        raise TraceFormatError(f"{source} is not valid TOML ({exc})") from None
    except ValueError as exc:  # an int of more digits than Python converts
        raise TraceFormatError(f"{source}: {exc}") from None
    except RecursionError:
        raise TraceFormatError(f"{source}: nested too deep (docs/traces.md, Bounds)") from None
    try:
        check_text(data, "")
    except TraceFormatError as exc:
        raise TraceFormatError(f"{source}: {exc}") from None
    return data


def _constant(name: str) -> Any:
    raise TraceFormatError(f"{name} is not a JSON number (numbers must be finite)")


def check_text(value: Any, where: str) -> None:
    """Every string (and key) in `value` is valid Unicode text: no lone surrogates."""
    if isinstance(value, str):
        _text(value, where or "a string")
    elif isinstance(value, dict):
        for key, item in value.items():
            _text(key, f"a key in {where or 'the document'}")
            check_text(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{where}[{i}]")


def _text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TraceFormatError(f"{where} {value!r} is not text: a lone surrogate "
                               f"{value[exc.start]!r} at index {exc.start}") from None


def shown(value: Any) -> str:
    """`value` for a message: a huge int by its size, a long repr cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
