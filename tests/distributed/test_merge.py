"""`kvfuzz merge`: the reports of parallel campaigns as one report and one corpus."""

from __future__ import annotations

import json

from kvfuzz.fuzz.cli import main

BUG = ("--target", "bug:free-forgets-decrement", "--config", "full", "--level", "api")


def test_two_campaigns_merge_into_one_report_with_one_finding_per_bug(tmp_path, capsys,
                                                                      monkeypatch):
    """Two jobs (seeds 1 and 3) find the same planted bug: the merged report sums their work
    and keeps the bug once, with the other as a duplicate, in one corpus."""
    reports = []
    for seed in ("1", "3"):
        job = tmp_path / f"job{seed}"
        job.mkdir()
        monkeypatch.chdir(job)
        assert main(["run", *BUG, "--examples", "20", "--seed", seed, "--corpus",
                     "kvfuzz-corpus", "--json", "kvfuzz-report.json"]) == 1
        reports.append(job / "kvfuzz-report.json")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["merge", *map(str, reports), "--corpus", "all", "--json", "all.json"]) == 1
    out = capsys.readouterr().out
    merged = json.loads((tmp_path / "all.json").read_text())
    singles = [json.loads(r.read_text()) for r in reports]
    assert merged["examples"] == sum(r["examples"] for r in singles) == 40
    assert merged["operations"] == sum(r["operations"] for r in singles)
    assert [(r["level"], r["config"], r["examples"], r["findings"])
            for r in merged["by_config"]] == [("api", "full", 40, 1)]
    assert len(merged["findings"]) == 1
    (bug,) = merged["findings"]
    assert bug["check"] == "P2" and bug["duplicates"] >= 1
    assert [p.name for p in (tmp_path / "all").iterdir()] == [bug["file"].split("/")[-1]]
    assert main(["replay", "--quiet", bug["file"]]) == 1
    assert "merged 2 reports: 40 examples" in out and "[P2] api/full" in out


def test_a_report_that_is_not_one_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "r.json"
    bad.write_text("[1, 2]")
    assert main(["merge", str(bad), "--corpus", str(tmp_path / "c")]) == 2
    assert "is not a `kvfuzz run --json` report" in capsys.readouterr().err
