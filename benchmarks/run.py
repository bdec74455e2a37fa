"""Run the benchmarks and write ``summary.json``.

Usage (from the repository root)::

    python -m benchmarks.run [--quick] [--only transfer,controller] [--out DIR]
    python benchmarks/run.py ...

Every ``benchmarks/bench_<name>.py`` module is a benchmark; its
``main(quick=..., out_dir=...)`` returns a dict and writes
``<out>/<name>.json`` (and a plot). The runner prints each benchmark's tables
and headline numbers, then the total wall time, and writes
``<out>/summary.json``: every headline number with its target and whether it
met it. Targets are reported, not asserted: the exit status is non-zero only
when a benchmark crashed. A benchmark whose optional dependency is missing (a
package that is not installed, a program such as ``redis-server``) is skipped
with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    BenchmarkSkipped,
    machine_info,
    print_table,
    write_result,
)

BENCH_DIR = Path(__file__).resolve().parent
#: Run first, in this order; any other ``bench_*.py`` follows alphabetically.
ORDER = ("transfer", "controller", "storage", "redis", "e2e", "scaling")
#: Modules of the project itself: failing to import one of them is a crash, not a skip.
OWN_MODULES = ("benchmarks", "tiercache")


def discover() -> list[str]:
    """Names of the benchmark modules (``bench_<name>.py`` -> ``name``), in run order."""
    found = sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))
    first = [n for n in ORDER if n in found]
    return first + [n for n in found if n not in first]


def load(name: str) -> ModuleType:
    """Import the benchmark module ``bench_<name>``."""
    return importlib.import_module(f"benchmarks.bench_{name}")


def _missing_optional(e: BaseException) -> str | None:
    """The reason to skip, when ``e`` says an optional dependency is missing; else ``None``."""
    if isinstance(e, BenchmarkSkipped):
        return str(e) or type(e).__name__
    if isinstance(e, ModuleNotFoundError):
        root = (e.name or "").split(".")[0]
        if root and root not in OWN_MODULES:
            return f"optional module {e.name!r} is not installed"
    return None


def _print_tables(result: dict[str, Any]) -> None:
    for key, value in result.items():
        if key.endswith("table") and isinstance(value, dict) and "columns" in value:
            if key != "table":
                print(f"[{key}]")
            print_table(value["columns"], value["rows"])


def _headlines(result: dict[str, Any]) -> list[dict[str, Any]]:
    heads = result.get("headline", [])
    if isinstance(heads, dict):
        heads = [heads]
    return [h for h in heads if isinstance(h, dict)]


def run_one(name: str, quick: bool, out_dir: Path, smoke: bool) -> dict[str, Any]:
    """Import and run one benchmark; returns its summary entry (status ok/skipped/failed)."""
    t0 = time.perf_counter()
    entry: dict[str, Any] = {"name": name}
    try:
        fn = load(name).main
        kwargs: dict[str, Any] = {"quick": quick or smoke, "out_dir": out_dir}
        if smoke and "smoke" in inspect.signature(fn).parameters:
            kwargs["smoke"] = True
        result = fn(**kwargs)
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        reason = _missing_optional(e)
        entry["elapsed_s"] = time.perf_counter() - t0
        if reason is not None:
            print(f"SKIPPED {name}: {reason}", flush=True)
            entry.update(status="skipped", reason=reason)
        else:
            traceback.print_exc()
            print(f"FAILED {name}: {e!r}", flush=True)
            entry.update(status="failed", error=repr(e))
        return entry
    entry["elapsed_s"] = time.perf_counter() - t0
    if not isinstance(result, dict):
        print(f"FAILED {name}: main() returned {type(result).__name__}, not a dict", flush=True)
        entry.update(status="failed", error="main() did not return a dict")
        return entry
    if result.get("skipped"):
        reason = str(result.get("reason", result["skipped"]))
        print(f"SKIPPED {name}: {reason}", flush=True)
        entry.update(status="skipped", reason=reason)
        return entry
    _print_tables(result)
    heads = _headlines(result)
    for h in heads:
        mark = "PASS" if h.get("passed") else "MISS"
        print(
            f"  {mark}  {h.get('name')}: {h.get('value', float('nan')):.3g} (target {h.get('op', '')} {h.get('target')})"
        )
    entry.update(status="ok", headline=heads)
    return entry


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks; returns the exit status (1 if any crashed)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, a few seconds each")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, only to check that everything runs"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated names, e.g. transfer,controller"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: benchmarks/results, or benchmarks/results/<mode> for "
        "--quick and --smoke, so a smoke run never overwrites full results)",
    )
    args = parser.parse_args(argv)

    available = discover()
    names = available
    if args.only:
        names = [n.strip().removeprefix("bench_") for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in available]
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; available: {available}")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    out_dir: Path = args.out or (RESULTS_DIR if mode == "full" else RESULTS_DIR / mode)
    out_dir.mkdir(parents=True, exist_ok=True)

    print(f"benchmarks ({mode}): {', '.join(names)} -> {out_dir}", flush=True)
    t0 = time.perf_counter()
    entries = []
    for name in names:
        print(f"\n== {name} ==", flush=True)
        entries.append(run_one(name, args.quick, out_dir, args.smoke))
        print(f"({name}: {entries[-1]['elapsed_s']:.1f} s)", flush=True)
    total = time.perf_counter() - t0

    heads = [h for e in entries for h in e.get("headline", [])]
    summary = {
        "mode": mode,
        "machine": machine_info(),
        "total_s": total,
        "benchmarks": entries,
        "targets_met": sum(1 for h in heads if h.get("passed")),
        "targets_total": len(heads),
    }
    write_result("summary", summary, out_dir)
    print("\n== summary ==")
    print_table(
        ["benchmark", "status", "seconds", "targets met"],
        [
            [
                e["name"],
                e["status"],
                e["elapsed_s"],
                f"{sum(1 for h in e.get('headline', []) if h.get('passed'))}/{len(e.get('headline', []))}",
            ]
            for e in entries
        ],
    )
    print(f"total wall time: {total:.1f} s; summary: {out_dir / 'summary.json'}")
    print(
        json.dumps(
            {"targets_met": summary["targets_met"], "targets_total": summary["targets_total"]}
        )
    )
    return 1 if any(e["status"] == "failed" for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
