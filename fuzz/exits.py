"""The exit codes of the `kvfuzz` command, and the guard that keeps them true.

0 no counterexample (or the command succeeded), 1 a counterexample, 2 bad usage or input (the
message names the bad value; nothing was changed), 3 a fault of code the harness ran: a check,
a target adapter, a plugin, or kvfuzz itself. An exit 3 prints a few lines naming the culprit
and the exception; the full traceback goes to a log file (or to stderr with `--debug`). No
traceback escapes, and a closed stdout (`kvfuzz ... | head`) does not change the exit code.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from kvfuzz.core.errors import HarnessFault, KvfuzzError
from kvfuzz.core.signals import asked_to_stop, on_sigint

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_FAULT = 0, 1, 2, 3
EXIT_INTERRUPTED = 130
"""Ctrl-C outside a campaign (a campaign stops on Ctrl-C and reports what it found)."""


class PluginFault(HarnessFault):
    """A plugin module named by the user raised while being imported."""


@dataclass
class ErrorReport:
    """An error of another process (a `--workers` worker), sent to the parent to raise there as
    the same exit: `usage` for bad input (2), else a fault of `source` (3)."""

    usage: bool
    source: str
    error: str
    """The exception's type name."""
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> ErrorReport:
        cause = exc.__cause__ if isinstance(exc, HarnessFault) and exc.__cause__ else exc
        source = exc.source if isinstance(exc, HarnessFault) else "a worker process"
        return cls(isinstance(exc, KvfuzzError), source, type(cause).__name__, str(cause),
                   "".join(traceback.format_exception(exc)))

    def raise_here(self) -> None:
        if self.usage:
            raise KvfuzzError(self.message)
        remote = type(self.error, (Exception,), {"__module__": "worker"})(self.message)
        remote.__cause__ = _RemoteTraceback(self.traceback)
        raise HarnessFault(self.source, remote) from remote


class _RemoteTraceback(Exception):
    def __str__(self) -> str:
        return "the worker's traceback:\n" + str(self.args[0])


def guarded(main: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run `main(argv)` and map whatever it raises to an exit code and a short message."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or bool(os.environ.get("KVFUZZ_DEBUG"))
    stdout = sys.stdout
    sys.stdout = _PipeSafe(stdout)
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, on_sigint)  # Ctrl-C noted: see kvfuzz.core.signals
    try:
        return main(argv)
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt as exc:
        if not asked_to_stop(exc):  # raised by code kvfuzz ran, not by Ctrl-C
            return _fault("kvfuzz itself (an interrupt no signal asked for)", exc, debug)
        print("kvfuzz: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KvfuzzError as exc:
        print(f"kvfuzz: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:  # an optional dependency is missing
        print(f"kvfuzz: error: cannot import {exc.name!r} ({exc})", file=sys.stderr)
        return EXIT_USAGE
    except RecursionError as exc:
        return _fault("kvfuzz (too deep a recursion)", exc, debug)
    except HarnessFault as exc:
        return _fault(exc.source, exc.__cause__ or exc, debug)
    except BaseException as exc:  # noqa: BLE001 - the point of the guard
        return _fault("kvfuzz itself (an internal error: please report it)", exc, debug)
    finally:
        _flush()
        sys.stdout = stdout
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _fault(source: str, exc: BaseException, debug: bool) -> int:
    """Exit 3: name the source and the exception; the traceback to stderr or a log file."""
    text = "".join(traceback.format_exception(exc))
    print(f"kvfuzz: error: {source} raised {type(exc).__name__}: {_first_line(exc)}",
          file=sys.stderr)
    if debug:
        print(text, file=sys.stderr, end="")
        return EXIT_FAULT
    log = _log(text)
    where = f"the traceback is in {log}" if log else "the traceback could not be saved"
    print(f"kvfuzz: {where}; pass --debug to print it", file=sys.stderr)
    return EXIT_FAULT


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    first = lines[0] if lines else ""
    return first[:300] + (" ..." if len(lines) > 1 or len(first) > 300 else "")


def _log(text: str) -> str | None:
    try:
        fd, path = tempfile.mkstemp(prefix="kvfuzz-traceback-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(text)
    except OSError:
        return None
    return path


class _PipeSafe:
    """stdout that goes quiet once its reader has gone (a closed pipe), so the command still
    finishes and exits with its own code."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._silence()

    def _silence(self) -> None:
        self.broken = True
        try:  # what is left in the stream's buffer is flushed to nowhere at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _flush() -> None:
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass
