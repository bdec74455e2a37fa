"""The ``tiercache`` command line.

Subcommands:

``tiercache demo``     the serving demo under four cache configurations (`tiercache.demo`);
``tiercache bench``    the benchmarks of the repository checkout (``benchmarks/run.py``);
``tiercache inspect``  what a file store holds, read from its page headers;
``tiercache serve``    one KV page cache per node (`tiercache.serve`);
``tiercache status``   the health and counts of a running ``tiercache serve``.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import tiercache
from tiercache.errors import ConfigError, StorageCorruptionError

__all__ = ["find_benchmarks", "inspect_store", "main", "parse_size"]

#: The address ``tiercache demo --metrics-port`` serves on unless told otherwise.
_METRICS_ADDR = "127.0.0.1"
#: Bytes read from the start of each page file: enough for any real header.
_HEADER_READ = 4096


def find_benchmarks() -> Path | None:
    """The ``benchmarks`` folder: under the current directory, else beside the package's checkout."""
    for candidate in (
        Path.cwd() / "benchmarks",
        Path(tiercache.__file__).resolve().parents[2] / "benchmarks",
    ):
        if (candidate / "run.py").is_file():
            return candidate
    return None


def inspect_store(root: Path) -> dict[str, object]:
    """Summarise a file store: pages, bytes, and a breakdown per key namespace and page format.

    Only each ``*.page`` file's header is read, as the file backend reads
    it: a link is never followed and a fifo never blocks. Files whose header
    does not parse, and anything else under a page file's name (a directory,
    a link, a fifo, a socket, a file that cannot be read), are counted as
    ``damaged``; pages of an older format version as ``stale`` and of a later
    one as ``newer`` (the backend reads both as plain misses); a file removed while the store is walked
    (a store in use) is skipped. Nothing is changed.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    from tiercache.storage.format import decode_header, is_newer_version, is_older_version

    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    pages = 0
    total = 0
    damaged = 0
    stale = 0
    newer = 0
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for dirpath, dirs, files in os.walk(root):
        # A directory (or a link to one) named like a page stands where a page
        # should be: counted, never walked into.
        entries = files + [d for d in dirs if d.endswith(".page")]
        dirs[:] = [d for d in dirs if not d.endswith(".page")]
        for name in entries:
            if not name.endswith(".page") or name.startswith("."):
                continue
            try:
                size, head = _read_head(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            pages += 1
            total += size
            if head is None:
                damaged += 1
                continue
            if is_older_version(head):
                stale += 1
                continue
            if is_newer_version(head):
                newer += 1
                continue
            try:
                h = decode_header(head)
            except StorageCorruptionError:
                damaged += 1
                continue
            namespace = h.key.rsplit("-", 1)[0] if "-" in h.key else "(none)"
            g = groups[(namespace, h.format)]
            g[0] += 1
            g[1] += size
    return {
        "root": str(root),
        "pages": pages,
        "bytes": total,
        "damaged": damaged,
        "stale": stale,
        "newer": newer,
        "groups": [
            {"namespace": ns, "format": fmt, "pages": n, "bytes": b}
            for (ns, fmt), (n, b) in sorted(groups.items())
        ],
    }


def _read_head(path: str) -> tuple[int, bytes | None]:
    """A page file's size and its first `_HEADER_READ` bytes; ``None`` when it is no readable file.

    Opened with ``O_NOFOLLOW | O_NONBLOCK``, as the file backend opens pages:
    a link is never followed, and a fifo named like a page never blocks.

    Raises:
        FileNotFoundError: the file was removed meanwhile.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError:  # a link (ELOOP), no permission, ...
        return 0, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return 0, None
        return st.st_size, os.pread(fd, _HEADER_READ, 0)
    except OSError:
        return 0, None
    finally:
        os.close(fd)


