# SGLang integration suite: tiercache's HiCache storage backend, tested against
# SGLang's own factory, host pools and HiCacheController on CPU.
#
# Each supported SGLang release gets its own environment: torch's CPU build,
# tiercache editable with its dev extras, SGLang installed --no-deps at a pinned
# version, and the packages its storage and controller modules
# import (mk/sglang-<version>-deps.txt). Nothing here is a dependency of the
# package itself.
SGLANG_VERSIONS ?= 0.5.23 0.5.9
SGLANG_NEWEST   := $(firstword $(SGLANG_VERSIONS))

.PHONY: install-sglang test-sglang bench-sglang

.venv-sglang-%/.installed: pyproject.toml mk/sglang-%-deps.txt
	rm -rf .venv-sglang-$*
	$(PYTHON) -m venv .venv-sglang-$*
	.venv-sglang-$*/bin/python -m pip install -q --upgrade pip
	.venv-sglang-$*/bin/python -m pip install -q "$(TORCH)"
	.venv-sglang-$*/bin/python -m pip install -q -e ".[dev,redis]"
	.venv-sglang-$*/bin/python -m pip install -q --no-deps "sglang==$*"
	.venv-sglang-$*/bin/python -m pip install -q --no-deps -r mk/sglang-$*-deps.txt
	touch $@

install-sglang: $(foreach v,$(SGLANG_VERSIONS),.venv-sglang-$(v)/.installed)

# A missing or unimportable SGLang fails the run here (TIERCACHE_REQUIRE_ENGINES):
# outside these environments the same tests skip with the reason.
test-sglang: install-sglang
	@command -v redis-server >/dev/null 2>&1 || bash .ci/install-redis || true
	@# SGLang builds its page hash (C++, OpenSSL) on first use.
	@{ command -v g++ >/dev/null && test -f /usr/include/openssl/sha.h; } || \
	  { apt-get update -qq && apt-get install -y -qq g++ libssl-dev; } || true
	set -e; for v in $(SGLANG_VERSIONS); do \
	  echo "== SGLang $$v"; \
	  TIERCACHE_REQUIRE_ENGINES=1 .venv-sglang-$$v/bin/python -m pytest -q -m sglang tests/integrations/sglang; \
	done

# Backup and prefetch pages/s of the adapter against SGLang's HiCacheFile, in the newest
# SGLang's environment; results in benchmarks/results/sglang/ (the core run skips it).
bench-sglang: .venv-sglang-$(SGLANG_NEWEST)/.installed
	.venv-sglang-$(SGLANG_NEWEST)/bin/python -m benchmarks.run --only sglang --out benchmarks/results/sglang

ENGINE_TESTS += test-sglang
ENGINE_BENCHES += bench-sglang
