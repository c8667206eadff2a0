"""A vLLM whose KV cache manager raises while it is built fails the campaign (check BUILD, exit
1): at the start, for one manager kind or for every one, and after the configs were probed.
Finding 012 is tolerated by `vllm` by its id and counted; `vllm-strict` reports it. Each
campaign runs in a fresh process, so that a plant (a plugin patching vLLM) ends with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuzz.harness.vllm_target import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM this adapter drives is importable"),
]

FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"
SINK_TYPE_ERROR = ("TypeError: SinkFullAttentionManager.__init__() got an unexpected keyword "
                   "argument 'needs_kv_cache_zeroing'")


def kvfuzz(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "VLLM_LOGGING_LEVEL": "ERROR",
           "TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "kvfuzz", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_strict_reports_the_sink_manager_it_cannot_build_and_vllm_tolerates_it(tmp_path):
    strict = kvfuzz(tmp_path, "run", "--target", "vllm-strict", "--config", "sink_full",
                    "--examples", "4", "--json", "s.json")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "[BUILD] 1 distinct" in strict.stdout and SINK_TYPE_ERROR in strict.stdout
    assert "single_type_kv_cache_manager.py" in strict.stdout  # vLLM's frame
    finding = json.loads((tmp_path / "s.json").read_text())["findings"][0]
    assert finding["check"] == "BUILD" and finding["ops"] == 0
    replay = kvfuzz(tmp_path, "replay", finding["file"])
    assert replay.returncode == 1 and SINK_TYPE_ERROR in replay.stdout, replay.stdout

    tolerant = kvfuzz(tmp_path, "run", "--target", "vllm", "--config", "sink_full",
                      "--examples", "4", "--json", "v.json")
    assert tolerant.returncode == 0, tolerant.stdout + tolerant.stderr
    assert "Traceback" not in tolerant.stderr
    assert "012 sink-full-attention-unbuildable: 0 example(s), config(s) left out: sink_full" \
        in tolerant.stdout
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["tolerated"] == {"012 sink-full-attention-unbuildable": {
        "examples": 0, "configs_left_out": ["sink_full"]}}
    assert SINK_TYPE_ERROR in report["configs_tolerated"]["sink_full"]["error"]


def test_tolerate_and_no_tolerate_move_a_deviation_between_the_targets(tmp_path):
    """A strict campaign goes past 012 with --tolerate; --no-tolerate makes `vllm` report it;
    replay of the documented finding follows the same options, and an unknown id is exit 2."""
    past = kvfuzz(tmp_path, "run", "--target", "vllm-strict", "--tolerate", "012", "--config",
                  "sink_full", "--examples", "4")
    assert past.returncode == 0 and "012 sink-full-attention-unbuildable" in past.stdout
    reported = kvfuzz(tmp_path, "run", "--target", "vllm", "--no-tolerate",
                      "sink-full-attention-unbuildable", "--config", "sink_full",
                      "--examples", "4")
    assert reported.returncode == 1 and "[BUILD]" in reported.stdout, reported.stdout
    trace = str(FINDINGS / "001-empty-window-entry.json")
    assert kvfuzz(tmp_path, "replay", trace, "--target", "vllm", "--no-tolerate", "001",
                  "--quiet").returncode == 1
    assert kvfuzz(tmp_path, "replay", trace, "--target", "vllm-strict", "--tolerate", "001",
                  "--quiet").returncode == 0
    unknown = kvfuzz(tmp_path, "run", "--target", "vllm", "--tolerate", "999")
    assert unknown.returncode == 2 and "no documented deviation '999'" in unknown.stderr


ONE_MANAGER = '''
from vllm.v1.core import single_type_kv_cache_manager as m

def broken(self, *args, **kwargs):
    raise RuntimeError("planted: SlidingWindowManager cannot be built")

m.SlidingWindowManager.__init__ = broken
'''

EVERY_MANAGER = '''
from vllm.v1.core import kv_cache_coordinator

kv_cache_coordinator.get_manager_for_kv_cache_spec = lambda *args, **kwargs: None
'''

AFTER_THE_PROBE = '''
from vllm.v1.core import kv_cache_utils

original = kv_cache_utils.FreeKVCacheBlockQueue.popleft
calls = []

def popleft(self):
    calls.append(1)
    if len(calls) > 200:  # past the configs' probes: broken from then on
        raise IndexError("planted: popleft broken")
    return original(self)

kv_cache_utils.FreeKVCacheBlockQueue.popleft = popleft
'''


@pytest.mark.parametrize("plant, needle", [
    (ONE_MANAGER, "RuntimeError: planted: SlidingWindowManager cannot be built"),
    (EVERY_MANAGER, "AttributeError"),
    (AFTER_THE_PROBE, "IndexError: planted: popleft broken"),
], ids=["one-manager", "every-manager", "after-the-probe"])
def test_a_planted_construction_error_fails_the_default_campaign(tmp_path, plant, needle):
    """The default campaign (every built-in config, both levels) with vLLM broken by a plugin
    exits 1 with a BUILD or CRASH finding naming vLLM's error, never 0 or 3."""
    (tmp_path / "plant.py").write_text(plant)
    run = kvfuzz(tmp_path, "run", "--target", "vllm", "--plugin", "plant", "--examples", "200",
                 "--json", "r.json")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    messages = [f["message"] for f in report["findings"]]
    assert any(needle in m for m in messages), messages
    # Only configs this release cannot take (an option it lacks) are left out, never one the
    # planted error broke.
    assert all("lacks it" in why for why in report["configs_left_out"].values()), report


def test_a_strict_campaign_goes_past_a_tolerated_deviation_to_the_next_bug(tmp_path):
    """`vllm-strict` stops at 013 (I16) on a Mamba align hybrid with prefill checkpoints; with
    --tolerate 001 013 it counts 013 as tolerated and reaches other findings, exit 1."""
    argv = ("run", "--target", "vllm-strict", "--config", "qwen3_5_checkpoint", "--level",
            "scheduler", "--examples", "600")
    plain = kvfuzz(tmp_path, *argv, "--corpus", "c1", "--json", "s1.json")
    assert plain.returncode == 1, plain.stdout + plain.stderr
    checks = {f["check"] for f in json.loads((tmp_path / "s1.json").read_text())["findings"]}
    assert "I16" in checks
    past = kvfuzz(tmp_path, *argv, "--tolerate", "001", "013", "--corpus", "c2",
                  "--json", "s2.json")
    assert past.returncode == 1, past.stdout + past.stderr
    report = json.loads((tmp_path / "s2.json").read_text())
    assert "I16" not in {f["check"] for f in report["findings"]} and report["findings"]
    assert report["tolerated"]["013 empty-state-entry"]["examples"] > 0
    assert "013 empty-state-entry:" in past.stdout
