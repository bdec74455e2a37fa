"""`RedisBackend`: the shared remote storage tier, on ``redis.asyncio``.

Several serving instances pointed at one Redis (or Redis Cluster) share their
pages: a prefix computed on one instance loads on every other one.

Each page is one Redis string under ``prefix + page_key`` holding
``pack_page(key, page)`` (the header and checksums of
`tiercache.storage.format`, then the page's bytes), so what comes back is
verified before it is trusted, exactly as the file backend does.

Every batch is one round trip: a non-transactional pipeline of ``EXISTS``,
``GET``, ``SET ... NX`` or ``UNLINK`` commands, sent in one write and answered in
one read. On a Redis Cluster the batch is split by the node that owns each
key's slot and every node gets its own pipeline, all sent at once: one round
trip per node that owns keys of the batch. A node that fails costs only its
own pages (misses), never the batch; the backend then reloads the cluster's
topology by itself, so it follows a failover without being reopened.
Every call runs under ``timeout`` seconds (socket and connect timeouts plus an
``asyncio.timeout`` around the whole batch) and fails with a `StorageError`
subclass, never a ``redis`` exception. The connection pool replaces broken
connections by itself, so a backend outlives a server restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from tiercache._aio import finish
from tiercache._checks import check_number, check_positive
from tiercache.errors import (
    BackendUnavailableError,
    ConfigError,
    StorageCorruptionError,
    StorageError,
    StorageTimeoutError,
)
from tiercache.storage.base import BackendState, PageBuffer, PageKey, StorageBackend
from tiercache.storage.format import (
    check_header,
    decode_header,
    is_newer_version,
    is_older_version,
    pack_page,
    unpack_page,
)
from tiercache.storage.keys import check_batch
from tiercache.storage.registry import option_bool, option_int

try:
    import redis
    import redis.asyncio as aioredis
    import redis.exceptions as redis_errors
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.driver_info import DriverInfo
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the redis storage backend needs the 'redis' package: pip install 'tiercache[redis]'"
    ) from _e

__all__ = ["OFFLOAD_BYTES", "RedisBackend", "mask_url"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Batches whose pages total more than this many bytes are packed (checksum and
#: the join into one value) and verified (checksum and the copy into the page
#: buffers) in the loop's default executor, one executor call per batch.
#: Below it the work takes well under a millisecond and runs on the loop,
#: where a thread hop would cost more than it saves.
OFFLOAD_BYTES = 1 << 20

_SCHEMES = {
    "redis": False,
    "rediss": False,
    "unix": False,
    "redis+cluster": True,
    "rediss+cluster": True,
}
#: Query parameters passed on to redis-py (everything else must be ours).
_PASSTHROUGH_QUERY = frozenset(
    {
        "db",
        "username",
        "password",
        "client_name",
        "protocol",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_check_hostname",
    }
)
_OPTIONS = ("prefix", "ttl_seconds", "timeout", "max_connections", "cluster", "ping_on_open")
_SCAN_COUNT = 1000
#: Replies meaning the cluster's topology moved under a command: reload it, send again.
_REDIRECTS = (redis_errors.AskError, redis_errors.TryAgainError, redis_errors.ClusterDownError)
#: What a cluster node that failed leaves in the reply list for each of its commands.
_NODE_FAILED = (BackendUnavailableError, StorageTimeoutError)
_MASK = "***"


def _unsplit(scheme: str, netloc: str, path: str, query: str, fragment: str) -> str:
    """`urlunsplit` that keeps ``//`` when the netloc is empty (``unix:///path``)."""
    url = f"{scheme}://{netloc}{path}"
    if query:
        url += "?" + query
    if fragment:
        url += "#" + fragment
    return url


def mask_url(url: str) -> str:
    """``url`` with any password (user info or secret query values) replaced by ``***``.

    The registry's `redact_url`, which also handles an unescaped ``?`` or ``#``
    inside a password.
    """
    from tiercache.storage.registry import redact_url

    return redact_url(url)


def _secrets_of(url: str) -> tuple[str, ...]:
    parts = urlsplit(url)
    found = set()
    if parts.password:
        found.update({parts.password, unquote(parts.password)})
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k == "password" and v:
            found.update({v, quote(v)})
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


