"""A campaign's report: behaviours reached per pair and over time, the never-reached warnings of
a user's config file, the collapsed summary, the JSON that reruns a campaign, and the HTML page
rendered in a real headless browser (Chromium through Selenium)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from kvfuzz.fuzz.cli import main
from kvfuzz.fuzz.report import BEHAVIOURS, COLLAPSE_OVER, summary_lines

GEMMA = """
name = "gemma3-like"
num_blocks = 96
max_model_len = 256

[[groups]]
kind = "full"
block_size = 16

[[groups]]
kind = "sliding_window"
block_size = 16
sliding_window = 1024
"""
"""A window longer than the model: no block can ever leave it."""


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One small campaign over `full`, `sliding_window` and a Gemma-like config file, with
    its JSON and HTML reports and its printed summary."""
    where = tmp_path_factory.mktemp("campaign")
    (where / "gemma.toml").write_text(GEMMA)
    argv = ["run", "--config", "full", "sliding_window", "--config-file", str(where / "gemma.toml"),
            "--examples", "90", "--corpus", str(where / "corpus"), "--json",
            str(where / "r.json"), "--html", str(where / "r.html")]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return {"code": code, "out": out.getvalue(), "json": json.loads((where / "r.json").read_text()),
            "html": where / "r.html", "where": where}


def test_behaviours_reached_and_never_reached(campaign: dict) -> None:
    report = campaign["json"]
    rows = {f"{r['level']}/{r['config']}": r for r in report["by_config"]}
    assert campaign["code"] == 0
    # The built-in sliding window of a small pool leaves its window; the 1024 window never.
    assert "window_exit" in rows["api/sliding_window"]["reached"]
    assert "window_exit" in rows["api/gemma3-like"]["never"]
    assert "window_exit" not in rows["api/full"]["applies"]
    assert {"allocate_none", "preemption", "prefix_hit"} <= set(rows["api/full"]["reached"])
    assert "eviction" in rows["api/full"]["reached"]
    assert any("the sliding window of 1024 was never exceeded in" in w
               for w in report["warnings"])
    assert all("gemma3-like" in w for w in report["warnings"])  # built-ins are not warned
    first = report["first_reached"]["api/sliding_window"]["window_exit"]
    assert 0 <= first <= report["seconds"] + 1


def test_summary_names_gaps_and_warnings(campaign: dict) -> None:
    out = campaign["out"]
    assert "never reached (where it applies)" in out
    assert "a block left the window: api/gemma3-like" in out
    assert "warning: config gemma3-like (api level): the sliding window of 1024 was never " \
           "exceeded" in out
    assert "behaviours" in out.split("by config")[1].splitlines()[0]


def test_json_reruns_and_plots(campaign: dict) -> None:
    report = campaign["json"]
    assert report["options"]["examples"] == 90 and report["options"]["seed"] == 0
    assert report["options"]["configs"] == ["full", "sliding_window", "gemma3-like"]
    assert report["config_files"]["gemma3-like"]["groups"][1]["sliding_window"] == 1024
    assert report["started"].endswith("+00:00")
    assert report["features"] and all(isinstance(f, list) for f in report["features"])
    assert len(report["features"]) == report["coverage"]
    points = report["timeline"]
    assert points and points[-1]["examples"] == report["examples"]
    assert [p["seconds"] for p in points] == sorted(p["seconds"] for p in points)


