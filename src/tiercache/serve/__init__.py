"""``tiercache serve``: one KV page cache per node, shared by every engine process on it.

- `NodeServer`: the server (an async context manager; ``tiercache serve`` runs one);
- `ServeBackend`: the client, a storage backend under ``tiercache+unix:///PATH``;
- `ServeClient`: one raw protocol connection (tools and tests);
- `PageTable`: the arena's index and lease table; `Arena`: the shared-memory file.
"""

from __future__ import annotations

from tiercache.serve.arena import Arena
from tiercache.serve.client import ServeBackend, ServeClient, ServerError
from tiercache.serve.server import NodeServer, ServerStats, default_arena_path
from tiercache.serve.table import PageTable

__all__ = [
    "Arena",
    "NodeServer",
    "PageTable",
    "ServeBackend",
    "ServeClient",
    "ServerError",
    "ServerStats",
    "default_arena_path",
]
