"""What a finding says: the saved file keeps the shrunk trace's own message, and a duplicate
found on another config is named as such, not as the file's own trace."""

import json
from pathlib import Path

import pytest

from kvfuzz.core.trace import Trace
from kvfuzz.fuzz.cli import main
from kvfuzz.harness.executor import run_trace


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    where = tmp_path_factory.mktemp("findings")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", "--target", "bug:free-forgets-decrement", "--config", "full",
                     "hybrid", "sliding_window", "--level", "api", "--examples", "300",
                     "--corpus", str(where / "c"), "--json", str(where / "r.json")])
    return {"code": code, "out": out.getvalue(),
            "report": json.loads((where / "r.json").read_text())}


def test_saved_finding_keeps_the_shrunk_message(run: dict) -> None:
    assert run["code"] == 1
    for finding in run["report"]["findings"]:
        trace = Trace.load(finding["file"])
        replayed = run_trace(trace, [finding["target"]]).finding
        assert trace.meta["message"] == finding["message"] == replayed.message


def test_cross_config_duplicates_are_named(run: dict) -> None:
    p2 = [f for f in run["report"]["findings"] if f["check"] == "P2"][0]
    assert p2["elsewhere"] and f"{p2['level']}/{p2['config']}" not in p2["elsewhere"]
    assert f"also on {', '.join(p2['elsewhere'])}: other traces, not this file" in run["out"]
    assert "distinct," in run["out"] and "bug(s)" not in run["out"]


def test_shrink_writes_nothing_when_nothing_shrank(run: dict, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    saved = Path(run["report"]["findings"][0]["file"])
    copy = tmp_path / saved.name
    copy.write_text(saved.read_text())
    assert main(["shrink", str(copy)]) == 0
    assert "nothing to shrink" in capsys.readouterr().out
    assert sorted(tmp_path.iterdir()) == [copy]
    assert main(["shrink", str(copy), "--out", str(tmp_path / "o.json")]) == 0
    assert (tmp_path / "o.json").exists()


def test_replay_clips_big_pools(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = {"format": "kvfuzz-trace", "version": 1, "level": "api",
             "config": {"num_blocks": 3000, "groups": [{"kind": "full", "block_size": 4}]},
             "ops": [{"op": "add_request", "request_id": "A", "prompt": list(range(10))},
                     {"op": "allocate_slots", "request_id": "A", "num_new_tokens": 10},
                     {"op": "free", "request_id": "A"}]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    assert main(["replay", str(tmp_path / "t.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 400
    assert any("chars)" in line and "free_queue" in line for line in lines)
