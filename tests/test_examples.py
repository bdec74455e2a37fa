"""Each example runs as a script, exits 0 and prints the line that shows its point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CASES = {
    "quickstart.py": "after flush: 64 tokens cached (from storage)",
    "layerwise_overlap.py": "logits match a full recompute: True",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name: str) -> None:
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=90
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert CASES[name] in r.stdout