def _positive_int(text: str) -> int:
    """An argparse type: an int of at least 1."""
    value = int(text)  # ValueError: argparse says "invalid _positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """A byte count: ``1073741824``, ``1GiB``, ``512MiB``, ``64KiB``, ``2G`` (=2e9), ``1_000``.

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    t = text.strip().replace("_", "").lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = t[len(digits) :].strip()
    try:
        value = float(digits) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (e.g. 1073741824, 1GiB, 512MiB)"
        ) from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(
            f"a size is a positive whole number of bytes, got {text!r}"
        )
    return int(value)


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def _cmd_demo(args: argparse.Namespace) -> int:
    from tiercache.demo import main as demo_main

    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        print(f"tiercache demo: --dir {args.dir} exists and is not a directory", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.dir, exist_ok=True)  # before the run, not at its end
    except OSError as e:
        print(f"tiercache demo: cannot create --dir {args.dir}: {e}", file=sys.stderr)
        return 2
    if args.metrics_addr is not None and args.metrics_port is None:
        print("tiercache demo: --metrics-addr needs --metrics-port", file=sys.stderr)
        return 2
    try:
        return demo_main(
            args.dir,
            quick=args.quick,
            clients=args.clients,
            seed=args.seed,
            progress=not args.no_progress,
            metrics_port=args.metrics_port,
            metrics_addr=args.metrics_addr or _METRICS_ADDR,
        )
    except ConfigError as e:  # e.g. the metrics port is taken
        print(f"tiercache demo: {e}", file=sys.stderr)
        return 2


def _cmd_bench(args: argparse.Namespace) -> int:
    bench = find_benchmarks()
    if bench is None:
        print(
            "tiercache bench: no benchmarks/ folder found (it ships with the source "
            "repository, not the package): run this from the repository root",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(bench.parent))
    from benchmarks.run import main as bench_main

    argv: list[str] = []
    if args.quick:
        argv.append("--quick")
    if args.only:
        argv += ["--only", args.only]
    return int(bench_main(argv))


def _store_root(text: str) -> Path:
    """The directory ``text`` names: a path, or a file store URL as in ``storage_url``.

    Raises:
        ConfigError: a URL of another scheme, of a remote host, or without a path.
    """
    parts = urlsplit(text)
    if len(parts.scheme) < 2:  # a path (a one-letter scheme is a Windows drive)
        return Path(text)
    if parts.scheme != "file":
        raise ConfigError(f"{text!r} is not a file store: inspect reads file stores only")
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ConfigError(f"{text!r}: use file:///abs/path or file:relative/path")
    return Path(unquote(parts.path))


def _cmd_inspect(args: argparse.Namespace) -> int:
    try:
        info = inspect_store(_store_root(args.path))
    except (FileNotFoundError, ConfigError) as e:
        print(f"tiercache inspect: {e}", file=sys.stderr)
        return 2
    print(f"store: {info['root']}")
    print(
        f"pages: {info['pages']}  bytes: {info['bytes']}  "
        f"damaged: {info['damaged']}  stale: {info['stale']}  newer: {info['newer']}"
    )
    groups = info["groups"]
    assert isinstance(groups, list)
    for g in groups:
        print(
            f"  namespace {g['namespace']}  format {g['format']}: {g['pages']} pages, {g['bytes']} bytes"
        )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from tiercache.errors import TierCacheError
    from tiercache.serve.run import run_server
    from tiercache.serve.server import NodeServer

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        server = NodeServer(
            os.path.abspath(args.socket),
            args.arena_bytes,
            storage_url=args.storage_url,
            group=args.group,
            block_bytes=args.block_bytes,
            arena_path=args.arena_path,
            drain_timeout_s=args.drain_seconds,
            keep_arena=args.keep_arena,
        )
        return run_server(server, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr)
    except (TierCacheError, OSError) as e:
        print(f"tiercache serve: {e}", file=sys.stderr)
        return 2