def _as_positive_float(name: str, value: object) -> float:
    """A positive finite number from a number or a decimal string (a URL query value)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    return check_number(value, f"redis option {name}", positive=True, error=ConfigError)


def _as_positive_int(name: str, value: object) -> int:
    """A positive int from an int or a decimal string (a URL query value)."""
    if isinstance(value, str):
        try:
            value = int(value, 10)
        except ValueError:
            pass
    return check_positive(value, f"redis option {name}", error=ConfigError)


def _split_query(query: str, url_display: str) -> tuple[dict[str, str], dict[str, str]]:
    """The URL's query as (our options, parameters for redis-py).

    A parameter for redis-py with an empty value is dropped (redis-py ignores
    it too); the others are checked (`_check_passthrough`).

    Raises:
        ConfigError: a parameter that is neither, one given twice (redis-py
            would take one of them without a word), or a value redis-py or
            the server would refuse only at the first call.
    """
    ours: dict[str, str] = {}
    passed: dict[str, str] = {}
    seen: set[str] = set()
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k in seen:
            raise ConfigError(f"redis URL parameter {k!r} appears twice in {url_display}")
        seen.add(k)
        if k in _OPTIONS and k != "ping_on_open":
            ours[k] = v
        elif k in _PASSTHROUGH_QUERY:
            if v:
                passed[k] = _check_passthrough(k, v, url_display)
        else:
            raise ConfigError(f"unknown redis URL parameter {k!r} in {url_display}")
    return ours, passed


#: Redis accepts a client name of printable ASCII without spaces (``CLIENT SETNAME``).
_CLIENT_NAME = re.compile(r"[!-~]+")
_CERT_REQS = ("none", "optional", "required")


def _check_passthrough(name: str, value: str, url_display: str) -> str:
    """A redis-py URL parameter checked, in the form redis-py reads as meant.

    redis-py parses these when the first connection is made, and reads some
    loosely (``ssl_check_hostname=off`` is true to it): a bad value would
    fail every call, or quietly mean something else.

    Raises:
        ConfigError: ``db`` not an int >= 0, ``protocol`` not 2 or 3, a
            ``client_name`` Redis refuses, ``ssl_cert_reqs`` not one of
            ``none``, ``optional``, ``required``, or ``ssl_check_hostname``
            not a bool word.
    """
    what = f"redis URL parameter {name} in {url_display}"
    if name == "db":
        return str(option_int(name, value, minimum=0))
    if name == "protocol":
        if value.strip() not in ("2", "3"):
            raise ConfigError(f"{what} must be 2 or 3 (RESP2 or RESP3), got {value!r}")
        return value.strip()
    if name == "client_name" and not _CLIENT_NAME.fullmatch(value):
        raise ConfigError(f"{what} may only use printable ASCII without spaces, got {value!r}")
    if name == "ssl_cert_reqs" and value not in _CERT_REQS:
        raise ConfigError(f"{what} must be one of {_CERT_REQS}, got {value!r}")
    if name == "ssl_check_hostname":
        return "true" if option_bool(name, value) else "false"
    return value


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` in the default executor, to its end even if the caller is cancelled.

    The functions run here read or write page buffers the caller owns, so a
    cancelled caller must not get its pages back while a worker still touches
    them (`tiercache._aio.finish`).
    """
    return await finish(asyncio.get_running_loop().run_in_executor(None, fn, *args))


def _pack_values(keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bytes]:
    """One value per page: ``header + payload`` joined once (redis-py sends one bytes object)."""
    return [b"".join(pack_page(k, p)) for k, p in zip(keys, pages, strict=True)]


def _refused(keys: Sequence[PageKey], replies: Sequence[Any]) -> list[tuple[PageKey, Exception]]:
    """The commands the server refused, with their keys (a failed cluster node is logged apart)."""
    return [
        (k, r)
        for k, r in zip(keys, replies, strict=True)
        if isinstance(r, Exception) and not isinstance(r, _NODE_FAILED)
    ]


def _is_wrong_type(reply: object) -> bool:
    """Whether a command's reply says the key holds a list, hash, ... instead of a string."""
    return isinstance(reply, redis_errors.ResponseError) and str(reply).startswith("WRONGTYPE")


def _unpack_values(
    keys: Sequence[PageKey], blobs: Sequence[bytes | None], pages: Sequence[PageBuffer]
) -> list[str | None | bool]:
    """Verify and copy each blob into its page.

    Every header is checked against its target before any page is written.

    Returns:
        Per page ``True`` (copied), ``False`` (no value, or a page of a newer
        format version), ``None`` (a page of an older format version: stale,
        to drop quietly) or the reason it failed its checks (the page is
        left untouched).

    Raises:
        InvalidInputError: an intact page of another format or length than
            its target (`check_header`); no page was written.
    """
    out: list[str | None | bool] = []
    for key, blob, page in zip(keys, blobs, pages, strict=True):
        if blob is None or is_newer_version(blob):  # newer: an upgraded writer's, kept
            out.append(False)
            continue
        if is_older_version(blob):
            out.append(None)
            continue
        try:
            check_header(decode_header(blob), key, page)
        except StorageCorruptionError as e:
            out.append(str(e))
        else:
            out.append(True)
    for i, (key, blob, page) in enumerate(zip(keys, blobs, pages, strict=True)):
        if out[i] is True:
            assert blob is not None
            try:
                unpack_page(key, blob, page)
            except StorageCorruptionError as e:
                out[i] = str(e)
    return out


