"""The benchmark runner runs the transfer and controller benchmarks end to end.

Tiny sizes (``--smoke``): this checks that they run and write well-formed
results, never how fast anything is.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

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
    assert {r["pattern"] for r in transfer["engine"]} == {"contiguous", "scattered"}
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
    assert {(r["op"], r["in_flight"], r["loop"]) for r in controller["rates"]} == {
        (op, n, loop) for op in ("write", "load") for n in (1, 8) for loop in ("asyncio", "uvloop")
    }
    for r in controller["rates"]:
        assert _positive(r["async_ops_per_s"]) and _positive(r["threaded_ops_per_s"]), r
    for lag in controller["lag"].values():
        assert lag["ticks"] > 0 and _positive(lag["round_trip_s"])
        assert lag["lag_p50_ms"] <= lag["lag_p99_ms"] <= lag["lag_max_ms"]
    assert (tmp_path / "controller.png").stat().st_size > 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [b["name"] for b in summary["benchmarks"]] == ["transfer", "controller"]
    assert all(b["status"] == "ok" for b in summary["benchmarks"])
    heads = [h for b in summary["benchmarks"] for h in b["headline"]]
    assert summary["targets_total"] == len(heads) > 0
    for h in heads:
        assert {"name", "value", "target", "op", "passed"} <= set(h)
        assert isinstance(h["passed"], bool)


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
