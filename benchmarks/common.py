"""Helpers shared by every benchmark: machine info, timing, results, tables and plots.

A benchmark module ``benchmarks/bench_<name>.py`` exposes
``main(quick: bool = False, out_dir: Path = RESULTS_DIR) -> dict``. The dict it
returns (and writes to ``<out_dir>/<name>.json`` with `write_result`) may carry:

- ``"headline"``: a list of `headline` entries, the ratios the summary reports
  against their targets (targets are reported, never asserted);
- ``"table"``: ``{"columns": [...], "rows": [[...], ...]}``, printed by the runner.

A benchmark that cannot run here (an optional program or package is missing)
raises `BenchmarkSkipped` with the reason.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_DIR",
    "BenchmarkSkipped",
    "best_of",
    "best_of_interleaved",
    "format_table",
    "headline",
    "linear_fit",
    "machine_info",
    "paired_ratio",
    "percentile",
    "plot_bars",
    "plot_lines",
    "print_table",
    "set_threads",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class BenchmarkSkipped(Exception):
    """Raised by a benchmark that cannot run on this machine; the message says why."""


# -- machine ------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads (default: the CPUs this process may use); returns it."""
    import torch

    if n is None:
        n = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, Python/torch versions, device, load average and the time (ISO)."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(_memory_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        # Other processes on a small machine disturb timings: record how busy it was.
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


# -- timing -------------------------------------------------------------------


def best_of(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Seconds of the fastest of ``repeat`` calls of ``fn``, after ``warmup`` untimed calls.

    The minimum is the least disturbed run: noise only ever adds time.
    """
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_of_interleaved(
    fns: Sequence[Callable[[], object]], repeat: int = 5, warmup: int = 1
) -> list[float]:
    """Best seconds of each of ``fns``, run in turn ``repeat`` times (after ``warmup`` rounds).

    Interleaving puts a measurement and its baseline side by side in time, so
    a slow spell of the machine (another process, frequency scaling) hits both.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [math.inf] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """The median of ``num[i] / den[i]``: a ratio of two series timed side by side, round by round.

    Sample ``i`` of each series comes from the same round, so a slow spell of
    the machine that lands on one round stretches both sides of that round's
    ratio and cancels out, where a ratio of two medians taken apart keeps it.
    Series of different lengths (not paired) fall back to the ratio of medians.
    """
    if len(num) != len(den) or not num:
        return statistics.median(num) / statistics.median(den)
    return statistics.median(n / d for n, d in zip(num, den, strict=True))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = intercept + slope * x`` and its R^2."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot else 1.0
    return {"intercept": intercept, "slope": slope, "r2": r2}


# -- results ------------------------------------------------------------------


def headline(
    name: str, value: float, target: float, *, higher_is_better: bool = True, unit: str = ""
) -> dict[str, Any]:
    """One headline number of a benchmark, with its target and whether it met it."""
    passed = value >= target if higher_is_better else value < target
    return {
        "name": name,
        "value": value,
        "target": target,
        "op": ">=" if higher_is_better else "<",
        "unit": unit,
        "passed": bool(passed) and not math.isnan(value),
    }


def write_result(name: str, data: dict[str, Any], out_dir: Path = RESULTS_DIR) -> Path:
    """Write ``data`` as ``<out_dir>/<name>.json`` (creating the folder); returns the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


# -- tables -------------------------------------------------------------------


def _cell(v: object) -> str:
    if isinstance(v, float):
        if v == 0 or math.isnan(v):
            return f"{v:g}"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.3f}"
    return str(v)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned plain-text table (numbers right-aligned, text left-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    numeric = [
        all(isinstance(row[i], int | float) for row in rows) if rows else False
        for i in range(len(columns))
    ]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(vals, widths, numeric, strict=True)
        ).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    print(format_table(columns, rows), flush=True)


# -- plots --------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bars(
    name: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    ylabel: str,
    out_dir: Path = RESULTS_DIR,
    hline: float | None = None,
) -> Path | None:
    """Grouped bars (one group per label, one bar per series) to ``<out_dir>/<name>.png``.

    Returns the path, or ``None`` when matplotlib is not installed.
    """
    try:
        plt = _pyplot()
    except ImportError:
        return None
    n = max(1, len(series))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(groups) * n + 2), 4.5))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    if hline is not None:
        ax.axhline(hline, color="k", linestyle="--", linewidth=1, label=f"target {hline:g}")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, name, out_dir)


def plot_lines(
    name: str,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    out_dir: Path = RESULTS_DIR,
    logx: bool = False,
    logy: bool = False,
) -> Path | None:
    """One line per series over ``xs`` to ``<out_dir>/<name>.png`` (``None`` without matplotlib)."""
    try:
        plt = _pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, name, out_dir)


def _save(fig: Any, plt: Any, name: str, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
