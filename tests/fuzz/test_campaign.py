"""Campaign work: one schedule reaching every (level, config) pair, workers that die with their
parent, one finding per bug, nothing lost to an interrupt, shrinks that keep the failure."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfuzz.core.configs import BUILTIN
from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.campaign import STOP_REQUESTED, interrupt, stop_point
from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.schedule import FIRST_BATCH, Schedule
from kvfuzz.fuzz.shrink import shrink_trace
from kvfuzz.harness.executor import CRASH, run_trace
from kvfuzz.harness.kvcache_target import KvcacheSide

REPO = Path(__file__).resolve().parents[2]
ALL_PAIRS = {(level, name) for name in BUILTIN for level in ("api", "scheduler")}


def test_the_schedule_reaches_every_pair_before_any_gets_a_second_batch():
    pairs = [("api", "a"), ("scheduler", "a"), ("api", "b")]
    schedule = Schedule(pairs, seed=0)
    first = [schedule.next_batch() for _ in pairs]
    assert [b.pair for b in first] == pairs and {b.examples for b in first} == {FIRST_BATCH}
    assert len({b.seed for b in first}) == 3 and [b.index for b in first] == [0, 1, 2]
    again = Schedule(pairs, seed=0)
    assert [again.next_batch() for _ in pairs] == first
    assert Schedule(pairs, seed=1).next_batch().seed != first[0].seed


def test_an_examples_budget_is_shared_out_and_the_rest_named():
    pairs = [("api", str(i)) for i in range(5)]
    schedule = Schedule(pairs, seed=0, examples=23)
    batches = list(iter(schedule.next_batch, None))
    per_pair = {p: sum(b.examples for b in batches if b.pair == p) for p in pairs}
    assert sorted(per_pair.values()) == [4, 4, 5, 5, 5] and sum(per_pair.values()) == 23
    short = Schedule(pairs, seed=0, examples=3)
    assert [b.pair for b in iter(short.next_batch, None)] == pairs[:3]


def test_a_short_examples_budget_names_the_pairs_it_did_not_reach(tmp_path, capsys):
    report = tmp_path / "r.json"
    code = main(["run", "--examples", "5", "--corpus", str(tmp_path / "c"),
                 "--json", str(report)])
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    pairs = len(ALL_PAIRS)
    assert code == 0 and data["pairs"] == pairs and data["pairs_reached"] == 5
    assert len(data["unreached"]) == pairs - 5 and data["under_10_examples"][:1] == ["api/full"]
    assert (f"{pairs - 5} of {pairs} pairs not reached (no example): scheduler/sliding_window, "
            "api/chunked_local") in out


def test_ten_seconds_touch_every_built_in_pair_or_name_the_rest(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["run", "--seconds", "10", "--corpus", str(tmp_path / "c"),
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    data = json.loads(report.read_text())
    reached = {(r["level"], r["config"]) for r in data["by_config"] if r["examples"]}
    named = {tuple(p.split("/")) for p in data["unreached"]}
    assert reached | named == ALL_PAIRS and not reached & named
    assert data["pairs_reached"] == len(reached)
    unreached = data["unreached"]
    for pair in unreached[:8]:  # the summary names eight and counts the rest
        assert pair in out
    if len(unreached) > 8:
        assert f"{len(unreached)} of {len(ALL_PAIRS)} pairs not reached" in out
        assert f"(+{len(unreached) - 8} more)" in out
    assert f"pairs {len(reached)}/{len(ALL_PAIRS)}" in out and "left" in out


def test_the_same_batches_whatever_the_number_of_workers(tmp_path):
    reports = []
    for workers in ("1", "2"):
        path = tmp_path / f"r{workers}.json"
        main(["run", "--examples", "200", "--config", "full", "hybrid", "--workers", workers,
              "--corpus", str(tmp_path / "c"), "--json", str(path)])
        reports.append(json.loads(path.read_text()))
    keys = ("examples", "operations", "invariant_checks", "coverage", "by_config")
    assert [reports[0][k] for k in keys] == [reports[1][k] for k in keys]


def _files(corpus: Path) -> list[Path]:
    return sorted(corpus.glob("*.json"))


def test_two_workers_save_each_bug_once_and_a_second_run_adds_nothing(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    old = os.umask(0o022)
    try:
        argv = ["run", "--target", "bug:free-forgets-decrement", "--config", "full", "hybrid",
                "eagle", "--workers", "2", "--examples", "120", "--corpus", str(corpus)]
        assert main([*argv, "--json", str(tmp_path / "r1.json")]) == 1
    finally:
        os.umask(old)
    first = json.loads((tmp_path / "r1.json").read_text())
    keys = [f["key"] for f in first["findings"]]
    files = _files(corpus)
    assert len(keys) == len(set(keys)) == len(files) >= 1
    assert sorted(Trace.load(f).meta["dedup_key"] for f in files) == sorted(keys)
    assert all(Trace.load(f).meta["shrunk"] is True for f in files)
    assert sum(f["duplicates"] for f in first["findings"]) >= 1, first["findings"]
    groups = first["by_check"]
    assert sum(g["bugs"] for g in groups.values()) == len(keys)
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o644}
    assert stat.S_IMODE((tmp_path / "r1.json").stat().st_mode) == 0o644
    assert "duplicate(s)" in capsys.readouterr().out

    assert main([*argv, "--seed", "5", "--json", str(tmp_path / "r2.json")]) == 1
    second = json.loads((tmp_path / "r2.json").read_text())
    assert _files(corpus) == files
    assert second["findings"] and all(f["known"] for f in second["findings"])
    assert all(f["ops"] == len(Trace.load(f["file"]).ops) for f in second["findings"])
    assert "already in the corpus" in capsys.readouterr().out


SLOW_BUG = '''
import time
from kvfuzz.harness.targets import get_target, register_target

Base = get_target("bug:free-forgets-decrement").locate()


class Slow(Base):
    def apply(self, op):
        time.sleep(0.004)
        return super().apply(op)


register_target("slow-bug", "free-forgets-decrement, 4 ms an op: shrinking takes a while", Slow)
'''


def _kvfuzz(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))}
    return subprocess.Popen([sys.executable, "-m", "kvfuzz", "run", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigint_during_a_shrink_keeps_the_finding(tmp_path):
    (tmp_path / "slow_bug.py").write_text(SLOW_BUG)
    corpus = tmp_path / "corpus"
    proc = _kvfuzz(tmp_path, "--plugin", "slow_bug", "--target", "slow-bug", "--config", "full",
                   "--level", "api", "--seconds", "300", "--corpus", str(corpus),
                   "--json", str(tmp_path / "r.json"))
    deadline = time.monotonic() + 120
    raw = []
    while time.monotonic() < deadline and not raw and proc.poll() is None:
        time.sleep(0.05)
        raw = [f for f in _files(corpus) if Trace.load(f).meta.get("shrunk") is False]
    assert raw, "no raw finding appeared"
    raw_ops = len(Trace.load(raw[0]).ops)
    time.sleep(0.5)  # well into the shrink (hundreds of replays at 4 ms an op)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    report = json.loads((tmp_path / "r.json").read_text())
    [finding] = report["findings"]
    assert report["interrupted"] and finding["shrunk"] == "partial", out
    [saved] = _files(corpus)
    trace = Trace.load(saved)
    assert str(saved) == finding["file"] and trace.meta["shrunk"] == "partial"
    assert len(trace.ops) <= raw_ops and not raw[0].exists()
    assert run_trace(trace, ["bug:free-forgets-decrement"]).finding.check == finding["check"]
    assert "shrink interrupted" in out and "Traceback" not in out


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _gone(pids: list[int], seconds: float = 10) -> bool:
    """Whether every process in `pids` has exited within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("engine", ["hypothesis", "atheris"])
