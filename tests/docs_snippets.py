"""The Python snippets of the documentation (``docs/**/*.md`` and ``README.md``).

Every fenced ```` ```python ```` block is a snippet. By default a snippet is a
whole program that runs on a CPU: the tests run it as a script in a temporary
directory (a relative ``file:`` store lands there). A block that cannot run on
a CPU (it needs a CUDA device, an engine, a model) says so in an HTML comment
on the line just above its fence, which the rendered page does not show::

    <!-- snippet: no-run needs a CUDA device -->

Such a snippet is still compiled and type-checked with the others. Blocks
included from other files (``--8<-- "examples/x.py"``) are the examples',
which `tests/test_examples.py` runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

_FENCE = re.compile(
    r"^(?:<!--\s*snippet:\s*(?P<mark>[a-z-]+)(?P<why>[^>]*?)\s*-->\n)?```python\n(?P<code>.*?)^```$",
    re.S | re.M,
)
#: The marks a snippet may carry.
MARKS = {"no-run"}


@dataclass(frozen=True)
class Snippet:
    """One fenced Python block: where it is, its code, and whether it runs on a CPU."""

    path: Path
    line: int
    code: str
    runs: bool
    why: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def module_name(self) -> str:
        """A module name for the snippet's file (for mypy): unique, a valid identifier."""
        stem = re.sub(r"\W", "_", str(self.path.relative_to(ROOT).with_suffix("")))
        return f"snippet_{stem}_{self.line}"


def doc_files() -> list[Path]:
    """The Markdown files whose snippets are tested: the site's pages and the README."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def snippets_of(path: Path) -> list[Snippet]:
    """The Python blocks of one Markdown file, in order.

    Raises:
        ValueError: a block carries a mark that is not in `MARKS`, or a
            ``no-run`` mark without a reason.
    """
    text = path.read_text()
    found = []
    for m in _FENCE.finditer(text):
        mark, why = m.group("mark"), (m.group("why") or "").strip()
        line = text.count("\n", 0, m.start("code")) + 1
        if mark is not None and mark not in MARKS:
            raise ValueError(f"{path}:{line}: unknown snippet mark {mark!r}")
        if mark == "no-run" and not why:
            raise ValueError(f"{path}:{line}: a no-run snippet says why it cannot run")
        code = m.group("code")
        if code.lstrip().startswith("--8<--"):
            continue  # an included file (an example), tested as such
        found.append(Snippet(path, line, code, runs=mark is None, why=why))
    return found


def unread_fences(path: Path) -> int:
    """Python fences of ``path`` that `snippets_of` does not read (indented, or unclosed)."""
    text = path.read_text()
    return text.count("```python") - sum(1 for _ in _FENCE.finditer(text))


def all_snippets() -> list[Snippet]:
    return [s for p in doc_files() for s in snippets_of(p)]
