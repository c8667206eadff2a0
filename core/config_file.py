"""A user's model shape from a file (`kvfuzz run --config-file FILE`, `kvfuzz.testing`): the
config object of docs/traces.md#config, as TOML (`.toml`) or JSON (any other name), read within
the bounds of docs/traces.md#bounds and validated with the messages a trace's config gets."""

from __future__ import annotations

import os
from pathlib import Path

from kvfuzz.core.config import Config
from kvfuzz.core.errors import ConfigError, TraceFormatError
from kvfuzz.core.limits import parse_document, read_text


def load_config_file(path: str | os.PathLike[str]) -> Config:
    """The config in file `path`, named by its `name` field, else by the file's stem;
    ConfigError names the file and the bad value."""
    p = Path(path)
    try:
        text = read_text(p, "config")
        data = parse_document(text, str(p), "config", toml=p.suffix.lower() == ".toml")
    except TraceFormatError as exc:
        raise ConfigError(str(exc)) from None
    if isinstance(data, dict) and "name" not in data:
        data = {**data, "name": p.stem}
    try:
        return Config.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: config: {exc}") from None



_FULL_FAMILY = ("full", "mla", "sink_full", "rswa")


def too_small_pool(config: Config) -> str | None:
    """Why the pool cannot hold one request of `max_model_len` tokens (vLLM refuses such a
    model at startup), or None. Counts the full-attention groups' blocks and a sliding
    window's; other kinds, which hold fewer, are left out, so this never warns wrongly."""
    need = 0
    for group in config.groups:
        blocks = -(-config.max_model_len // group.block_size)
        if group.kind in _FULL_FAMILY:
            need += blocks
        elif group.kind == "sliding_window" and group.sliding_window is not None:
            need += min(blocks, -(-(group.sliding_window - 1) // group.block_size) + 1)
    usable = config.num_blocks - 1  # block 0 is the null block
    if need <= usable:
        return None
    return (f"one request of max_model_len {config.max_model_len} tokens needs at least {need} "
            f"blocks, the pool has {usable} usable (num_blocks {config.num_blocks} less the "
            "null block): such a request can never run (vLLM refuses this at startup)")
