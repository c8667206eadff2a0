"""Hypothesis example databases named by a string: a local directory, a shared Redis, or both.

One syntax for `kvfuzz run --database`, `pytest --kvfuzz-database` and `KVFUZZ_DATABASE`:

- `DIR`: a local directory (Hypothesis' DirectoryBasedExampleDatabase);
- `redis://[:PASSWORD@]HOST[:PORT][/N]` (or `rediss://` for TLS): database N (default 0) of a
  Redis server (Hypothesis' RedisExampleDatabase), shared by every worker on every machine;
- `readonly:SPEC`: a read-only view of SPEC: its examples replay, nothing is written to it (a
  laptop replaying what the nightly campaign learned, without pushing its own back).

Several specs are multiplexed (Hypothesis' MultiplexedDatabase): every example is read from
all of them and written to every writable one. A shared part that fails mid-run (the Redis
server went away) is dropped with one warning and the run goes on with the local parts, or
with an in-memory database when there are none: nothing it was saving is lost. `probe` pings
the shared parts (a campaign driver's check, between batches and at the end, of a database its
workers use: they stay quiet, so a campaign warns once, whatever the number of processes).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    InMemoryExampleDatabase,
    ReadOnlyDatabase,
)

from kvfuzz.core.errors import KvfuzzError, require

READONLY = "readonly:"
REDIS_SCHEMES = ("redis", "rediss")
INSTALL = "pip install 'kvfuzz[distributed]'"
CONNECT_TIMEOUT_S = 3.0
SOCKET_TIMEOUT_S = 10.0


class DatabaseError(KvfuzzError):
    """A database spec is malformed or names a server that cannot be reached."""


@dataclass(frozen=True)
class Part:
    """One spec: where it is and whether it is written to."""

    location: str
    """A directory path, or a redis:// URL."""
    readonly: bool = False

    @property
    def shared(self) -> bool:
        return urlsplit(self.location).scheme in REDIS_SCHEMES

    @property
    def shown(self) -> str:
        """The location as messages print it: a Redis URL without its password."""
        if not self.shared:
            return self.location
        url = urlsplit(self.location)
        host = url.hostname or "localhost"
        port = url.port or 6379
        return f"{url.scheme}://{host}:{port}/{_db_number(url.path, self.location)}"


def parse(spec: str) -> Part:
    """The Part a spec names; DatabaseError when it is malformed."""
    readonly = spec.startswith(READONLY)
    location = spec[len(READONLY):] if readonly else spec
    if not location:
        raise DatabaseError(f"database spec {spec!r} names no location")
    url = urlsplit(location)
    if url.scheme in REDIS_SCHEMES:
        try:
            url.port
        except ValueError as exc:
            raise DatabaseError(f"database {spec!r}: {exc}") from None
        _db_number(url.path, spec)
    elif "://" in location:
        raise DatabaseError(f"database {spec!r}: unknown scheme {url.scheme!r} (a directory, "
                            "redis://HOST:PORT/N or rediss://...)")
    return Part(location, readonly)


def _db_number(path: str, spec: str) -> int:
    number = path.strip("/") or "0"
    if not number.isdigit():
        raise DatabaseError(f"database {spec!r}: the Redis database must be a number, "
                            f"got {number!r}")
    return int(number)


def _redis_client(part: Part) -> Any:
    require("redis", INSTALL, f"the database {part.shown}")
    import redis

    return redis.Redis.from_url(part.location, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=SOCKET_TIMEOUT_S)


def check_reachable(specs: Sequence[str]) -> None:
    """Parse every spec and ping every Redis one: DatabaseError naming the address and the
    error when one cannot be reached (before a campaign does any work)."""
    for part in map(parse, specs):
        if not part.shared:
            continue
        client = _redis_client(part)
        try:
            client.ping()
        except Exception as exc:  # redis.RedisError or OSError: all mean "not reachable"
            raise DatabaseError(f"cannot reach the example database {part.shown}: "
                                f"{type(exc).__name__}: {exc}") from None
        finally:
            client.close()


def warn(message: str) -> None:
    """Print a kvfuzz warning to stderr."""
    print(f"kvfuzz: warning: {message}", file=sys.stderr, flush=True)


