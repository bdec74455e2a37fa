"""Finding and opening storage backends by URL.

``await open_backend(url, **options)`` turns a URL into an open
`StorageBackend`::

    memory://                          MemoryBackend (in-process)
    memory://?capacity_bytes=1000000
    file:///abs/path                   FileBackend rooted at /abs/path
    file:relative/path                 ... relative to the working directory
    file:///x?capacity_bytes=1000000&fsync=1
    redis://host:6379/0, rediss://..., unix:///run/redis.sock
                                       RedisBackend (tiercache.storage.redis)
    tiercache+unix:///run/tc.sock      ServeBackend: a node's ``tiercache serve``
                                       (tiercache.serve.client)
    <name>://...                       a backend added with register_backend,
                                       or by the ``tiercache.backends`` entry point group
    package.module:ClassName[?...]     a backend class by dotted path
    package.module.ClassName[?...]

It is a coroutine function because opening a backend may need IO: the file
backend scans its directory tree, the redis backend connects.

**The factory contract.** A backend is found as a *factory*: either a
`StorageBackend` subclass with a ``from_url`` classmethod::

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self

or any callable ``factory(url, **options)`` returning a backend or an awaitable
of one. The factory receives the whole URL, query included, and owns its
parsing: query parameters are options (strings; `url_options` splits them off
and `option_int` / `option_bool` / ... type them), keyword options given to
`open_backend` override them. Unknown or ill-typed options raise `ConfigError`.

Lookup order for a scheme: `register_backend` registrations, the built-in
names, then the ``tiercache.backends`` entry points. Module imports happen on
first use, so a missing optional dependency (redis) only matters to the URLs
that need it.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from tiercache._checks import check_int, parse_bool
from tiercache.errors import BackendNotFoundError, ConfigError
from tiercache.storage.base import StorageBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendFactory",
    "available_backends",
    "open_backend",
    "option_bool",
    "option_float",
    "option_int",
    "redact_url",
    "register_backend",
    "reject_unknown",
    "resolve_backend",
    "unregister_backend",
    "url_options",
]

logger = logging.getLogger(__name__)

#: The entry point group third-party packages use to offer a backend:
#: ``[project.entry-points."tiercache.backends"] myname = "mypkg.backend:MyBackend"``.
ENTRY_POINT_GROUP = "tiercache.backends"

#: A backend class (with ``from_url``) or a callable ``factory(url, **options)``.
BackendFactory = Callable[..., StorageBackend | Awaitable[StorageBackend]]

_BUILTIN: dict[str, str] = {
    "memory": "tiercache.storage.memory:MemoryBackend",
    "file": "tiercache.storage.file:FileBackend",
    "redis": "tiercache.storage.redis:RedisBackend",
    "tiercache+unix": "tiercache.serve.client:ServeBackend",
}
_ALIASES: dict[str, str] = {
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
}
_NAME_RE = re.compile(r"[a-z][a-z0-9+.-]*")
_DOTTED_RE = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*|\.[A-Za-z_]\w*)")

_registry: dict[str, BackendFactory] = {}

#: Query parameters whose values are secrets, masked by `redact_url`.
_SECRET_QUERY = frozenset(
    {"password", "passwd", "pwd", "secret", "token", "access_key", "secret_key"}
)
_MASK = "***"
_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/]*:)[^@/]*@")


def redact_url(url: str) -> str:
    """``url`` fit for logs and error messages: secrets replaced by ``***``.

    Masks the password of the user info (``scheme://user:***@host``) and the
    values of secret query parameters (``?password=***``, ``token``, ...), for
    any scheme. Everything else is kept, so the result still says which
    backend and where. A URL that cannot be parsed becomes ``"<unparsable url>"``.
    """
    # First on the raw text: an unescaped '?' or '#' in a password would end
    # the netloc early for urlsplit and leave the rest of the password behind.
    url = _USERINFO_RE.sub(r"\1" + _MASK + "@", url, count=1)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":" + _MASK
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY for k, _ in pairs):
            query = urlencode(
                [(k, _MASK if k.lower() in _SECRET_QUERY else v) for k, v in pairs], safe="*:/"
            )
    if netloc == parts.netloc and query == parts.query:
        return url
    out = f"{parts.scheme}:" if parts.scheme else ""
    if netloc or url.startswith(f"{out}//"):
        out += f"//{netloc}"
    out += parts.path
    if query:
        out += "?" + query
    if parts.fragment:
        out += "#" + parts.fragment
    return out


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``name://...`` URLs open backends made by ``factory``.

    Args:
        name: the URL scheme, lowercase (``[a-z][a-z0-9+.-]*``).
        factory: a `StorageBackend` subclass with ``from_url``, or a callable
            ``factory(url, **options)`` returning a backend or an awaitable of one.
        replace: allow replacing an earlier registration of ``name``, or a
            built-in backend (``memory``, ``file``, ``redis`` and its aliases).

    Raises:
        ConfigError: a bad name, a factory that is not callable, or ``name``
            already registered or built in and ``replace`` is false.

    Call from any thread before the backend is opened; registration is a
    plain dict update.
    """
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ConfigError(f"a backend name is a lowercase URL scheme, got {name!r}")
    if not callable(factory):
        raise ConfigError(f"the factory of backend {name!r} is not callable: {factory!r}")
    if not replace:
        if name in _registry:
            raise ConfigError(f"a backend named {name!r} is already registered (pass replace=True)")
        if name in _BUILTIN or name in _ALIASES:
            raise ConfigError(
                f"{name!r} is a built-in backend: pass replace=True to serve its URLs otherwise"
            )
    _registry[name] = factory


def unregister_backend(name: str) -> None:
    """Forget a `register_backend` registration (no error when absent).

    A built-in name that was replaced goes back to its built-in backend.

    Raises:
        ConfigError: ``name`` names a built-in backend that was not replaced
            (built-ins cannot be removed).
    """
    if name not in _registry and (name in _BUILTIN or name in _ALIASES):
        raise ConfigError(f"{name!r} is a built-in backend; it cannot be unregistered")
    _registry.pop(name, None)


def available_backends() -> list[str]:
    """Names that resolve without a dotted path: registered, built-in, entry points.

    Reads the installed distributions' metadata (file IO): call it off the event loop.
    """
    names = set(_registry) | set(_BUILTIN) | set(_ALIASES)
    names.update(ep.name for ep in _entry_points())
    return sorted(names)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _import_object(spec: str, what: str) -> object:
    """Import ``"pkg.mod:Name"`` or ``"pkg.mod.Name"``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise BackendNotFoundError(f"{what}: {spec!r} is not a 'package.module:Name' path")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise BackendNotFoundError(f"{what}: cannot import {module_name!r} ({e})") from e
    try:
        obj: object = getattr(module, attr)
    except AttributeError as e:
        raise BackendNotFoundError(f"{what}: module {module_name!r} has no {attr!r}") from e
    if not callable(obj):
        raise BackendNotFoundError(f"{what}: {spec!r} is not a class or callable")
    return obj


def _canonical_name(name: object) -> str:
    """``name`` with its alias resolved (``unix``, ``rediss``, ... are ``redis``).

    Raises:
        BackendNotFoundError: ``name`` is not a str.
    """
    if not isinstance(name, str):
        raise BackendNotFoundError(f"a backend name is a str, got {type(name).__name__}")
    return _ALIASES.get(name, name)


def resolve_backend(name: str) -> BackendFactory:
    """The factory for a scheme name or a dotted path.

    May import modules and read distribution metadata (file IO): `open_backend`
    calls it in a worker thread.

    Raises:
        BackendNotFoundError: nothing is registered, built in or published as
            an entry point under ``name`` (or ``name`` is not a str), or its
            module cannot be imported.
    """
    name = _canonical_name(name)
    if name in _registry:
        return _registry[name]
    if name.startswith("faulty+"):
        # Any backend wrapped in the fault injector: faulty+memory://, faulty+file:///...
        return _import_object("tiercache.storage.faults:FaultyBackend", "backend 'faulty'")  # type: ignore[return-value]
    if name in _BUILTIN:
        try:
            return _import_object(_BUILTIN[name], f"backend {name!r}")  # type: ignore[return-value]
        except BackendNotFoundError as e:
            extra = " (install tiercache[redis])" if name == "redis" else ""
            raise BackendNotFoundError(
                f"the built-in {name!r} backend is not available{extra}: {e}"
            ) from e
    for ep in _entry_points():
        if ep.name == name:
            try:
                obj = ep.load()
            except Exception as e:  # a broken plugin must not look like a missing one
                raise BackendNotFoundError(
                    f"entry point {ep.value!r} of backend {name!r} failed to load: {e}"
                ) from e
            if not callable(obj):
                raise BackendNotFoundError(
                    f"entry point {ep.value!r} of backend {name!r} is not callable"
                )
            return obj  # type: ignore[no-any-return]
    if "." in name and _DOTTED_RE.fullmatch(name):
        return _import_object(name, "backend")  # type: ignore[return-value]
    known = ", ".join(available_backends())
    raise BackendNotFoundError(
        f"no storage backend named {name!r} (known: {known}; or give 'package.module:Class')"
    )


def _split_target(url: str) -> str:
    """The scheme, or the dotted path, that names the backend of ``url``."""
    head = url.split("?", 1)[0]
    if _DOTTED_RE.fullmatch(head) and ("." in head.split(":", 1)[0]):
        return head
    scheme = urlsplit(url).scheme.lower()
    if not scheme:
        raise BackendNotFoundError(
            f"storage URL {redact_url(url)!r} has no scheme (memory://, file:///path, redis://...)"
        )
    return scheme


async def open_backend(url: str, **options: Any) -> StorageBackend:
    """Open the storage backend a URL names (see the module docstring).

    Args:
        url: the backend URL; its query parameters are options.
        **options: backend options; they override query parameters of the same name.

    Returns:
        An open backend; close it with ``await backend.aclose()`` or ``async with``.

    Raises:
        BackendNotFoundError: unknown scheme or dotted path, or its module is
            missing (e.g. the redis client is not installed).
        ConfigError: bad URL or options.
        StorageError: the backend could not be reached.

    Call from the event loop that will use the backend.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"a storage URL is a non-empty str, got {url!r}")
    target = _split_target(url)
    # Resolving may import modules and scan installed distributions for entry
    # points (file IO): off the loop, unless it is a registration (a dict lookup).
    registered = _registry.get(target)
    if registered is not None:
        factory = registered
    else:
        factory = await asyncio.to_thread(resolve_backend, target)
    from_url = getattr(factory, "from_url", None)
    if inspect.isclass(factory) and from_url is not None:
        result: object = from_url(url, **options)
    else:
        result = factory(url, **options)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, StorageBackend):
        raise ConfigError(
            f"the factory for {redact_url(url)!r} returned {type(result).__name__}, "
            "not a StorageBackend"
        )
    # Never log the raw URL: it may carry a password (redis://:pw@host).
    logger.debug("opened %s backend for %s", result.name, redact_url(url.split("?", 1)[0]))
    return result