def test_workers_die_with_a_killed_parent(tmp_path, engine):
    if engine == "atheris":
        pytest.importorskip("atheris")
    proc = _kvfuzz(tmp_path, "--engine", engine, "--workers", "2", "--seconds", "300",
                   "--config", "full", "--corpus", str(tmp_path / "c"))
    deadline = time.monotonic() + 60
    kids: list[int] = []
    while time.monotonic() < deadline and len(kids) < 2:
        time.sleep(0.2)
        kids = _children(proc.pid)
    assert len(kids) >= 2, kids
    time.sleep(2)  # the workers are fuzzing
    proc.kill()
    proc.wait()
    assert _gone(kids)


class TwoCrashes(KvcacheSide):
    """kvcache that raises KeyError on a `free` of a request with a long prompt, and
    RuntimeError on any request with a prompt of at most two tokens."""

    name = "two-crashes"

    def apply(self, op):
        if op["op"] == "add_request":
            if len(op["prompt"]) <= 2:
                raise RuntimeError("short prompt")
            self.long = getattr(self, "long", set()) | {op["request_id"]}
        if op["op"] == "free" and op["request_id"] in getattr(self, "long", ()):
            raise KeyError(op["request_id"])
        return super().apply(op)


def test_a_shrink_keeps_the_same_crash_and_does_not_slip_into_another():
    config = BUILTIN["full"][1]
    ops = [{"op": "add_request", "request_id": "r0", "prompt": list(range(1, 9))},
           {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 8},
           {"op": "free", "request_id": "r0"}]
    trace = Trace(config, "api", ops)
    found = run_trace(trace, [TwoCrashes]).finding
    assert found.check == CRASH and found.signature[:2] == ("free", "KeyError")
    # Checking the check alone would slip: a smaller trace fails CRASH another way.
    other = Trace(config, "api", [{"op": "add_request", "request_id": "r0", "prompt": [1]}])
    assert run_trace(other, [TwoCrashes]).finding.signature[:2] == ("add_request",
                                                                    "RuntimeError")
    result = shrink_trace(trace, [TwoCrashes], seconds=30)
    assert result.finding.signature == found.signature
    assert result.finding.message.startswith("KeyError")
    assert result.trace.ops[-1]["op"] == "free"


