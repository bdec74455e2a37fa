"""Each example runs as a script, exits 0 and prints the line that shows its point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CASES = {
    "quickstart.py": "after flush: 64 tokens cached (from storage)",
    "layerwise_overlap.py": "logits match a full recompute: True",
    "shared_storage.py": (
        "process B loaded 512 tokens from storage; logits match a full recompute: True"
    ),
    "runtime_attach.py": "requests across attach/detach; no errors",
    "redis_two_instances.py": "instance B loaded 512 tokens from Redis; KV bit-identical: True",
    "prometheus_metrics.py": "tiercache_hit_tokens_total{instance=demo,tier=storage} 64.0",
}

#: Examples that need a binary on the PATH to run at all.
NEEDS = {"redis_two_instances.py": "redis-server"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name: str) -> None:
    binary = NEEDS.get(name)
    if binary is not None and shutil.which(binary) is None:
        pytest.skip(f"{name} needs {binary}, which is not installed")
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=90
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert CASES[name] in r.stdout
