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

