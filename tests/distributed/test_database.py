"""The example database named by a string: local, shared Redis, read-only views, degradation."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.database import DatabaseError, open_database, parse

BUG = ("--target", "bug:free-forgets-decrement")


def run(tmp_path, *argv: str) -> int:
    return main(["run", "--config", "full", "--level", "api", "--corpus", str(tmp_path / "c"),
                 *argv])


@pytest.mark.parametrize("spec, needle", [
    ("", "names no location"),
    ("readonly:", "names no location"),
    ("redis://localhost:99999/0", "out of range"),
    ("redis://localhost:6379/zero", "must be a number, got 'zero'"),
    ("s3://bucket/db", "unknown scheme 's3'"),
])
def test_a_malformed_spec_is_rejected_naming_it(spec, needle):
    with pytest.raises(DatabaseError, match=needle):
        parse(spec)


def test_a_password_is_never_shown():
    part = parse("readonly:redis://:s3cret@db.example:6380/2")
    assert part.readonly and part.shared and part.shown == "redis://db.example:6380/2"


def test_an_unreachable_redis_is_exit_2_before_any_work(tmp_path, capsys, unused_port):
    address = f"redis://127.0.0.1:{unused_port}/0"
    assert run(tmp_path, "--examples", "5", "--database", address) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the example database {address}" in err and "ConnectionError" in err
    assert not (tmp_path / "c").exists()


def test_a_second_campaign_on_the_same_redis_finds_the_first_ones_failure_at_once(
        tmp_path, redis_server):
    """One example (Hypothesis' simplest) misses the planted bug; sharing the first campaign's
    Redis database, a campaign elsewhere (its own corpus, another seed) finds it at once."""
    first, second, alone = (tmp_path / name for name in ("first", "second", "alone"))
    assert main(["run", *BUG, "--config", "full", "--level", "api", "--examples", "10",
                 "--seed", "1", "--corpus", str(first), "--database", redis_server.url]) == 1
    assert redis_server.client().keys("hypothesis-example:*")
    assert main(["run", *BUG, "--config", "full", "--level", "api", "--examples", "1",
                 "--seed", "2", "--corpus", str(alone)]) == 0
    assert main(["run", *BUG, "--config", "full", "--level", "api", "--examples", "1",
                 "--seed", "2", "--corpus", str(second), "--database", redis_server.url]) == 1
    assert len(list(second.glob("*.json"))) == 1


def test_a_read_only_view_replays_but_writes_nothing(tmp_path, redis_server):
    client = redis_server.client()
    assert run(tmp_path, *BUG, "--examples", "1", "--seed", "2",
               "--database", "readonly:" + redis_server.url) == 0
    assert run(tmp_path, *BUG, "--examples", "10", "--seed", "1",
               "--database", "readonly:" + redis_server.url,
               "--database", str(tmp_path / "local")) == 1
    assert not client.keys("*") and any(p.is_file() for p in (tmp_path / "local").rglob("*"))
    assert run(tmp_path, *BUG, "--examples", "10", "--seed", "1",
               "--database", redis_server.url) == 1
    assert run(tmp_path, *BUG, "--examples", "1", "--seed", "2",
               "--database", "readonly:" + redis_server.url) == 1


def test_a_lost_redis_degrades_to_the_local_part_with_one_warning(tmp_path, redis_server):
    warnings: list[str] = []
    db = open_database([redis_server.url, str(tmp_path / "local")], warn=warnings.append)
    db.save(b"k", b"before")
    assert set(redis_server.client().smembers("hypothesis-example:k")) == {b"before"}
    redis_server.stop()
    db.save(b"k", b"after")
    db.save(b"k", b"later")
    assert set(db.fetch(b"k")) == {b"before", b"after", b"later"}
    assert len(warnings) == 1
    assert f"example database {parse(redis_server.url).shown} lost" in warnings[0]
    assert str(tmp_path / "local") in warnings[0]


def test_a_lost_redis_alone_goes_on_in_memory(redis_server):
    warnings: list[str] = []
    db = open_database([redis_server.url], warn=warnings.append)
    redis_server.stop()
    db.save(b"k", b"v")
    assert list(db.fetch(b"k")) == [b"v"]
    assert len(warnings) == 1 and "in-memory" in warnings[0]


@pytest.mark.parametrize("backend", [(), ("--workers", "2"), ("--ray",)],
                         ids=["one-process", "workers-2", "ray"])
def test_redis_vanishing_mid_campaign_warns_once_and_keeps_the_findings(tmp_path, redis_server,
                                                                        backend):
    """The server is killed once the campaign has saved its first failing example there: the
    campaign warns once (not once per process: workers stay quiet, the driver pings the server
    itself), goes on with the local database, and its finding is in the corpus."""
    if "--ray" in backend:
        pytest.importorskip("ray")
    local, corpus = tmp_path / "local", tmp_path / "c"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfuzz", "run", *BUG, "--config", "full", "--level", "api",
         "--seconds", "15", "--corpus", str(corpus), "--database", redis_server.url,
         "--database", str(local), *backend],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = redis_server.client()
    deadline = time.monotonic() + 180
    while not client.keys("hypothesis-example:*"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    redis_server.stop()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert err.count("kvfuzz: warning: example database") == 1, err
    assert "going on with the local database" in err
    assert len(list(corpus.glob("*.json"))) >= 1
    assert any(p.is_file() for p in local.rglob("*"))


PYTEST_PROBE = '''
from hypothesis import Phase, settings
from kvfuzz.testing import machine_for

TestBug = machine_for("api", targets=("bug:free-forgets-decrement",),
                      config_names=("full",)).TestCase
# The plugin's database kept; no shrinking (slow here, and not what is tested).
TestBug.settings = settings(TestBug.settings, phases=[Phase.generate])


def test_the_database_is_hypothesis_default():
    print("database", TestBug.settings.database, TestBug.settings.database is settings().database)
'''


def _pytest(tmp_path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PYTEST_PROBE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_probe.py",
         *args], cwd=tmp_path, env={**os.environ, "KVFUZZ_PROFILE": "ci", **env},
        capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("how", ["option", "env"])
def test_the_pytest_machines_share_the_redis_database(tmp_path, redis_server, how):
    """The same spec through the plugin: the machines (and Hypothesis' default settings, as
    HypoFuzz needs) use the shared database, and a failure lands in Redis."""
    shown = parse(redis_server.url).shown
    args, env = ((("--kvfuzz-database", redis_server.url), {}) if how == "option"
                 else ((), {"KVFUZZ_DATABASE": f"{redis_server.url},{tmp_path / 'local'}"}))
    run = _pytest(tmp_path, *args, env=env)
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert f"database SharedDatabase({shown}" in run.stdout and "True" in run.stdout
    assert redis_server.client().keys("hypothesis-example:*")


def test_an_unreachable_redis_is_a_pytest_usage_error(tmp_path, unused_port):
    address = f"redis://127.0.0.1:{unused_port}/0"
    run = _pytest(tmp_path, "--kvfuzz-database", address, env={})
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert f"cannot reach the example database {address}" in run.stderr
