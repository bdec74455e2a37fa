"""Every Python snippet of the documentation runs, or at least compiles and type-checks.

A snippet without a mark runs as a script on the CPU, in a temporary
directory (so a relative ``file:`` store is a temporary store), and must exit
0. Every snippet, marked ``no-run`` or not, is compiled, and all of them are
type-checked together by mypy. Each example under ``examples/`` is run by
`tests/test_examples.py`; those that need an engine are type-checked there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.docs_snippets import (
    DOCS,
    README,
    ROOT,
    Snippet,
    all_snippets,
    doc_files,
    snippets_of,
    unread_fences,
)

SNIPPETS = all_snippets()
RUNNABLE = [s for s in SNIPPETS if s.runs]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # the package under test, whether or not it is installed in this interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU device, even on a machine with a GPU
    return env


def test_the_docs_have_snippets_and_each_page_that_shows_code_is_read() -> None:
    assert len(SNIPPETS) >= 10, [s.id for s in SNIPPETS]
    assert len(RUNNABLE) >= 8
    pages = {s.path for s in SNIPPETS}
    assert README in pages
    assert DOCS / "guides" / "asyncio-server.md" in pages
    # a fence the extractor cannot see (indented in a list or an admonition) would go untested
    unread = {str(p.relative_to(ROOT)): n for p in doc_files() if (n := unread_fences(p))}
    assert not unread, f"python fences the snippet tests do not read: {unread}"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet_compiles(snippet: Snippet) -> None:
    compile(snippet.code, snippet.id, "exec")


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_snippet_runs_on_the_cpu(snippet: Snippet, tmp_path: Path) -> None:
    script = tmp_path / f"{snippet.module_name}.py"
    script.write_text(snippet.code)
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode == 0, f"{snippet.id} failed:\n{r.stdout}\n{r.stderr}"


def test_snippets_type_check(tmp_path: Path) -> None:
    """mypy over every snippet, each as its own module (engines' modules are Any)."""
    for s in SNIPPETS:
        (tmp_path / f"{s.module_name}.py").write_text(s.code)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--check-untyped-defs",
            "--disallow-untyped-defs",
            "--warn-unused-ignores",
            "--python-version=3.11",
            "--config-file=",
            "--cache-dir",
            str(ROOT / ".mypy_cache" / "snippets"),
            *(str(tmp_path / f"{s.module_name}.py") for s in SNIPPETS),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, _on_pages(r.stdout, tmp_path) + r.stderr


def _on_pages(mypy_output: str, folder: Path) -> str:
    """mypy's ``file:line:`` of an extracted snippet, as the page's own ``page.md:line:``."""
    by_file = {f"{s.module_name}.py": s for s in SNIPPETS}

    def place(m: re.Match[str]) -> str:
        s = by_file.get(Path(m.group(1)).name)
        if s is None:
            return m.group(0)
        return f"{s.path.relative_to(ROOT)}:{s.line + int(m.group(2)) - 1}:"

    return re.sub(r"^(\S+?\.py):(\d+):", place, mypy_output, flags=re.M)


def test_an_indented_fence_is_reported_as_unread(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("- a list item:\n\n    ```python\n    x = 1\n    ```\n")
    assert snippets_of(page) == [] and unread_fences(page) == 1


def test_a_mark_must_be_known_and_a_no_run_mark_must_say_why(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- snippet: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown snippet mark"):
        snippets_of(page)
    page.write_text("<!-- snippet: no-run -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="says why"):
        snippets_of(page)
    page.write_text(
        "<!-- snippet: no-run needs CUDA -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
    )
    got = snippets_of(page)
    assert unread_fences(page) == 0
    assert [(s.code, s.runs, s.why) for s in got] == [
        ("x = 1\n", False, "needs CUDA"),
        ("y = 2\n", True, ""),
    ]
