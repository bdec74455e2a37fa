"""The wire protocol between ``tiercache serve`` and its clients.

Frames are msgpack objects sent back to back over a Unix stream socket;
msgpack's streaming ``Unpacker`` finds where one ends, so there is no
length prefix of our own to get wrong. A request is the array::

    [version, request_id, op, body]

and every request gets exactly one reply, in order::

    [request_id, "ok", result]          or
    [request_id, "error", {"code": CODE, "message": TEXT}]

Page bytes never travel here: a reply names arena *extents*
(``[[offset, length], ...]``) and the client copies between its own buffers
and its mapping of the arena. The ops (``body`` → ``result``):

=========== ======================================== =============================================
op          body                                     result
=========== ======================================== =============================================
``hello``   ``{}``                                   ``{"version", "arena", "arena_bytes",
                                                     "block_bytes", "arena_id", "pid"}``
``exists``  ``[key, ...]``                           how many keys, from the first, are held
``reserve`` ``[[key, nbytes, format], ...]``         per item ``["new", rid, extents]``,
                                                     ``["have"]``, ``["busy"]`` or ``["full"]``
``commit``  ``[rid, ...]``                           ``null``: the pages are visible
``abort``   ``[rid, ...]``                           ``null``: the reservations are gone
``lease``   ``[[key, nbytes, format], ...]``         per item ``["hit", lid, extents]``,
                                                     ``["miss"]`` or ``["mismatch", format, nbytes]``
``release`` ``[lid, ...]``                           ``null``
``delete``  ``[key, ...]``                           how many unleased pages were removed
``clear``   ``{}``                                   how many pages were removed
``status``  ``{}``                                   the server's counters (`ServerStats` fields)
=========== ======================================== =============================================

A request naming a reservation or lease its connection does not hold is
refused whole (``not_held``) before anything changes. A frame that is not
msgpack, or bigger than `MAX_FRAME_BYTES`, or of another protocol version,
gets an error reply (when it can be answered) and the connection is closed;
a well-formed frame with a bad op or body gets an error reply and the
connection stays.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack

__all__ = [
    "MAX_BATCH",
    "MAX_FRAME_BYTES",
    "OPS",
    "VERSION",
    "ProtocolError",
    "error_reply",
    "make_unpacker",
    "ok_reply",
    "pack",
    "request",
]

#: The protocol version a frame starts with; a server answers only its own.
VERSION: Final = 1
#: The largest frame either side accepts (a 4096-key request is ~1 MiB).
MAX_FRAME_BYTES: Final = 4 << 20
#: The most items one request may carry.
MAX_BATCH: Final = 4096
#: Every op a server answers.
OPS: Final = frozenset(
    {
        "hello",
        "exists",
        "reserve",
        "commit",
        "abort",
        "lease",
        "release",
        "delete",
        "clear",
        "status",
    }
)


class ProtocolError(Exception):
    """A frame that breaks the protocol; ``code`` is the reply's error code.

    ``fatal``: the stream cannot be trusted past it, and the connection is closed.
    """

    def __init__(self, code: str, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.fatal = fatal


def make_unpacker() -> msgpack.Unpacker:
    """A streaming decoder bounded by `MAX_FRAME_BYTES` (``BufferFull`` past it)."""
    return msgpack.Unpacker(
        raw=False,
        use_list=True,
        strict_map_key=True,
        max_buffer_size=MAX_FRAME_BYTES,
    )


def pack(obj: Any) -> bytes:
    """One frame's bytes."""
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def request(request_id: int, op: str, body: Any) -> bytes:
    """The frame of one request."""
    return pack([VERSION, request_id, op, body])


def ok_reply(request_id: int | None, result: Any) -> bytes:
    """The frame of a successful reply."""
    return pack([request_id, "ok", result])


def error_reply(request_id: int | None, code: str, message: str) -> bytes:
    """The frame of an error reply."""
    return pack([request_id, "error", {"code": code, "message": message}])
