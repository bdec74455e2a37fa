"""The demo's progress output: a live tqdm bar on a terminal, one line per
configuration in a pipe or a CI log, nothing when disabled."""

from __future__ import annotations

import io

import pytest

from tiercache.demo import _Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, monkeypatch: pytest.MonkeyPatch, enabled: bool = True) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    bar = _Progress(6, enabled)
    for label in ("no_cache", "device"):
        bar.start(label)
        for _ in range(3):
            bar.step()
    bar.close()
    return stream.getvalue()


def test_progress_on_a_terminal_is_one_redrawn_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _run(_Terminal(), monkeypatch)
    assert "\r" in out  # redrawn in place
    assert "6/6" in out and "device" in out
    assert "demo: " not in out


def test_progress_in_a_pipe_is_one_line_per_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _run(io.StringIO(), monkeypatch)
    assert "\r" not in out
    assert out.splitlines() == [
        "demo: no_cache (0/6 requests done)",
        "demo: device (3/6 requests done)",
    ]


def test_progress_disabled_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(_Terminal(), monkeypatch, enabled=False) == ""
    assert _run(io.StringIO(), monkeypatch, enabled=False) == ""
