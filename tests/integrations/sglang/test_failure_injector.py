"""SGLang's own storage failure injector, wrapped around the backend by SGLang's factory.

``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` makes each storage call fail at
random (a failed write, an empty hit query, a failed read) and
``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` delays it. Through all of it the
controllers keep serving, and every page that arrives is the page A stored.
"""

from __future__ import annotations

import random

import pytest
from tests.integrations.sglang import sglang_helpers as h

pytestmark = pytest.mark.sglang

ROUNDS = 20
PAGES = 4


def test_sglang_failure_injector_on_top_of_the_backend(
    instances: list[h.Instance], file_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = h.sg()
    if s.FailureInjector is None:
        pytest.skip(f"SGLang {s.version_str} has no storage failure injector")
    from tiercache.integrations.sglang import TierCacheStorage

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    g = h.Geometry()
    a = h.make_instance(g, h.extra(file_store))
    instances.append(a)
    b = h.make_instance(g, h.extra(file_store))
    instances.append(b)
    for inst in (a, b):
        assert isinstance(inst.backend, s.FailureInjector)
        assert isinstance(inst.backend._backend, TierCacheStorage)

    ps = g.page_size
    rnd = random.Random(0)
    full, short = 0, 0
    for r in range(ROUNDS):
        tokens = [rnd.randrange(1 << 31) for _ in range(PAGES * ps)]
        h.fill_random(a.host, r)
        a_idx = a.host.alloc(len(tokens))
        stored = h.backup(a, a_idx, tokens, h.chain(tokens, ps))
        got = h.prefetch(b, tokens)
        assert got.completed_tokens <= got.hit_tokens <= stored
        if got.completed_tokens:
            n = got.completed_tokens // ps
            want = h.pages_bytes(a.host, a_idx[: n * ps], ps)
            assert h.pages_bytes(b.host, got.host_indices[: n * ps], ps) == want
        if got.host_indices is not None:
            b.host.free(got.host_indices)
        a.host.free(a_idx)
        full += got.completed_tokens == len(tokens)
        short += got.completed_tokens < len(tokens)
    # Injected failures happened, and rounds without one went through whole.
    assert short > 0 and full > 0
    assert (
        b.backend._backend.stats()["errors"] == 0
    )  # the injector fails calls before they reach us
