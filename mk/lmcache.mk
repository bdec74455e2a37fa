# LMCache, for the benchmark only: `make bench-serve` sets tiercache's node-local server
# beside LMCache's own KV cache server with the same pages. LMCache is installed --no-deps
# at a pinned version into its own environment with the packages its server and remote
# client import (mk/lmcache-<version>-deps.txt); it is never a dependency of the package.
LMCACHE_VERSION ?= 0.5.6
LMCACHE_VENV    ?= .venv-lmcache-$(LMCACHE_VERSION)
LMCACHE_PY       = $(LMCACHE_VENV)/bin/python

.PHONY: install-lmcache

$(LMCACHE_VENV)/.installed: pyproject.toml mk/lmcache.mk mk/lmcache-$(LMCACHE_VERSION)-deps.txt
	rm -rf $(LMCACHE_VENV)
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_PY) -m pip install -q --upgrade pip
	$(LMCACHE_PY) -m pip install -q "$(TORCH)"
	$(LMCACHE_PY) -m pip install -q -e ".[dev,redis]"
	$(LMCACHE_PY) -m pip install -q --no-deps "lmcache==$(LMCACHE_VERSION)"
	$(LMCACHE_PY) -m pip install -q --no-deps -r mk/lmcache-$(LMCACHE_VERSION)-deps.txt
	touch $@

install-lmcache: $(LMCACHE_VENV)/.installed

# tiercache serve against the file store, Redis and LMCache's own server, through SGLang's
# HiCacheController (benchmarks/bench_serve.py), in the newest SGLang's environment with
# LMCache's side run in its own; results in benchmarks/results/serve/.
.PHONY: bench-serve
bench-serve: install-sglang install-lmcache
	@command -v redis-server >/dev/null 2>&1 || bash .ci/install-redis || true
	TIERCACHE_LMCACHE_PYTHON=$(LMCACHE_PY) .venv-sglang-$(SGLANG_NEWEST)/bin/python \
	  -m benchmarks.run --only serve --out benchmarks/results/serve

ENGINE_BENCHES += bench-serve
