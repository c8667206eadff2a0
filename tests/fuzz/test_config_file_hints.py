"""A config file's mistakes are said helpfully: a misspelt field or kind gets "did you mean",
and a pool that cannot hold one request of max_model_len is warned about."""

from pathlib import Path

import pytest

from kvfuzz.core.config_file import load_config_file, too_small_pool
from kvfuzz.core.errors import ConfigError
from kvfuzz.fuzz.cli import main

BASE = 'name = "mine"\nnum_blocks = {n}\nmax_model_len = 512\n\n[[groups]]\nkind = "{kind}"\n' \
       'block_size = 16\n'


def test_misspelt_field_and_kind(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("watermak = 0.1\n" + BASE.format(n=64, kind="full"))
    with pytest.raises(ConfigError, match=r"'watermak' \(did you mean 'watermark'\?\)"):
        load_config_file(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text(BASE.format(n=64, kind="sliding_windw"))
    with pytest.raises(ConfigError, match=r"did you mean 'sliding_window'\?"):
        load_config_file(tmp_path / "b.toml")


def test_pool_too_small_for_one_request(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "small.toml").write_text(BASE.format(n=20, kind="full"))
    config = load_config_file(tmp_path / "small.toml")
    assert "needs at least 32 blocks, the pool has 19 usable" in too_small_pool(config)
    main(["run", "--config-file", str(tmp_path / "small.toml"), "--examples", "4", "--corpus",
          str(tmp_path / "c")])
    assert "warning: --config-file" in capsys.readouterr().out
    (tmp_path / "ok.toml").write_text(BASE.format(n=33, kind="full"))
    assert too_small_pool(load_config_file(tmp_path / "ok.toml")) is None
