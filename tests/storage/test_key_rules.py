"""Every backend accepts exactly the keys `validate_key` accepts, and refuses the rest."""

from __future__ import annotations

import pytest
from tests.storage.storage_helpers import FORMAT, random_page

from tiercache.errors import InvalidInputError
from tiercache.memory import PageBuffer
from tiercache.storage import MAX_KEY_LENGTH, StorageBackend, validate_key

GOOD_KEYS: list[object] = [
    "a",
    "0",
    "page-1",
    "A.b_c-D",
    "x.",
    "a..b",
    "k" * MAX_KEY_LENGTH,
    "0123abcd0123abcd-" + "f" * 64,
]
BAD_KEYS: list[object] = [
    "",
    ".",
    "..",
    ".hidden",
    "a/b",
    "../x",
    "a b",
    "x*",
    "k\n",
    "k:1",
    "é",
    "k" * (MAX_KEY_LENGTH + 1),
    b"bytes",
    5,
    None,
]


def _accepted(key: object) -> bool:
    try:
        validate_key(key)
    except InvalidInputError:
        return False
    return True


def test_the_key_lists_say_what_validate_key_says() -> None:
    assert all(_accepted(k) for k in GOOD_KEYS)
    assert not any(_accepted(k) for k in BAD_KEYS)


@pytest.mark.parametrize("key", GOOD_KEYS + BAD_KEYS, ids=lambda k: repr(k)[:24])
async def test_every_backend_takes_the_keys_validate_key_takes(
    backend: StorageBackend, key: object
) -> None:
    page = random_page(64)
    if not _accepted(key):
        calls = {
            "batch_exists": lambda: backend.batch_exists([key]),  # type: ignore[list-item]
            "batch_set": lambda: backend.batch_set([key], [page]),  # type: ignore[list-item]
            "batch_get": lambda: backend.batch_get(
                [key],  # type: ignore[list-item]
                [PageBuffer.allocate(64, FORMAT)],
            ),
            "delete": lambda: backend.delete([key]),  # type: ignore[list-item]
        }
        for name, call in calls.items():
            with pytest.raises(InvalidInputError):
                await call()
                pytest.fail(f"{backend.name}.{name} took {key!r}")
        return
    k = validate_key(key)
    assert await backend.batch_exists([k]) == 0
    assert await backend.batch_set([k], [page]) == [True]
    assert await backend.batch_exists([k]) == 1
    out = PageBuffer.allocate(64, FORMAT)
    assert await backend.batch_get([k], [out]) == [True]
    assert out.tobytes() == page.tobytes()
    assert await backend.delete([k]) == 1
