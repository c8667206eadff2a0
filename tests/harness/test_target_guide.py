"""docs/targets.md's adapter works as it stands, and the startup check catches an adapter that
drops a request field the generator sets (the false findings it would cause, too)."""

import re
from pathlib import Path

import pytest

from kvfuzz.fuzz.cli import main
from kvfuzz.harness.target_check import dropped_fields
from kvfuzz.harness.targets import get_target

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "targets.md"


def _adapter() -> str:
    return re.search(r"```python\n(# my_target.py\n.*?)```", GUIDE.read_text(), re.S).group(1)


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    code = _adapter()
    (tmp_path / "my_target.py").write_text(code)
    lossy = code.replace('            prefix_cache_hit_limit=op["prefix_cache_hit_limit"],\n', "")
    assert lossy != code
    (tmp_path / "my_lossy.py").write_text(lossy.replace('"mine"', '"lossy"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_guide_adapter_runs_clean(plugins: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["run", "--plugin", "my_target", "--target", "mine", "--config", "full",
                 "hybrid", "sliding_window", "--examples", "150", "--corpus",
                 str(plugins / "c")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "warning:" not in out
    assert dropped_fields(get_target("mine")) == []


def test_a_dropped_field_is_warned_at_start(plugins: Path, capsys: pytest.CaptureFixture) -> None:
    main(["run", "--plugin", "my_lossy", "--target", "lossy", "--config", "full", "--level",
          "api", "--examples", "200", "--corpus", str(plugins / "c")])
    out = capsys.readouterr().out
    assert dropped_fields(get_target("lossy")) == ["prefix_cache_hit_limit"]
    assert "warning: target lossy's make_request drops prefix_cache_hit_limit" in out
    assert out.index("warning:") < out.index("summary")


def test_builtin_targets_drop_nothing() -> None:
    for name in ("kvcache", "bug:free-forgets-decrement"):
        assert dropped_fields(get_target(name)) == []