# --- option helpers for backend factories -------------------------------------------------------


def url_options(url: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Split the query off ``url`` and merge it under ``options``.

    Returns:
        ``(url_without_query, merged)``: query parameters as strings, then
        ``options`` on top (keywords win).

    Raises:
        ConfigError: a query parameter given twice.
    """
    base, sep, query = url.partition("?")
    merged: dict[str, Any] = {}
    if sep:
        for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
            if k in merged:
                raise ConfigError(f"option {k!r} appears twice in {redact_url(url)!r}")
            merged[k] = v
    merged.update(options)
    return base, merged


def option_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """An int option from an int or a decimal string (``"1000000"``, ``"1_000"``).

    Raises:
        ConfigError: not an integer, or below ``minimum``.
    """
    if isinstance(value, str):
        try:
            value = int(value.strip(), 10)
        except ValueError as e:
            raise ConfigError(f"option {name} must be an int, got {value!r}") from e
    return check_int(value, f"option {name}", minimum=minimum, error=ConfigError)


def option_float(name: str, value: Any, *, minimum: float | None = None) -> float:
    """A float option from a number or a string.

    Raises:
        ConfigError: not a number, or below ``minimum``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"option {name} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"option {name} must be a number, got {value!r}") from e
    if out != out or (minimum is not None and out < minimum):
        raise ConfigError(f"option {name} must be a number >= {minimum}, got {value!r}")
    return out


def option_bool(name: str, value: Any) -> bool:
    """A bool option from a bool, 0/1, or ``true/false/yes/no/on/off`` (`parse_bool`).

    Raises:
        ConfigError: anything else; the message names the option.
    """
    return parse_bool(value, f"option {name}")


def reject_unknown(
    backend: str, options: Mapping[str, Any], known: set[str] | frozenset[str]
) -> None:
    """Raise `ConfigError` naming the options ``backend`` does not know."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown option(s) for the {backend} backend: {unknown} (known: {sorted(known)})"
        )
