"""examples/sglang_backend.py runs against the installed SGLang and shows its point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "sglang_backend.py"


def test_the_sglang_example_runs() -> None:
    env = dict(os.environ)
    # On a CPU box without torchvision / a GPU sgl_kernel, SGLang imports the stand-ins.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(h.STUBS), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "instance B found 8 pages, read 8; KV bit-identical: True" in r.stdout