def _cmd_status(args: argparse.Namespace) -> int:
    from tiercache.errors import StorageError
    from tiercache.serve.run import server_status

    try:
        info = server_status(os.path.abspath(args.socket), timeout_s=args.timeout)
    except StorageError as e:
        print(f"tiercache status: down: {e}", file=sys.stderr)
        return 1
    print(f"status: up  socket: {os.path.abspath(args.socket)}  pid: {info.pop('pid', '?')}")
    for k, v in info.items():
        print(f"{k}: {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiercache", description="tiercache: a tiered KV cache for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"tiercache {tiercache.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="serve a chat + shared-document workload under four cache configurations",
        description="Run the same workload with no cache, device only, device+host and all tiers "
        "(after a flush); print TTFT, prefill tokens and hit rates; write DIR/demo.json and DIR/demo.png.",
    )
    demo.add_argument(
        "--quick", action="store_true", help="a small workload that runs in a few seconds"
    )
    demo.add_argument(
        "--dir",
        default="tiercache-demo",
        help="output folder; its store/ subfolder is the file store, emptied first, and a "
        "store/ holding other files is refused (default: %(default)s)",
    )
    demo.add_argument(
        "--clients",
        type=_positive_int,
        default=None,
        help="chat clients (default: 8, or 3 with --quick)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the tokens and arrival times (default: %(default)s)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    demo.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="N",
        help="serve Prometheus metrics on port N while the demo runs (0: any free port; "
        "needs tiercache[metrics])",
    )
    demo.add_argument(
        "--metrics-addr",
        default=None,
        help=f"address the metrics server of --metrics-port binds (default: {_METRICS_ADDR})",
    )
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench",
        help="run the benchmarks (benchmarks/run.py of the repository checkout)",
        description="Run the repository's benchmarks and write benchmarks/results/summary.json "
        "(with --quick: benchmarks/results/quick/summary.json, so that a quick run never "
        "overwrites full results).",
    )
    bench.add_argument("--quick", action="store_true", help="smaller sizes, a few seconds each")
    bench.add_argument(
        "--only", default="", help="comma-separated benchmark names, e.g. transfer,storage"
    )
    bench.set_defaults(func=_cmd_bench)

    insp = sub.add_parser(
        "inspect",
        help="summarise what a file store holds",
        description="Count the pages and bytes of a file store, per key namespace and page format, "
        "reading only each page file's header.",
    )
    insp.add_argument("path", help="the file store's root directory, or its file:// storage URL")
    insp.set_defaults(func=_cmd_inspect)
    _add_serve_parsers(sub)
    return parser


def _add_serve_parsers(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run one KV page cache per node, shared by its engine processes",
        description="Own a page arena in shared memory and serve it over a Unix socket; engines "
        "use it as the storage URL tiercache+unix://SOCKET. Prints a 'tiercache serve: ready' "
        "line once the socket accepts connections; SIGTERM drains and exits.",
    )
    serve.add_argument("--socket", required=True, help="the Unix socket to listen on")
    serve.add_argument(
        "--arena-bytes",
        required=True,
        type=parse_size,
        metavar="N",
        help="size of the shared-memory page arena (e.g. 8GiB)",
    )
    serve.add_argument(
        "--storage-url",
        default=None,
        help="storage behind the arena (any tiercache URL): write-behind and read-through",
    )
    serve.add_argument(
        "--group",
        default=None,
        help="a group (name or gid) whose members may connect; socket and arena become 0660",
    )
    serve.add_argument(
        "--metrics-port", type=_port, default=None, metavar="P", help="serve Prometheus metrics"
    )
    serve.add_argument(
        "--metrics-addr", default=_METRICS_ADDR, help="address of the metrics server"
    )
    serve.add_argument(
        "--block-bytes",
        type=parse_size,
        default=64 << 10,
        metavar="N",
        help="arena block size; a page takes whole blocks (default: 64KiB)",
    )
    serve.add_argument(
        "--arena-path",
        default=None,
        help="the arena file (default: /dev/shm/tiercache-<hash of the socket path>.arena)",
    )
    serve.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM, the longest to wait for in-flight work and write-behind (default: 10)",
    )
    serve.add_argument(
        "--keep-arena",
        action="store_true",
        help="on SIGTERM keep the arena and an index of its pages in shared memory; a server "
        "started with --keep-arena on the same arena checks each page's checksum and serves "
        "the intact ones (a restart or an upgrade keeps the warm cache)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_cmd_serve)

    status = sub.add_parser(
        "status",
        help="print the health and counts of a running tiercache serve",
        description="Exit 0 and print the server's counters if it answers, else exit 1.",
    )
    status.add_argument("--socket", required=True, help="the server's Unix socket")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for it")
    status.set_defaults(func=_cmd_status)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc
