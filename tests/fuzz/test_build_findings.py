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
