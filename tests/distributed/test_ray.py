"""`kvfuzz run --ray`: batches as tasks of a real local Ray (2 CPUs), findings on the driver."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfuzz.fuzz.cli import main

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

REPO = Path(__file__).resolve().parents[2]
BUG = ("--target", "bug:free-forgets-decrement")
PAIRS = ("--config", "full", "sliding_window", "--level", "api", "scheduler")


def kvfuzz(tmp_path: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfuzz", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout, check=False)


def findings(report: Path) -> list[tuple[str, str, str, str]]:
    """(check, level, config, file name) of each finding of a JSON report."""
    data = json.loads(report.read_text())
    return sorted((f["check"], f["level"], f["config"], Path(f["file"]).name)
                  for f in data["findings"])


def test_an_unreachable_ray_address_is_exit_2_before_any_work(tmp_path, capsys, unused_port):
    address = f"127.0.0.1:{unused_port}"
    assert main(["run", "--ray", address, "--examples", "5", "--corpus",
                 str(tmp_path / "c")]) == 2
    out, err = capsys.readouterr()
    assert f"cannot reach the Ray cluster at {address}: ConnectionRefusedError" in err
    assert "kvfuzz run:" not in out
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv, needle", [
    (("--ray", "--workers", "2"), "--ray and --workers exclude each other"),
    (("--ray", "--engine", "atheris"), "--ray needs --engine hypothesis"),
    (("--ray-runtime-env", "{}"), "--ray-runtime-env needs --ray"),
    (("--ray", "--ray-runtime-env", "[1]"), "must be a JSON object, got '[1]'"),
    (("--ray", "no-port"), "expected HOST:PORT, ray://HOST:PORT or auto"),
])
def test_bad_ray_options_are_usage_errors(tmp_path, capsys, argv, needle):
    assert main(["run", *argv, "--examples", "5", "--corpus", str(tmp_path / "c")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_cluster_without_kvfuzz_is_exit_2_saying_how_to_ship_it(tmp_path,
                                                                   ray_head_without_kvfuzz):
    run = kvfuzz(tmp_path, "run", "--ray", ray_head_without_kvfuzz, "--examples", "5",
                 "--corpus", "c")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot run kvfuzz (ModuleNotFoundError: No module named 'kvfuzz')" in run.stderr
    assert "--ray-runtime-env" in run.stderr and '"pip"' in run.stderr
    assert '"py_modules"' in run.stderr
    assert not (tmp_path / "c").exists()
    # Shipped as the message says, from a wheel built here, the campaign runs on that node.
    source = tmp_path / "source"  # a build writes build/ into its source: build a copy
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".hypothesis", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True,
                   timeout=600)
    (wheel,) = (tmp_path / "dist").glob("kvfuzz-*.whl")
    env = json.dumps({"py_modules": [str(wheel)]})
    run = kvfuzz(tmp_path, "run", "--ray", ray_head_without_kvfuzz, "--ray-runtime-env", env,
                 "--examples", "4", "--config", "full", "--corpus", "c")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ray: 1 CPUs on 1 node(s)" in run.stdout


def test_a_ray_campaign_runs_the_same_batches_and_findings_as_one_process(tmp_path):
    """Same seed and options: the same examples and the same (shrunk, deduplicated) findings
    in the driver's corpus, whether one process or Ray's 2 CPUs run the batches."""
    common = ("run", *BUG, *PAIRS, "--examples", "60", "--seed", "5")
    alone = kvfuzz(tmp_path, *common, "--corpus", "one", "--json", "one.json")
    on_ray = kvfuzz(tmp_path, *common, "--ray", "--corpus", "ray", "--json", "ray.json")
    assert alone.returncode == 1, alone.stdout + alone.stderr
    assert on_ray.returncode == 1, on_ray.stdout + on_ray.stderr
    assert "seed 5, Ray, engine hypothesis" in on_ray.stdout
    assert "ray: 2 CPUs on 1 node(s)" in on_ray.stdout
    one, ray_report = (json.loads((tmp_path / n).read_text()) for n in ("one.json", "ray.json"))
    assert ray_report["ray"] == "local" and one["ray"] is None
    assert ray_report["examples"] == one["examples"] == 60
    assert ray_report["operations"] == one["operations"]
    assert findings(tmp_path / "ray.json") == findings(tmp_path / "one.json")
    assert sorted(p.name for p in (tmp_path / "ray").glob("*.json")) == sorted(
        p.name for p in (tmp_path / "one").glob("*.json"))


def _batch_workers(driver: int) -> list[psutil.Process]:
    """The Ray worker processes under `driver` that are running a batch now."""
    try:
        children = psutil.Process(driver).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    running = []
    for child in children:
        try:
            if "_run_batch_task" in " ".join(child.cmdline()):
                running.append(child)
        except psutil.Error:
            continue
    return running


def test_a_killed_ray_worker_loses_no_finding(tmp_path):
    """SIGKILL to a worker in the middle of its batch: Ray reruns the batch, and the campaign
    ends with every example and every finding of the same campaign left alone."""
    common = ("run", *BUG, *PAIRS, "--examples", "120", "--seed", "7")
    reference = kvfuzz(tmp_path, *common, "--corpus", "one", "--json", "one.json")
    assert reference.returncode == 1, reference.stdout + reference.stderr
    driver = subprocess.Popen([sys.executable, "-m", "kvfuzz", *common, "--ray", "--corpus",
                               "ray", "--json", "ray.json"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = []
    deadline = time.monotonic() + 300
    while not killed and driver.poll() is None and time.monotonic() < deadline:
        for worker in _batch_workers(driver.pid):
            worker.send_signal(signal.SIGKILL)
            killed.append(worker.pid)
            break
        time.sleep(0.05)
    out, err = driver.communicate(timeout=600)
    assert killed, "no batch was seen running: the campaign ended first\n" + out + err
    assert driver.returncode == 1, out + err
    report = json.loads((tmp_path / "ray.json").read_text())
    assert report["examples"] == 120
    assert findings(tmp_path / "ray.json") == findings(tmp_path / "one.json")


def test_ctrl_c_cancels_the_ray_tasks_and_keeps_the_findings(tmp_path):
    driver = subprocess.Popen(
        [sys.executable, "-m", "kvfuzz", "run", *BUG, *PAIRS, "--seconds", "300", "--ray",
         "--corpus", "c", "--json", "r.json"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "c").glob("*.json")):
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
        time.sleep(0.2)
    os.kill(driver.pid, signal.SIGINT)
    start = time.monotonic()
    out, err = driver.communicate(timeout=120)
    assert time.monotonic() - start < 60
    assert driver.returncode == 1, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and report["findings"]
    assert all((tmp_path / f["file"]).is_file() for f in report["findings"])
    assert "interrupted" in out