class RedisBackend(StorageBackend):
    """Pages in a Redis server or cluster, shared between instances.

    Open it with `from_url` (what ``open_backend("redis://...")`` calls) or
    construct it directly; construction does no IO.

    URLs: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS),
    ``unix:///path/to/redis.sock?db=0``, and ``redis+cluster://host:port`` /
    ``rediss+cluster://`` (or ``?cluster=1``) for Redis Cluster. The options
    below may also be given as query parameters (``?prefix=kv:&ttl_seconds=60``);
    a keyword argument wins over the URL. ``db``, ``username``, ``password``,
    ``client_name``, ``protocol`` and the ``ssl_*`` parameters go to redis-py,
    checked here first (no parameter twice, ``db`` an int >= 0 and 0 on a
    cluster, ``protocol`` 2 or 3, ``client_name`` printable ASCII without
    spaces, ``ssl_*`` only on ``rediss://``, ``ssl_cert_reqs`` one of
    ``none``, ``optional``, ``required``, ``ssl_check_hostname`` a bool word),
    so that a bad value is a `ConfigError` here, not a failure at every call.

    Consistency: a page is written with one ``SET key value NX`` carrying the
    whole header and payload, so the first writer of a key wins and a reader
    sees either no key or all of its bytes, never part of them (a Redis command
    is atomic). A value that fails its checks on read, or a key another writer
    filled with a list, hash or other non-string type, is a miss: it is logged,
    counted in ``stats.corrupt_pages``, never copied into the target, and the
    key is deleted (best effort, after the read; a valid page written between
    the read and the delete would be lost, which costs a miss, never wrong KV).
    An intact page read into a target of another format or length is the
    caller's mistake: ``batch_get`` raises `InvalidInputError` before it
    writes any target, and every key stays. A page of an older format
    version is a quiet miss (not counted as damage) and is deleted, so the
    next write replaces it; one of a later version (an upgraded process
    sharing the server) is a plain miss that stays.
    A hit does not extend a key's time to live. ``stats.evictions`` stays 0:
    the server evicts (``maxmemory``) and expires keys without telling, and
    a delete is no eviction.

    Large pages: a batch whose pages total more than `OFFLOAD_BYTES` (1 MiB)
    is checksummed, joined and verified in the loop's default executor, one
    executor call per batch; a cancelled call waits for that work before it
    returns, so the caller's page buffers are never touched after it returns.

    Credentials are never shown: ``repr``, log messages and error messages use
    `mask_url`, and redis-py's own error text is scrubbed of the password.

    Every method is a coroutine to be called from the event loop that first
    used the backend (the connection pool binds to it).

    Args:
        url: where the server is (see above).
        prefix: prepended to every page key; `clear` removes only keys under
            it. Must not be empty.
        ttl_seconds: if set, each page expires this long after it was
            written (millisecond resolution).
        timeout: seconds any call (one batch, one step of `clear`) may take,
            waiting for a pooled connection included.
        max_connections: connection pool size (per node on a cluster); a call
            that finds every connection busy waits for one, within ``timeout``.
        cluster: use ``redis.asyncio.cluster.RedisCluster``; ``None`` takes it
            from the URL (``+cluster`` scheme or ``?cluster=1``).

    Raises:
        ConfigError: unsupported scheme, unknown query parameter, a
            parameter given twice, an option out of range, or a redis-py
            parameter whose value the connection would refuse (see above).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        ttl_seconds: float | None = None,
        timeout: float | None = None,
        max_connections: int | None = None,
        cluster: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(url, str):
            raise ConfigError(f"redis URL must be a str, got {type(url).__name__}")
        self._secrets = _secrets_of(url)
        self._url_display = mask_url(url)
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in _SCHEMES:
            raise ConfigError(
                f"unsupported redis URL scheme {parts.scheme!r} in {self._url_display}; "
                f"use one of {sorted(_SCHEMES)}"
            )
        db = parts.path.strip("/")
        if scheme != "unix" and db and not (db.isascii() and db.isdigit()):
            # redis-py would silently use database 0 for such a path.
            raise ConfigError(
                f"the path of a redis URL is a database number, got {db!r} in {self._url_display}"
            )
        ours, passed = _split_query(parts.query, self._url_display)
        query_db = passed.get("db")
        if scheme != "unix" and db and query_db is not None and int(query_db) != int(db):
            # redis-py would silently take the query's database over the path's.
            raise ConfigError(
                f"the redis URL names database {db} in its path and "
                f"db={query_db} in its query: {self._url_display}"
            )
        if cluster is None:
            cluster = _SCHEMES[scheme] or option_bool("cluster", ours.get("cluster", False))
        scheme = scheme.removesuffix("+cluster")
        tls_options = sorted(k for k in passed if k.startswith("ssl_"))
        if tls_options and scheme != "rediss":
            raise ConfigError(
                f"{', '.join(tls_options)} set TLS up: use a rediss:// URL, not {self._url_display}"
            )
        self._set_options(
            ours,
            prefix=prefix,
            ttl_seconds=ttl_seconds,
            timeout=timeout,
            max_connections=max_connections,
            cluster=cluster,
        )
        if self.cluster and scheme == "unix":
            raise ConfigError(
                "Redis Cluster is reached over TCP: use redis+cluster:// or rediss+cluster://"
            )
        if self.cluster and int(query_db or db or 0) != 0:
            raise ConfigError(
                f"a Redis Cluster has database 0 only, the URL names {query_db or db}: "
                f"{self._url_display}"
            )
        self._healthy = True
        client_url = _unsplit(scheme, parts.netloc, parts.path, urlencode(passed), parts.fragment)
        self._common = self._connection_options()
        self._client: Any = self._make_client(client_url)
        # Cluster: one plain client per node (`_node_client`), made from the
        # same URL with the node's address, so TLS and credentials carry over.
        self._client_url = parts._replace(scheme=scheme, query=urlencode(passed))
        self._node_clients: dict[str, Any] = {}
        self._failed_nodes: dict[str, float] = {}  # node -> loop time of its last failure
        self._refresh_task: asyncio.Task[None] | None = None
        self._last_refresh = float("-inf")
        self._topology_loaded = False

    def _set_options(
        self,
        ours: dict[str, str],
        *,
        prefix: str | None,
        ttl_seconds: float | None,
        timeout: float | None,
        max_connections: int | None,
        cluster: object,
    ) -> None:
        """Check and set the options; a keyword (not None) wins over the URL's ``ours``."""
        prefix = prefix if prefix is not None else ours.get("prefix", "tiercache:")
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(
                "redis prefix must be a non-empty str (clear() deletes every key under it)"
            )
        self.prefix: str = prefix
        ttl_raw: object = ttl_seconds if ttl_seconds is not None else ours.get("ttl_seconds")
        self.ttl_seconds: float | None = (
            None if ttl_raw is None else _as_positive_float("ttl_seconds", ttl_raw)
        )
        self._px: int | None = (
            None if self.ttl_seconds is None else max(1, round(self.ttl_seconds * 1000))
        )
        self.timeout: float = _as_positive_float(
            "timeout", timeout if timeout is not None else ours.get("timeout", 5.0)
        )
        self.max_connections: int = _as_positive_int(
            "max_connections",
            max_connections if max_connections is not None else ours.get("max_connections", 32),
        )
        self.cluster: bool = option_bool("cluster", cluster)

    def _connection_options(self) -> dict[str, Any]:
        """Keyword options of every connection pool (the main client's and each node's)."""
        # One retry, quickly: it is what turns a connection that died while
        # pooled (server restarted) into a fresh one without failing the call.
        retry = Retry(ExponentialBackoff(cap=min(0.5, self.timeout / 4), base=0.01), retries=1)
        return {
            # Explicit, so that no connection looks the version up in the
            # package metadata (file IO) on the event loop.
            "driver_info": DriverInfo(name="redis-py", lib_version=redis.__version__),
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": retry,
            "max_connections": self.max_connections,
        }

    def _make_client(self, client_url: str) -> Any:
        """The redis-py client (no IO yet).

        Raises:
            ConfigError: redis-py refuses the URL or an option.
        """
        common = self._common
        try:
            if self.cluster:
                # Slots of a failed master stay uncovered until a replica takes
                # over: the other masters' slots must stay usable meanwhile.
                return RedisCluster.from_url(client_url, require_full_coverage=False, **common)
            pool = aioredis.BlockingConnectionPool.from_url(
                client_url, timeout=self.timeout, **common
            )
            return aioredis.Redis.from_pool(pool)
        except (
            ValueError,
            TypeError,
            redis_errors.RedisError,
            redis_errors.RedisClusterException,
        ) as e:
            raise ConfigError(
                f"invalid redis URL {self._url_display}: {self._scrub(str(e))}"
            ) from None

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> RedisBackend:
        """Open a backend (the registry's entry point).

        Args:
            url: see the class docstring.
            **options: ``prefix``, ``ttl_seconds``, ``timeout``,
                ``max_connections``, ``cluster`` (see the class), and
                ``ping_on_open`` (default ``True``): send one ``PING`` so an
                unreachable server fails here rather than at the first batch.

        Raises:
            ConfigError: bad URL or option, or an unknown option name.
            BackendUnavailableError: ``ping_on_open`` and the server cannot be
                reached or refuses the credentials.
            StorageTimeoutError: ``ping_on_open`` and the server did not answer.
        """
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown redis backend option(s) {unknown}; known: {list(_OPTIONS)}")
        ping = option_bool("ping_on_open", options.pop("ping_on_open", True))
        backend = cls(url, **options)
        if ping:
            try:
                await backend.ping()
            except BaseException:
                await backend.aclose()
                raise
        return backend

    def __repr__(self) -> str:
        return (
            f"RedisBackend(url={self._url_display!r}, prefix={self.prefix!r}, "
            f"cluster={self.cluster}, state={self.state.value!r})"
        )

    # -- helpers -------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, _MASK)
        return text

    def _rkey(self, key: PageKey) -> str:
        return self.prefix + key

    def _failed(self, op: str, error: StorageError) -> StorageError:
        self._stats.errors += 1
        if self._healthy:
            self._healthy = False
            logger.warning(
                "redis backend %s: %s failed, treating as misses: %s", self._url_display, op, error
            )
        else:
            logger.debug("redis backend %s: %s failed: %s", self._url_display, op, error)
        return error

    @contextlib.asynccontextmanager
    async def _call(self, op: str) -> AsyncIterator[None]:
        """Run one round trip under the timeout; turn every failure into a `StorageError`."""
        self._check_open()
        try:
            async with asyncio.timeout(self.timeout):
                yield
        except (TimeoutError, redis_errors.TimeoutError) as e:
            detail = self._scrub(str(e)) or f"no answer within {self.timeout:g} s"
            raise self._failed(
                op, StorageTimeoutError(f"redis {op} at {self._url_display}: {detail}")
            ) from None
        except (redis_errors.ConnectionError, redis_errors.RedisClusterException, OSError) as e:
            if self.state is BackendState.CLOSED:
                raise BackendUnavailableError(f"the {self.name} backend is closed") from None
            msg = f"redis {op} at {self._url_display}: {type(e).__name__}: {self._scrub(str(e))}"
            raise self._failed(op, BackendUnavailableError(msg)) from None
        except redis_errors.RedisError as e:
            msg = f"redis {op} at {self._url_display}: {type(e).__name__}: {self._scrub(str(e))}"
            raise self._failed(op, StorageError(msg)) from None
        if not self._healthy:
            self._healthy = True
            logger.info("redis backend %s answers again", self._url_display)
        if not self.cluster:  # a cluster counts its round trips per node
            self._stats.extra["round_trips"] = int(self._stats.extra.get("round_trips", 0)) + 1

    async def _pipeline(
        self, op: str, rkeys: Sequence[str], queue: Callable[[Any, int], None]
    ) -> list[Any]:
        """One round trip: ``queue(pipe, i)`` queues the command on ``rkeys[i]``; send, read replies.

        Per-command errors (``OOM``, ``WRONGTYPE``) come back as exception
        objects in the result list instead of failing the batch. On a cluster
        see `_cluster_pipeline`.
        """
        if self.cluster:
            return await self._cluster_pipeline(op, rkeys, queue)
        async with self._call(op):
            async with self._client.pipeline(transaction=False) as pipe:
                for i in range(len(rkeys)):
                    queue(pipe, i)
                result: list[Any] = await pipe.execute(raise_on_error=False)
        return result

    # -- Redis Cluster ---------------------------------------------------------

    def _node_client(self, host: str, port: int) -> Any:
        """The plain client of one cluster node (made on first use, kept until `aclose`)."""
        name = f"{host}:{port}"
        client = self._node_clients.get(name)
        if client is None:
            u = self._client_url
            userinfo = u.netloc.rpartition("@")[0]
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6
            netloc = f"{userinfo}@{address}" if userinfo else address
            url = _unsplit(u.scheme, netloc, "", u.query, "")
            pool = aioredis.BlockingConnectionPool.from_url(
                url, timeout=self.timeout, **self._common
            )
            client = self._node_clients[name] = aioredis.Redis.from_pool(pool)
        return client

    async def _cluster_pipeline(
        self, op: str, rkeys: Sequence[str], queue: Callable[[Any, int], None]
    ) -> list[Any]:
        """Split the batch by owning node; one pipeline per node, all at once.

        A node that cannot be reached (or does not answer within ``timeout``)
        yields `BackendUnavailableError` (or `StorageTimeoutError`) objects
        for its commands, and a reload of the topology starts in the
        background. Commands answered with ``MOVED``/``ASK``/``TRYAGAIN``/
        ``CLUSTERDOWN`` (the topology moved under us) are sent once more after
        an immediate reload.

        The call raises only when every command failed that way *and* every
        master failed within the last ``max(1, 2 * timeout)`` seconds: an
        outage of the whole cluster, which the storage tier's fault policy
        should see. One dead master only ever costs misses, so the fault
        policy never takes the healthy masters out of service with it.

        Raises:
            BackendUnavailableError, StorageTimeoutError, StorageError: the
                whole cluster is failing, or the topology could not be loaded.
        """
        if not self._topology_loaded:
            async with self._call(op):
                await self._client.initialize()
            self._topology_loaded = True
        results: list[Any] = [None] * len(rkeys)
        moved = await self._send_by_node(op, rkeys, range(len(rkeys)), queue, results)
        if moved:  # the topology moved under the batch: reload it, send those once more
            async with self._call(op):
                await self._client.nodes_manager.initialize()
            self._last_refresh = asyncio.get_running_loop().time()
            await self._send_by_node(op, rkeys, moved, queue, results)
        if results and all(isinstance(r, _NODE_FAILED) for r in results) and self._cluster_down():
            error = type(results[0])(f"redis {op} at {self._url_display}: {results[0]}")
            raise self._failed(op, error)
        if not self._healthy:
            self._healthy = True
            logger.info("redis backend %s answers again", self._url_display)
        return results

    async def _send_by_node(
        self,
        op: str,
        rkeys: Sequence[str],
        todo: Iterable[int],
        queue: Callable[[Any, int], None],
        results: list[Any],
    ) -> list[int]:
        """Send the commands ``todo`` grouped by owning node, all nodes at once.

        Fills ``results[i]`` with each reply (or error object) and returns the
        indices answered with a redirect (`_REDIRECTS`).
        """
        groups: dict[tuple[str, int], list[int]] = {}
        for i in todo:
            try:
                node = self._client.get_node_from_key(rkeys[i])
            except redis_errors.RedisClusterException as e:  # slot not covered
                results[i] = BackendUnavailableError(f"redis cluster: {self._scrub(str(e))}")
                continue
            groups.setdefault((node.host, node.port), []).append(i)
        answered = await asyncio.gather(
            *(self._node_pipeline(op, h, p, idx, queue) for (h, p), idx in groups.items())
        )
        moved: list[int] = []
        for idx, replies in zip(groups.values(), answered, strict=True):
            for i, r in zip(idx, replies, strict=True):
                results[i] = r
                if isinstance(r, _REDIRECTS):
                    moved.append(i)
        if any(isinstance(r, _NODE_FAILED) for r in results):
            self._refresh_topology_soon()
        return moved

    def _cluster_down(self) -> bool:
        """Every master known to the topology failed within the last ``max(1, 2 * timeout)`` s."""
        now = asyncio.get_running_loop().time()
        window = max(1.0, 2 * self.timeout)
        primaries = [f"{n.host}:{n.port}" for n in self._client.get_primaries()]
        return all(now - self._failed_nodes.get(p, float("-inf")) < window for p in primaries)

    async def _node_pipeline(
        self, op: str, host: str, port: int, idx: list[int], queue: Callable[[Any, int], None]
    ) -> list[Any]:
        """One round trip to one node; its failure becomes per-command errors."""
        name = f"{host}:{port}"
        try:
            async with asyncio.timeout(self.timeout):
                async with self._node_client(host, port).pipeline(transaction=False) as pipe:
                    for i in idx:
                        queue(pipe, i)
                    replies: list[Any] = await pipe.execute(raise_on_error=False)
        except (TimeoutError, redis_errors.RedisError, OSError) as e:
            if self.state is BackendState.CLOSED:
                raise BackendUnavailableError(f"the {self.name} backend is closed") from None
            self._stats.errors += 1
            detail = self._scrub(str(e)) or f"no answer within {self.timeout:g} s"
            first = name not in self._failed_nodes
            self._failed_nodes[name] = asyncio.get_running_loop().time()
            if first:
                logger.warning(
                    "redis cluster %s: node %s failed (%s: %s); its pages are misses",
                    self._url_display,
                    name,
                    type(e).__name__,
                    detail,
                )
            timed_out = isinstance(e, TimeoutError | redis_errors.TimeoutError)
            kind = StorageTimeoutError if timed_out else BackendUnavailableError
            err = kind(f"redis {op} at node {name}: {detail}")
            return [err] * len(idx)
        if self._failed_nodes.pop(name, None) is not None:
            logger.info("redis cluster %s: node %s answers again", self._url_display, name)
        self._stats.extra["round_trips"] = int(self._stats.extra.get("round_trips", 0)) + 1
        key = f"round_trips@{name}"
        self._stats.extra[key] = int(self._stats.extra.get(key, 0)) + 1
        return replies

    def _refresh_topology_soon(self) -> None:
        """Reload the slot map in the background (at most one reload at a time, 4 per second)."""
        loop = asyncio.get_running_loop()
        if self._refresh_task is not None or loop.time() - self._last_refresh < 0.25:
            return
        self._last_refresh = loop.time()

        async def refresh() -> None:
            try:
                async with asyncio.timeout(self.timeout):
                    await self._client.nodes_manager.initialize()
            except (TimeoutError, redis_errors.RedisError, OSError) as e:
                logger.debug("redis cluster %s: topology reload failed: %r", self._url_display, e)
            finally:
                self._refresh_task = None
                self._last_refresh = loop.time()

        self._refresh_task = loop.create_task(refresh())

    # -- the StorageBackend interface ---------------------------------------

    async def ping(self) -> None:
        """One ``PING``: raises `BackendUnavailableError` / `StorageTimeoutError` if the server is not there."""
        async with self._call("ping"):
            await self._client.ping()

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """How many of ``keys``, counted from the first, are stored: one pipeline of ``EXISTS``."""
        self._check_open()
        keys = check_batch(keys)
        self._stats.exists_calls += 1
        if not keys:
            return 0

        rkeys = [self._rkey(k) for k in keys]
        replies = await self._pipeline("exists", rkeys, lambda pipe, i: pipe.exists(rkeys[i]))
        # A refused command (an ACL without EXISTS, ...) is a miss, but counted and
        # logged: silently, a store that can never hit would look merely empty.
        failed = _refused(keys, replies)
        self._log_refused("EXISTS", failed, len(keys))
        hits = 0
        for r in replies:
            if isinstance(r, Exception) or not r:
                break
            hits += 1
        return hits

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Read each key into its page buffer: one pipeline of ``GET``, then verify and copy.

        Returns:
            Per page, whether it arrived; a page that did not arrive (missing,
            or failing its checks) keeps its previous bytes.

        Raises:
            InvalidInputError: ``keys`` and ``pages`` differ in length, a
                key that `validate_key` refuses or a target it cannot read
                into (as every backend does), or an intact page of another
                format or length than its target: no page buffer was
                written and no key deleted.
            BackendUnavailableError, StorageTimeoutError, StorageError: the
                read failed; no page buffer was written.
        """
        self._check_open()
        keys = check_batch(keys, pages, targets=True)
        if not keys:
            return []

        rkeys = [self._rkey(k) for k in keys]
        replies = await self._pipeline("get", rkeys, lambda pipe, i: pipe.get(rkeys[i]))
        blobs = self._values(keys, replies)
        nbytes = sum(p.nbytes for p in pages)
        if nbytes > OFFLOAD_BYTES:
            outcome = await _off_loop(_unpack_values, keys, blobs, pages)
        else:
            outcome = _unpack_values(keys, blobs, pages)
        for i, r in enumerate(replies):
            if _is_wrong_type(r):  # another writer's list, hash, ...: as corrupt as bad bytes
                outcome[i] = "the key holds a value of another redis type"
        arrived, corrupt = self._count_reads(keys, pages, outcome)
        if corrupt:
            try:
                await self.delete(corrupt)
            except StorageError as e:
                logger.warning(
                    "redis backend %s: could not delete corrupt pages: %s", self._url_display, e
                )
        return arrived

    def _values(self, keys: Sequence[PageKey], replies: Sequence[Any]) -> list[bytes | None]:
        """The value of each ``GET`` reply; a failed command is ``None`` (a miss), logged."""
        blobs: list[bytes | None] = []
        failed: list[tuple[PageKey, Exception]] = []
        for k, r in zip(keys, replies, strict=True):
            if isinstance(r, _NODE_FAILED):
                r = None  # its node failed: logged and counted once per node
            elif _is_wrong_type(r):
                r = None  # not a string: batch_get drops it as a corrupt page
            elif isinstance(r, Exception):
                failed.append((k, r))
                r = None
            blobs.append(r)
        self._log_refused("GET", failed, len(keys))
        return blobs

    def _log_refused(
        self, command: str, failed: Sequence[tuple[PageKey, Exception]], n: int
    ) -> None:
        """Count commands the server refused; one warning per batch, however many.

        A full server (``OOM``) refuses every write of a batch: one line per
        page would flood the log.
        """
        if not failed:
            return
        self._stats.errors += len(failed)
        k, first = failed[0]
        logger.warning(
            "redis backend %s: %s failed for %d of %d pages (first: %s: %s)",
            self._url_display,
            command,
            len(failed),
            n,
            k,
            self._scrub(str(first)),
        )

    def _count_reads(
        self,
        keys: Sequence[PageKey],
        pages: Sequence[PageBuffer],
        outcome: Sequence[str | None | bool],
    ) -> tuple[list[bool], list[PageKey]]:
        """Count a read's outcome in the stats: (per page whether it arrived, the keys to drop).

        The keys to drop are the damaged pages and, quietly (not damage), the
        stale ones of an older format version.
        """
        arrived: list[bool] = []
        corrupt: list[PageKey] = []
        for k, page, o in zip(keys, pages, outcome, strict=True):
            arrived.append(o is True)
            if o is True:
                self._stats.get_hits += 1
                self._stats.bytes_read += page.nbytes
            elif o is None:
                logger.debug(
                    "redis backend %s: page %s is of an older format version", self._url_display, k
                )
                corrupt.append(k)
            elif isinstance(o, str):
                logger.warning(
                    "redis backend %s: page %s failed its checks, dropping it: %s",
                    self._url_display,
                    k,
                    o,
                )
                self._stats.corrupt_pages += 1
                corrupt.append(k)
        self._stats.get_pages += len(keys)
        return arrived, corrupt

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Store each page with ``SET key value NX [PX ttl]``: one pipeline, first writer wins.

        Each value is written by one atomic ``SET``, so no reader ever sees a
        key whose bytes are not all there.

        Returns:
            Per page, whether the key now holds a page (``True`` too when it
            already existed; ``False`` when the server refused that one
            command, e.g. out of memory).

        Raises:
            InvalidInputError: ``keys`` and ``pages`` differ in length, or a
                key that `validate_key` refuses (as every backend does).
            BackendUnavailableError, StorageTimeoutError, StorageError: the
                write failed; some pages may have been stored.
        """
        self._check_open()
        keys = check_batch(keys, pages)
        if not keys:
            return []
        nbytes = sum(p.nbytes for p in pages)
        if nbytes > OFFLOAD_BYTES:
            values = await _off_loop(_pack_values, keys, pages)
        else:
            values = _pack_values(keys, pages)
        px = self._px

        rkeys = [self._rkey(k) for k in keys]
        replies = await self._pipeline(
            "set", rkeys, lambda pipe, i: pipe.set(rkeys[i], values[i], nx=True, px=px)
        )
        stored: list[bool] = []
        failed: list[tuple[PageKey, Exception]] = []
        for k, page, r in zip(keys, pages, replies, strict=True):
            if isinstance(r, Exception):
                if not isinstance(r, _NODE_FAILED):  # a failed node is logged once
                    failed.append((k, r))
                stored.append(False)
                continue
            stored.append(True)
            if r:  # None: the key existed, the first writer's value stays
                self._stats.set_written += 1
                self._stats.bytes_written += page.nbytes
        self._stats.set_pages += len(keys)
        self._log_refused("SET", failed, len(keys))
        return stored

    async def delete(self, keys: Sequence[PageKey]) -> int:
        """``UNLINK`` the keys (one pipeline); returns how many existed.

        A command the server refuses is counted in ``stats.errors`` (one warning a batch).
        """
        self._check_open()
        keys = check_batch(keys)
        if not keys:
            return 0

        rkeys = [self._rkey(k) for k in keys]
        replies = await self._pipeline(
            "delete", rkeys, lambda pipe, i: pipe.execute_command("UNLINK", rkeys[i])
        )
        failed = _refused(keys, replies)
        self._log_refused("UNLINK", failed, len(keys))
        return sum(int(r) for r in replies if not isinstance(r, Exception))

    async def clear(self) -> None:
        """Remove every key under the prefix: ``SCAN MATCH prefix*`` + ``UNLINK``, never ``FLUSHDB``.

        Each ``SCAN`` step and its ``UNLINK`` run under ``timeout``; a long
        clear may take many steps. On a cluster every primary is scanned.
        """
        self._check_open()
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.prefix) + "*"
        if self.cluster:
            async with self._call("clear"):
                nodes = list(self._client.get_primaries())
        else:
            nodes = [None]
        for node in nodes:
            cursor = 0
            while True:
                async with self._call("clear"):
                    if node is None:
                        cursor, found = await self._client.scan(
                            cursor=cursor, match=pattern, count=_SCAN_COUNT
                        )
                    else:
                        cursors, found = await self._client.scan(
                            cursor=cursor, match=pattern, count=_SCAN_COUNT, target_nodes=node
                        )
                        cursor = next(iter(cursors.values()))
                    if found:
                        await self._client.unlink(*found)
                if cursor == 0:
                    break

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent; later calls raise `BackendUnavailableError`."""
        if self.state is BackendState.CLOSED:
            return
        await super().aclose()
        task, self._refresh_task = self._refresh_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for client in self._node_clients.values():
            with contextlib.suppress(redis_errors.RedisError, OSError):
                await client.aclose()
        self._node_clients.clear()
        try:
            await self._client.aclose()
        except (redis_errors.RedisError, OSError) as e:
            logger.debug(
                "redis backend %s: error while closing: %s", self._url_display, self._scrub(str(e))
            )
