"""`kvfuzz run --ray [ADDRESS]`: the campaign's batches as Ray tasks.

A backend of the one campaign scheduler (`kvfuzz.fuzz.schedule`): the driver decides the
batches, as it does for `--workers`, and each batch runs as a Ray task (`BatchRunner`, one CPU)
on an existing cluster (ADDRESS: `HOST:PORT` of its head, `ray://HOST:PORT`, or `auto`) or on
a local one of 2 CPUs when no address is given. Results come back as tasks finish; the driver
counts them, and deduplicates, shrinks and saves findings into its own corpus.

- A batch is plain data (level, config, seed, examples): whatever node runs it, it gives the
  same examples, so the campaign is the same whatever the number of nodes.
- A worker or node that dies loses only the batches it was running: Ray reruns them elsewhere
  (`TASK_RETRIES` times, then the campaign fails naming the batch).
- Ctrl-C on the driver cancels the tasks: running ones stop at their next example and hand back
  what they found, queued ones are dropped.
- Before any work the address is checked (a TCP connection, then `ray.init`), and every alive
  node imports kvfuzz: a node without it is exit 2 with how to ship it (`--ray-runtime-env`).

Ray is imported only here, and only when `--ray` is given (`pip install 'kvfuzz[distributed]'`).
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

from kvfuzz import __version__
from kvfuzz.core.errors import KvfuzzError, require

INSTALL = "pip install 'kvfuzz[distributed]'"
LOCAL_CPUS = 2
"""CPUs of the local cluster started when no address is given."""
CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 180.0
TASK_RETRIES = 5
"""Reruns of a batch whose worker or node died (Ray's `max_retries`)."""
AHEAD = 2
"""Batches submitted per CPU: one running, the next already queued on the node."""


class RayError(KvfuzzError):
    """The Ray address cannot be reached, or its nodes cannot run kvfuzz (exit 2)."""


def runtime_env(text: str | None) -> dict[str, Any] | None:
    """`--ray-runtime-env JSON`: a Ray runtime environment, e.g. `{"pip": ["kvfuzz==0.2.0"]}`."""
    if text is None:
        return None
    try:
        env = json.loads(text)
    except ValueError as exc:
        raise RayError(f"--ray-runtime-env {text!r} is not JSON ({exc})") from None
    if not isinstance(env, dict):
        raise RayError(f"--ray-runtime-env must be a JSON object, got {text!r}")
    return env


def shipping_hint(address: str | None) -> str:
    where = f" {address}" if address else ""
    wheel = f"kvfuzz-{__version__}-py3-none-any.whl"
    return (f"install kvfuzz {__version__} on every node, or ship it with the job: "
            f"kvfuzz run --ray{where} --ray-runtime-env "
            f"'{{\"pip\": [\"kvfuzz[distributed]=={__version__}\"]}}', or with a wheel built "
            f"here (`pip wheel --no-deps -w dist .`): --ray-runtime-env "
            f"'{{\"py_modules\": [\"dist/{wheel}\"]}}' (docs/distributed.md, \"Ray\")")


def _reachable(address: str) -> None:
    """A TCP connection to the head's address, so that a wrong one fails in seconds (Ray's
    own client retries for minutes)."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RayError(f"--ray {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise RayError(f"cannot reach the Ray cluster at {address}: "
                       f"{type(exc).__name__}: {exc}") from None


def connect(address: str | None, env: dict[str, Any] | None = None) -> None:
    """Join the cluster at `address` (or start a local one of LOCAL_CPUS) and check that every
    alive node runs this kvfuzz; RayError (exit 2) otherwise, before any work."""
    require("ray", INSTALL, "--ray")
    if address not in (None, "auto"):
        _reachable(address)
    import ray

    options: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING,
                                   runtime_env=env)
    try:
        if address is None:
            ray.init(address="local", num_cpus=LOCAL_CPUS, **options)
        else:
            ray.init(address=address, **options)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError from ray.init
        raise RayError(f"cannot connect to the Ray cluster at {address or 'a new local one'}: "
                       f"{type(exc).__name__}: {exc}") from None
    try:
        _probe_nodes(address)
    except BaseException:
        ray.shutdown()
        raise


def _version_here() -> str:
    """Runs on a node: the kvfuzz version it imports (and the campaign code it will run)."""
    import kvfuzz
    import kvfuzz.fuzz.campaign  # noqa: F401  (what every batch task imports)

    return kvfuzz.__version__


def _probe_nodes(address: str | None) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_version_here)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {n["NodeManagerAddress"]: probe.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes}
    for where, ref in refs.items():
        try:
            version = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # RayTaskError (its cause: no kvfuzz), GetTimeoutError
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RayError(f"the Ray node {where} cannot run kvfuzz ({cause}): "
                           + shipping_hint(address)) from None
        if version != __version__:
            raise RayError(f"the Ray node {where} has kvfuzz {version}, this driver "
                           f"{__version__}: " + shipping_hint(address))


_runner: dict[str, Any] = {}
"""This worker process's `BatchRunner`, under the repr of the options it was made for."""


def _run_batch_task(options: Any, batch: Any) -> Any:
    """The Ray task: one batch, in a worker process of any node (which keeps one BatchRunner
    per campaign, as a `--workers` process does)."""
    key = repr(options)
    if key not in _runner:
        from kvfuzz.fuzz.campaign import BatchRunner
        from kvfuzz.fuzz.plugins import import_plugins

        import_plugins(options.plugins)
        _runner.clear()
        _runner[key] = BatchRunner(options)
    return _runner[key](batch)


@dataclass
class RayBackend:
    """The scheduler's backend on Ray (`kvfuzz.fuzz.schedule.Backend`); `connect` first."""

    options: Any
    capacity: int = 0
    running: dict[Any, Any] = field(default_factory=dict)
    """Ray object ref -> the batch it computes."""

    def __post_init__(self) -> None:
        import ray

        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.capacity = self.capacity or max(1, cpus) * AHEAD
        self._options = ray.put(self.options)
        self._task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(_run_batch_task)

    def describe(self) -> str:
        import ray

        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        return (f"{self.capacity // AHEAD} CPUs on {nodes} node(s), "
                f"{self.capacity} batches in flight")

    def submit(self, batch: Any) -> None:
        self.running[self._task.remote(self._options, batch)] = batch

    def results(self, timeout: float) -> list[Any]:
        import ray

        if not self.running:
            return []
        refs = list(self.running)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else is done by now
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [self._get(ref) for ref in ready]

    def _get(self, ref: Any) -> Any:
        import ray
        from ray.exceptions import RayTaskError

        batch = self.running.pop(ref)
        try:
            return ray.get(ref)
        except RayTaskError as exc:  # kvfuzz or a plugin raised: an internal error (exit 3)
            raise exc.as_instanceof_cause() from None
        except ray.exceptions.RayError as exc:  # its worker or node died TASK_RETRIES times
            raise RuntimeError(f"batch {batch.index} ({batch.level}/{batch.config}, seed "
                               f"{batch.seed}) was lost {TASK_RETRIES + 1} times: "
                               f"{type(exc).__name__}: {exc}") from None

    def close(self, cancel: bool) -> list[Any]:
        """With `cancel`, interrupt the running tasks; the partial results they return come
        back, queued tasks are dropped. Disconnects (a local cluster stops)."""
        import ray

        done = []
        try:
            if cancel:
                for ref in self.running:
                    ray.cancel(ref)
            for ref in self.running:
                try:
                    done.append(ray.get(ref))
                except Exception:  # cancelled before it started, or lost: nothing to keep
                    continue
        finally:
            self.running.clear()
            ray.shutdown()
        return done
