"""The ``tiercache`` command line.

Subcommands:

``tiercache demo``     the serving demo under four cache configurations (`tiercache.demo`);
``tiercache bench``    the benchmarks of the repository checkout (``benchmarks/run.py``);
``tiercache inspect``  what a file store holds, read from its page headers.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

import tiercache
from tiercache.errors import ConfigError, StorageCorruptionError

__all__ = ["find_benchmarks", "inspect_store", "main"]

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc
