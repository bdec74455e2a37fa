"""examples/sglang_backend.py runs against the installed SGLang and shows its point."""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "sglang_backend.py"


def test_the_sglang_example_runs() -> None:
    env = dict(os.environ)
    # On a CPU box without torchvision / a GPU sgl_kernel, SGLang imports the stand-ins.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(h.STUBS), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "instance B found 8 pages, read 8; KV bit-identical: True" in r.stdout


def test_the_example_runs_as_its_docstring_says_in_the_test_environments() -> None:
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    assert doc is not None
    lines = [ln.strip() for ln in doc.splitlines() if ".venv-sglang-" in ln and "python" in ln]
    assert len(lines) == 1, "the docstring gives one command for the test environments"
    words = shlex.split(lines[0])
    env = dict(os.environ)
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = os.pathsep.join(filter(None, [value, env.get(name)]))
    assert words[0].endswith("/bin/python"), words
    r = subprocess.run(
        [sys.executable, *words[1:]],  # this environment's interpreter
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "KV bit-identical: True" in r.stdout