def quiet(message: str) -> None:
    """Say nothing (a campaign worker's database: the driver warns, see `probe`)."""


def open_database(specs: Sequence[str],
                  warn: Callable[[str], None] = warn) -> ExampleDatabase | None:
    """The database the specs name (None when there are none). It does not connect yet: a
    shared part that fails at any time is dropped then, calling `warn` once."""
    if not specs:
        return None
    shared: list[tuple[Part, ExampleDatabase, Any]] = []
    local: list[ExampleDatabase] = []
    for part in map(parse, specs):
        if part.shared:
            from hypothesis.extra.redis import RedisExampleDatabase

            client = _redis_client(part)
            db: ExampleDatabase = RedisExampleDatabase(client)
        else:
            db = DirectoryBasedExampleDatabase(Path(part.location))
        if part.readonly:
            db = ReadOnlyDatabase(db)
        if part.shared:
            shared.append((part, db, client))
        else:
            local.append(db)
    if not shared and len(local) == 1:
        return local[0]
    return SharedDatabase(shared, local, [spec for spec in specs if not parse(spec).shared],
                          warn)


class SharedDatabase(ExampleDatabase):
    """Shared (Redis) parts multiplexed with local ones; the shared ones are dropped, with one
    warning, the first time one fails, and the local ones carry on."""

    def __init__(self, shared: list[tuple[Part, ExampleDatabase, Any]],
                 local: list[ExampleDatabase],
                 local_specs: list[str], warn: Callable[[str], None]) -> None:
        super().__init__()
        self.shared = shared
        self.local = local
        self.local_specs = local_specs
        self.warn = warn
        self.lost: str | None = None
        """The warning given when the shared parts were dropped (None while they work)."""

    def __repr__(self) -> str:
        parts = [p.shown for p, _, _ in self.shared] + self.local_specs
        return f"SharedDatabase({', '.join(parts)})"

    def _drop_shared(self, part: Part, exc: BaseException) -> None:
        if not self.local:
            self.local = [InMemoryExampleDatabase()]
            rest = "an in-memory database for the rest of this run"
        else:
            rest = "the local database " + ", ".join(self.local_specs) + " only"
        self.lost = (f"example database {part.shown} lost ({type(exc).__name__}: {exc}); "
                     f"going on with {rest}")
        self.shared = []
        self.warn(self.lost)

    def probe(self) -> None:
        """Ping every shared part's server; one that does not answer drops the shared parts
        (with the warning, once), as a failed read or write would."""
        for part, _, client in list(self.shared):
            if not self.shared:
                break
            try:
                client.ping()
            except Exception as exc:  # redis.RedisError, OSError: the server is gone
                self._drop_shared(part, exc)

    def _each(self, action: Callable[[ExampleDatabase], Any]) -> Iterable[Any]:
        """`action` on every part, shared ones first, yielding what each returns; a shared
        part's failure drops the shared parts and the local ones still run."""
        for part, db, _ in list(self.shared):
            if not self.shared:  # dropped by an earlier part's failure
                break
            try:
                yield action(db)
            except Exception as exc:  # redis.RedisError, OSError: the server is gone
                self._drop_shared(part, exc)
        for db in self.local:  # read after the loop: a loss may have added one
            yield action(db)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        seen: set[bytes] = set()
        for values in list(self._each(lambda db: list(db.fetch(key)))):
            for value in values:
                if value not in seen:
                    seen.add(value)
                    yield value

    def save(self, key: bytes, value: bytes) -> None:
        for _ in self._each(lambda db: db.save(key, value)):
            pass

    def delete(self, key: bytes, value: bytes) -> None:
        for _ in self._each(lambda db: db.delete(key, value)):
            pass

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        for _ in self._each(lambda db: db.move(src, dest, value)):
            pass

    def _start_listening(self) -> None:
        for _ in self._each(lambda db: db.add_listener(self._broadcast_change)):
            pass

    def _stop_listening(self) -> None:
        for _ in self._each(lambda db: db.remove_listener(self._broadcast_change)):
            pass