def test_findings_carry_their_target(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["run", "--target", "bug:free-forgets-decrement", "--config", "full",
                 "--level", "api", "--examples", "40", "--corpus", str(tmp_path / "c"),
                 "--json", str(tmp_path / "r.json"), "--max-findings", "1"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    assert report["findings"][0]["target"] == "bug:free-forgets-decrement"
    assert report["timeline"][-1]["findings"] == 1


def test_summary_collapses_clean_pairs() -> None:
    rows = [{"level": "api", "config": f"c{i}", "examples": 10, "operations": 100,
             "findings": int(i == 3), "applies": ["preemption"],
             "reached": ["preemption"] if i % 2 else [], "never": [] if i % 2 else ["preemption"]}
            for i in range(COLLAPSE_OVER + 5)]
    lines = summary_lines(rows, [])
    table = lines[:lines.index("") if "" in lines else len(lines)]
    assert any(line.split()[:2] == ["api/c3", "10"] for line in lines)
    assert any(f"{COLLAPSE_OVER + 4} clean pairs" in line for line in lines)
    assert not any(line.strip().startswith("api/c4 ") for line in lines)
    assert len([line for line in table if line.startswith("  ")]) <= 4
    assert any(line.strip().startswith("a request was preempted: api/c0") for line in lines)


def test_every_behaviour_is_reached_somewhere(campaign: dict) -> None:
    """No behaviour is a dead name: each is reached by some built-in pair of a short run
    (copy-on-write and the hit limit need their configs)."""
    where = campaign["where"]
    assert main(["run", "--config", "full", "sliding_window", "partial_hits", "--examples",
                 "150", "--corpus", str(where / "c2"), "--json", str(where / "all.json")]) == 0
    report = json.loads((where / "all.json").read_text())
    reached = {n for r in report["by_config"] for n in r["reached"]}
    assert reached == {b.name for b in BEHAVIOURS}


# The page, in a real browser.

def _browser():
    """A headless Chromium driven by Selenium (skipped outside CI when either is missing;
    .ci/run installs both)."""
    chromium = (shutil.which("chromium") or shutil.which("chromium-browser")
                or shutil.which("google-chrome"))
    driver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
    except ImportError:
        webdriver = None
    if webdriver is None or not chromium or not driver:
        if os.environ.get("CI"):
            pytest.fail("the HTML report test needs selenium, chromium and chromedriver "
                        "(.ci/run installs them)")
        pytest.skip("selenium, chromium or chromedriver is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


def _page_errors(browser, path: Path) -> list[str]:
    """Load `path`; the JavaScript errors and failed loads the console reported."""
    browser.get(path.as_uri())
    return [entry["message"] for entry in browser.get_log("browser")
            if entry["level"] == "SEVERE"]


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    yield b
    b.quit()


def test_html_page_renders_in_a_browser(campaign: dict, browser) -> None:
    from selenium.webdriver.common.by import By

    assert _page_errors(browser, campaign["html"]) == []
    assert browser.execute_script("return document.body.dataset.ready") == "1"
    lines = browser.find_elements(By.CSS_SELECTOR, "#coverage-plot polyline.series")
    assert len(lines) == 2
    for line in lines:
        assert line.is_displayed() and len(line.get_attribute("points").split()) >= 2
        assert line.rect["width"] > 10
    bars = browser.find_elements(By.CSS_SELECTOR, "#pairs-plot rect.bar")
    assert len(bars) == len(campaign["json"]["by_config"])
    warnings = browser.find_element(By.ID, "warnings").text
    assert "the sliding window of 1024 was never exceeded" in warnings
    never = browser.find_elements(By.CSS_SELECTOR, "#behaviours td.never")
    assert never and all(cell.is_displayed() for cell in never)
    rows = browser.find_elements(By.CSS_SELECTOR, "#behaviours tbody tr")
    clean = [r for r in rows if r.get_attribute("data-never") == "0"]
    browser.find_element(By.ID, "gaps-only").click()  # the page's script hides full rows
    assert clean and not any(r.is_displayed() for r in clean)
    assert len([r for r in rows if r.is_displayed()]) == len(rows) - len(clean)


def test_html_findings_on_the_timeline(tmp_path: Path, browser) -> None:
    from selenium.webdriver.common.by import By

    main(["run", "--target", "bug:free-forgets-decrement", "--config", "full", "--level",
          "api", "--examples", "40", "--corpus", str(tmp_path / "c"), "--html",
          str(tmp_path / "r.html")])
    assert _page_errors(browser, tmp_path / "r.html") == []
    dots = browser.find_elements(By.CSS_SELECTOR, "#coverage-plot circle.finding")
    assert len(dots) == 1 and dots[0].is_displayed()
    assert "[P2]" in browser.find_element(By.ID, "findings").text


def test_browser_check_catches_a_script_error(campaign: dict, browser, tmp_path: Path) -> None:
    """The check above can fail: a page whose script throws is reported."""
    broken = tmp_path / "broken.html"
    broken.write_text(campaign["html"].read_text().replace(
        "document.body.dataset.ready = '1';", "document.body.dataset.ready = missing();"))
    errors = _page_errors(browser, broken)
    assert errors and "missing" in errors[0]
