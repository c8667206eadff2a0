"""A target whose manager raises while it is built: a BUILD finding where the target says so
(`ManagerSide.build_errors_are_findings`, what the vLLM targets set), found, saved, replayed."""

import json
import subprocess
import sys
from pathlib import Path

LIBRARY_PLUGIN = '''
from kvfuzz.harness.kvcache_target import KvcacheSide
from kvfuzz.harness.targets import register_target


def library_builds(config):  # stands for the library under test
    if len(config.groups) > 1:
        raise KeyError("no manager for a second group")


class Fragile(KvcacheSide):
    name = "fragile"
    build_errors_are_findings = True

    def build_manager(self, config):
        library_builds(config)
        return super().build_manager(config)


register_target("fragile", "kvcache, whose library cannot build two groups", Fragile)
'''


def _kvfuzz(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfuzz", *argv], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path),
                               "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)


def test_a_library_error_building_the_manager_is_a_build_finding(tmp_path):
    (tmp_path / "fragile_plugin.py").write_text(LIBRARY_PLUGIN)
    run = _kvfuzz(tmp_path, "run", "--plugin", "fragile_plugin", "--target", "fragile",
                  "--config", "full", "hybrid", "--level", "api", "--examples", "20",
                  "--json", "r.json")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["configs"] == ["full", "hybrid"] and report["configs_left_out"] == {}
    [finding] = report["findings"]
    assert finding["check"] == "BUILD" and finding["config"] == "hybrid"
    assert finding["message"].startswith("KeyError: 'no manager for a second group' (raised at "
                                         "fragile_plugin.py:")
    replay = _kvfuzz(tmp_path, "replay", "--plugin", "fragile_plugin", finding["file"])
    assert replay.returncode == 1 and "[BUILD] the initial state on fragile" in replay.stdout


LACKING_PLUGIN = '''
from kvfuzz.core.errors import KvfuzzError
from kvfuzz.harness.kvcache_target import KvcacheSide
from kvfuzz.harness.targets import register_target


class Old(KvcacheSide):
    name = "old"
    build_errors_are_findings = True

    def build_manager(self, config):
        if config.watermark:
            raise KvfuzzError("the config sets watermark, which this release lacks")
        return super().build_manager(config)


register_target("old", "kvcache without the watermark", Old)
'''


def test_a_config_the_release_lacks_the_parts_for_is_a_skip_named_again_after_the_totals(
        tmp_path):
    """Not a finding: a usage error of that release (docs/vllm.md, per-release table); among
    the built-in configs it is left out and said twice, named it is exit 2."""
    (tmp_path / "old_plugin.py").write_text(LACKING_PLUGIN)
    run = _kvfuzz(tmp_path, "run", "--plugin", "old_plugin", "--target", "old", "--level", "api",
                  "--examples", "60", "--json", "r.json")
    assert run.returncode == 0, run.stdout + run.stderr
    said = ("config watermark left out: target old cannot build it here (the config sets "
            "watermark, which this release lacks)")
    assert run.stdout.count(said) == 2, run.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert "watermark" in report["configs_left_out"] and "watermark" not in report["configs"]
    named = _kvfuzz(tmp_path, "run", "--plugin", "old_plugin", "--target", "old", "--config",
                    "watermark", "--examples", "2")
    assert named.returncode == 2 and "which this release lacks" in named.stderr
