"""The benchmark runner runs the benchmarks end to end.

Tiny sizes (``--smoke``): this checks that they run and write well-formed
results, never how fast anything is.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmarks.bench_controller import CALL_VERBS

ROOT = Path(__file__).resolve().parent.parent


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(90)
def test_runner_writes_transfer_and_controller_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--only",
            "transfer,controller",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "total wall time" in proc.stdout

    transfer = json.loads((tmp_path / "transfer.json").read_text())
    assert transfer["torch_threads"] >= 1
    assert {r["page_size"] for r in transfer["engine"]} == {1, 16, 64}
    assert {r["host_layout"] for r in transfer["engine"]} == {"layer_first", "page_first"}
    assert {r["pattern"] for r in transfer["engine"]} == {
        "contiguous",
        "scattered",
        "host_scattered",
    }
    for r in transfer["engine"]:
        for key in ("backup_gbps", "load_gbps", "memcpy_gbps", "backup_ratio", "load_ratio"):
            assert _positive(r[key]), (key, r)
    for r in transfer["controller"]:
        for key in ("backup_gbps", "load_back_gbps", "backup_ratio", "load_back_ratio"):
            assert _positive(r[key]), (key, r)
    assert [p["pages"] for p in transfer["scaling"]["points"]] == [1, 4, 16, 64, 256]
    assert all(_positive(p["engine_backup_s"]) for p in transfer["scaling"]["points"])
    assert set(transfer["scaling"]["fit"]["controller_load_back_s"]) == {
        "seconds_per_page",
        "fixed_seconds",
        "r2",
    }
    assert (tmp_path / "transfer.png").stat().st_size > 0

    controller = json.loads((tmp_path / "controller.json").read_text())
    assert sorted(
        (r["page"], r["op"], r["in_flight"], r["loop"]) for r in controller["rates"]
    ) == sorted(
        (page, op, n, loop)
        for page in ("16 KiB", "768 KiB", "4 MiB")
        for op in ("write", "load")
        for n in (1, 8)
        for loop in ("asyncio", "uvloop")
    )
    for r in controller["rates"]:
        assert _positive(r["async_ops_per_s"]) and _positive(r["floor_ops_per_s"]), r
        assert r["copies_off_loop"] == (r["page"] == "4 MiB"), r
    for lag in [*controller["lag"].values(), *controller["lag_small_pages"].values()]:
        assert lag["ticks"] > 0 and _positive(lag["round_trip_s"])
        assert lag["lag_p50_ms"] <= lag["lag_p99_ms"] <= lag["lag_max_ms"]
    assert {v["page_bytes"] for v in controller["lag_small_pages"].values()} == {16384}
    calls = controller["calls_ms"]["median_ms"]
    assert set(calls) == {"16 KiB", "768 KiB"}
    for verbs in calls.values():
        assert set(verbs) == set(CALL_VERBS)
        assert all(_positive(ms) for ms in verbs.values()), verbs
    longest = [h for h in controller["headline"] if h["name"].startswith("longest")]
    assert sorted(h["value"] for h in longest) == sorted(max(v.values()) for v in calls.values())
    assert (tmp_path / "controller.png").stat().st_size > 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [b["name"] for b in summary["benchmarks"]] == ["transfer", "controller"]
    assert all(b["status"] == "ok" for b in summary["benchmarks"])
    heads = [h for b in summary["benchmarks"] for h in b["headline"]]
    assert summary["targets_total"] == len(heads) > 0
    for h in heads:
        assert {"name", "value", "target", "op", "passed"} <= set(h)
        assert isinstance(h["passed"], bool)


@pytest.mark.timeout(120)
def test_runner_writes_storage_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--only",
            "storage",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    storage = json.loads((tmp_path / "storage.json").read_text())
    head = storage["headline_cell"]
    assert (head["page"], head["batch"], head["concurrency"]) == ("768 KiB", 128, 1)
    for key in ("write_vs_plain", "read_vs_plain", "write_vs_seq", "read_vs_seq"):
        assert _positive(head[key]), key
    assert {r["page"] for r in storage["grid"]} == {"64 KiB", "768 KiB", "2 MiB"}
    for r in storage["grid"]:
        assert _positive(r["file_read_gbps"]) and _positive(r["plain_write_gbps"]), r
    names = [h["name"] for h in storage["headline"]]
    assert any("one-file-per-page read" in n for n in names)
    assert any("sequential write" in n for n in names)
    assert (tmp_path / "storage.png").stat().st_size > 0
    assert (tmp_path / "storage_grid.png").stat().st_size > 0


@pytest.mark.timeout(150)
def test_runner_writes_e2e_and_scaling_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--only",
            "e2e,scaling",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    e2e = json.loads((tmp_path / "e2e.json").read_text())
    configs = e2e["demo"]["configs"]
    assert list(configs) == ["no_cache", "device", "device_host", "all_tiers"]
    assert e2e["demo"]["tokens_identical"] is True
    for c in configs.values():
        assert c["ttft_p50_ms"] <= c["ttft_p90_ms"], c
        assert _positive(c["ttft_mean_ms"]), c
    assert configs["all_tiers"]["prefill_tokens"] < configs["no_cache"]["prefill_tokens"]
    rows = e2e["sweep"]["rows"]
    assert [r["prefix_tokens"] for r in rows] == [64, 128]
    for r in rows:
        for key in ("recompute_ttft_s", "device_ttft_s", "host_ttft_s", "storage_ttft_s"):
            assert _positive(r[key]), (key, r)
        for tier in ("device", "host", "storage"):
            assert r[f"{tier}_ratio"] == pytest.approx(r["recompute_ttft_s"] / r[f"{tier}_ttft_s"])
            assert r[f"{tier}_logits_max_abs_diff"] < 1e-3, (tier, r)
        assert r["storage_bytes_read"] > 0
    assert set(e2e["sweep"]["crossover"]) == {"device", "host", "storage"}
    assert (tmp_path / "e2e.png").stat().st_size > 0

    scaling = json.loads((tmp_path / "scaling.json").read_text())
    trees = scaling["match_vs_tree"]
    assert [t["tree_tokens"] >= t["target_tokens"] for t in trees] == [True, True]
    assert trees[0]["tree_tokens"] < trees[1]["tree_tokens"]
    assert all(t["path_nodes"] == trees[0]["path_nodes"] for t in trees)
    assert all(_positive(t["match_s"]) and _positive(t["miss_s"]) for t in trees)
    points = scaling["match_vs_prompt_length"]["points"]
    assert [p["prompt_tokens"] for p in points] == [128, 512, 1024]
    assert all(_positive(p["match_s"]) for p in points)
    memory = {m["page_size"]: m for m in scaling["memory"]}
    assert set(memory) == {1, 16, 64}
    for ps, m in memory.items():
        assert m["pages"] * ps == m["cached_tokens"] and m["nodes"] > 0
        assert _positive(m["bytes_per_page"]) and m["slot_bytes_per_page"] == 8 * ps
    # A page-size-1 index keeps a hash string per token: more per token than with 64-token pages.
    assert memory[1]["bytes_per_token"] > memory[64]["bytes_per_token"]
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert (tmp_path / "scaling_prompt.png").stat().st_size > 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [b["name"] for b in summary["benchmarks"]] == ["e2e", "scaling"]
    assert all(b["status"] == "ok" for b in summary["benchmarks"])


def test_runner_rejects_an_unknown_benchmark(tmp_path: Path) -> None:
    from benchmarks.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--only", "no_such_benchmark", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert not (tmp_path / "summary.json").exists()


def test_runner_reports_a_crash_and_a_missing_dependency_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.run as run

    def crash(quick: bool, out_dir: Path) -> dict[str, object]:
        raise ValueError("boom")

    def missing(quick: bool, out_dir: Path) -> dict[str, object]:
        raise ModuleNotFoundError("No module named 'some_optional_dep'", name="some_optional_dep")

    mods = {"crash": SimpleNamespace(main=crash), "missing": SimpleNamespace(main=missing)}
    monkeypatch.setattr(run, "discover", lambda: ["crash", "missing"])
    monkeypatch.setattr(run, "load", lambda name: mods[name])

    assert run.main(["--only", "missing", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["benchmarks"][0]["status"] == "skipped"
    assert "some_optional_dep" in summary["benchmarks"][0]["reason"]

    assert run.main(["--only", "crash,missing", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [b["status"] for b in summary["benchmarks"]] == ["failed", "skipped"]
    assert "boom" in summary["benchmarks"][0]["error"]


def test_a_paired_ratio_cancels_a_slow_round_that_a_ratio_of_medians_keeps() -> None:
    from benchmarks.common import paired_ratio

    # Both sides of round 1 and 2 ran on a machine twice as slow; the subject
    # is 1.25x as fast as its baseline in every round.
    baseline = [1.0, 2.0, 2.0]
    subject = [0.8, 1.6, 1.6]
    assert paired_ratio(baseline, subject) == pytest.approx(1.25)
    # A slow spell on the subject's side only, in one round out of three.
    subject = [0.8, 3.2, 1.6]
    assert paired_ratio(baseline, subject) == pytest.approx(1.25)
    # The ratio of medians pairs the baseline's slow round with a fast one.
    assert statistics.median(baseline) / statistics.median([0.8, 1.6, 0.8]) != pytest.approx(1.25)
    assert paired_ratio(baseline, [0.8, 1.6, 0.8]) == pytest.approx(1.25)
    # Series of different lengths are not paired: the ratio of their medians.
    assert paired_ratio([1.0, 3.0, 2.0], [1.0, 1.0]) == pytest.approx(2.0)
