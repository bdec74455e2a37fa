"""The errors page (docs/contracts/errors.md) and the API reference match the code.

The errors page has one section per exception in `tiercache.errors`, in the
order of ``__all__``'s tree, each stating the class's bases ("Is a") and the
objects that raise it ("Raised by"). A class added, removed or re-parented in
the code, or a raiser renamed, fails here. The reference pages document every
name a user imports from ``tiercache``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import tiercache
from tiercache import errors

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "contracts" / "errors.md"
REFERENCE = ROOT / "docs" / "reference"


def sections(text: str) -> dict[str, str]:
    """``## Name`` sections of the page, by name, in order."""
    parts = re.split(r"^## (\w+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def field(body: str, name: str) -> str:
    m = re.search(rf"^\*\*{name}:\*\* (.*?)(?=\n\n|\Z)", body, re.S | re.M)
    assert m is not None, f"no **{name}:** paragraph"
    return m.group(1)


def resolve(dotted: str) -> object:
    """The object a dotted name such as ``tiercache.TierCache.request`` names.

    An engine adapter imports its engine, which the core environment lacks:
    a name in such a module is looked up in the module's source instead.
    """
    parts = dotted.split(".")
    i = 1
    while i < len(parts) and is_module(".".join(parts[: i + 1])):
        i += 1
    module = ".".join(parts[:i])
    try:
        obj: object = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.startswith("tiercache"):
            raise
        return defined_in_source(module, parts[i:])
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent is not a package
        return False


def defined_in_source(module: str, path: list[str]) -> ast.AST:
    """The class or function ``path`` (``["Class", "method"]``) in ``module``'s source."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    node: ast.AST = ast.parse(Path(spec.origin).read_text())
    for name in path:
        found = [
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name == name
        ]
        if not found:
            raise AttributeError(f"{module} defines no {'.'.join(path)}")
        node = found[0]
    return node


def exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj)
        and issubclass(obj, errors.TierCacheError)
        and obj.__module__ == errors.__name__
    ]


SECTIONS = sections(PAGE.read_text())


def test_the_page_has_one_section_per_exception_of_the_module() -> None:
    classes = {c.__name__ for c in exception_classes()}
    assert set(SECTIONS) == classes
    assert classes == set(errors.__all__)


@pytest.mark.parametrize("cls", exception_classes(), ids=lambda c: c.__name__)
def test_each_section_states_the_bases_of_its_class(cls: type[BaseException]) -> None:
    stated = re.findall(r"`(\w+)`", field(SECTIONS[cls.__name__], "Is a"))
    assert stated == [b.__name__ for b in cls.__bases__]


@pytest.mark.parametrize("cls", exception_classes(), ids=lambda c: c.__name__)
def test_each_section_says_what_raises_it_and_what_to_do(cls: type[BaseException]) -> None:
    body = SECTIONS[cls.__name__]
    assert len(field(body, "What to do")) > 20
    raised_by = field(body, "Raised by")
    names = re.findall(r"`(tiercache(?:\.\w+)+)`", raised_by)
    if cls is not errors.TierCacheError:
        assert names, f"{cls.__name__}: Raised by names no tiercache object"
    for name in names:
        resolve(name)  # raises when the object was renamed or removed


def test_the_resolver_refuses_a_name_that_does_not_exist() -> None:
    with pytest.raises(AttributeError):
        resolve("tiercache.TierCache.no_such_verb")
    with pytest.raises(AttributeError):
        defined_in_source("tiercache.integrations.vllm", ["TierCacheTier", "no_such_verb"])
    assert isinstance(defined_in_source("tiercache.integrations.vllm", ["TierCacheTier"]), ast.AST)


def test_the_reference_documents_every_public_name() -> None:
    text = "\n".join(p.read_text() for p in REFERENCE.glob("*.md"))
    documented = set(re.findall(r"^::: tiercache\.(\w+)", text, re.M))
    if "errors" in documented:  # the whole module, with its members
        documented |= set(errors.__all__)
    missing = set(tiercache.__all__) - documented - {"__version__"}
    assert not missing, f"not in docs/reference: {sorted(missing)}"
    for module in ("tiercache.integrations.sglang", "tiercache.integrations.vllm"):
        assert f"::: {module}." in text
    assert "::: tiercache.StorageBackend" in text