def test_ctrl_c_with_workers_keeps_the_findings_and_stops_the_workers(tmp_path):
    _ctrl_c_once_found(tmp_path, 0.0, "--target", "bug:free-forgets-decrement", "--config",
                       "full")


def _ctrl_c_once_found(tmp_path: Path, wait: float, *args: str) -> None:
    """A `--workers 2` campaign, Ctrl-C `wait` s after its first finding is on disk: exit 1,
    interrupted, every finding in the report is the corpus, no traceback, no worker left."""
    corpus = tmp_path / "corpus"
    proc = _kvfuzz(tmp_path, *args, "--workers", "2", "--seconds", "300", "--corpus", str(corpus),
                   "--json", str(tmp_path / "r.json"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _files(corpus) and proc.poll() is None:
        time.sleep(0.05)
    kids = _children(proc.pid)
    time.sleep(wait)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    report = json.loads((tmp_path / "r.json").read_text())
    assert proc.returncode == 1 and report["interrupted"], out
    assert sorted(f["file"] for f in report["findings"]) == [str(f) for f in _files(corpus)]
    assert "Traceback" not in out
    assert _gone(kids)


def test_a_first_signal_asks_for_a_stop_and_a_second_interrupts_at_once():
    STOP_REQUESTED.clear()
    stop_point()  # nothing asked: goes on
    try:
        interrupt(signal.SIGINT, None)  # does not raise where the signal landed
        assert STOP_REQUESTED.is_set()
        with pytest.raises(KeyboardInterrupt):
            stop_point()
        with pytest.raises(KeyboardInterrupt):
            interrupt(signal.SIGINT, None)
    finally:
        STOP_REQUESTED.clear()


EXEC_SLOW_BUG = '''
from kvfuzz.harness.targets import get_target, register_target

Base = get_target("bug:free-forgets-decrement").locate()
SPIN = "import time\\nend = time.monotonic() + 0.004\\nwhile time.monotonic() < end:\\n    pass\\n"


class ExecSlow(Base):
    def apply(self, op):
        exec(SPIN, {})  # 4 ms inside a string exec, as while a dataclass is being made
        return super().apply(op)


register_target("exec-slow-bug", "free-forgets-decrement, 4 ms an op in a string exec", ExecSlow)
'''


def test_ctrl_c_inside_a_string_exec_of_the_shrink_exits_1_not_by_sigint(tmp_path):
    """A KeyboardInterrupt that ends a string `exec` makes CPython end `python -m kvfuzz` by
    SIGINT at exit (-2), even when the campaign caught it: Ctrl-C only asks the campaign to
    stop, and kvfuzz raises at its own stop points, never inside the code it runs."""
    (tmp_path / "exec_slow_bug.py").write_text(EXEC_SLOW_BUG)
    # 0.3 s: in the shrink, where nearly all of an op's time is inside the exec.
    _ctrl_c_once_found(tmp_path, 0.3, "--plugin", "exec_slow_bug", "--target", "exec-slow-bug",
                       "--config", "full", "--level", "api")


class TwoDiffs(KvcacheSide):
    """kvcache whose allocate_slots reports a wrong block table after any get_computed_blocks,
    and whose get_computed_blocks reports a field too many for a request of at most four
    tokens: two different disagreements with the model."""

    name = "two-diffs"

    def apply(self, op):
        result = super().apply(op)
        if op["op"] == "add_request" and len(op["prompt"]) <= 4:
            self.short = getattr(self, "short", set()) | {op["request_id"]}
        self.looked_up = getattr(self, "looked_up", False) or op["op"] == "get_computed_blocks"
        if (op["op"] == "allocate_slots" and self.looked_up and isinstance(result, dict)
                and "block_ids" in result):
            return {**result, "block_ids": [[99]]}
        if op["op"] == "get_computed_blocks" and op["request_id"] in getattr(self, "short", ()):
            return {**result, "stray": 1}
        return result


def test_a_shrink_keeps_the_same_difference_and_does_not_slip_into_another():
    config = BUILTIN["full"][1]
    ops = [{"op": "add_request", "request_id": "r0", "prompt": list(range(1, 9))},
           {"op": "add_request", "request_id": "r1", "prompt": list(range(1, 9))},
           {"op": "get_computed_blocks", "request_id": "r1"},
           {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 8}]
    found = run_trace(Trace(config, "api", ops), [TwoDiffs]).finding
    assert (found.check, found.signature) == ("DIFF-result", ("allocate_slots", "block_ids"))
    # Checking the check alone would slip: a shorter prompt for r1 fails another way, sooner.
    shorter = [ops[0], {**ops[1], "prompt": [1, 2, 3, 4]}, *ops[2:]]
    other = run_trace(Trace(config, "api", shorter), [TwoDiffs]).finding
    assert (other.check, other.signature) == ("DIFF-result", ("get_computed_blocks", "stray"))
    result = shrink_trace(Trace(config, "api", ops), [TwoDiffs], seconds=30)
    assert result.finding.signature == found.signature
    assert [op["op"] for op in result.trace.ops][-2:] == ["get_computed_blocks", "allocate_slots"]


class LenientCacheBlocks(KvcacheSide):
    """kvcache whose cache_blocks raises IndexError for a request holding blocks, and returns
    None, as vLLM does, for one holding none (API misuse, which kvcache and the model refuse)."""

    name = "lenient-cache-blocks"

    def apply(self, op):
        if op["op"] == "cache_blocks":
            held = self.snapshot().requests[op["request_id"]].tables != (None,)
            return {"error": "IndexError"} if held else None
        return super().apply(op)


def test_a_shrink_of_valid_use_does_not_slip_into_misuse_the_target_takes_silently():
    config = BUILTIN["full"][1]
    ops = [{"op": "add_request", "request_id": "r0", "prompt": list(range(1, 9))},
           {"op": "allocate_slots", "request_id": "r0", "num_new_tokens": 8},
           {"op": "cache_blocks", "request_id": "r0"}]
    found = run_trace(Trace(config, "api", ops), [LenientCacheBlocks]).finding
    assert (found.check, found.signature) == ("DIFF-result", ("cache_blocks", "result"))
    # Dropping the allocation fails the same way, but only as misuse: the model refuses it.
    misuse = run_trace(Trace(config, "api", [ops[0], ops[2]]), [LenientCacheBlocks])
    assert misuse.finding.signature == found.signature and misuse.misuse_ops == 1
    result = shrink_trace(Trace(config, "api", ops), [LenientCacheBlocks], seconds=30)
    assert [op["op"] for op in result.trace.ops] == ["add_request", "allocate_slots",
                                                     "cache_blocks"]
    assert run_trace(result.trace, [LenientCacheBlocks]).misuse_ops == 0
    # A trace that is misuse to begin with still shrinks as one.
    again = shrink_trace(Trace(config, "api", [ops[0], ops[2]]), [LenientCacheBlocks], seconds=30)
    assert again.finding.signature == found.signature
