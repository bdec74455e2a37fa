# Every target builds its own virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: install run test test-core test-engines bench bench-engines bench-quick bench-gpu stress lint typecheck check docs docs-serve clean

# Engine integration suites (mk/*.mk) each add their target to ENGINE_TESTS. Each one
# builds its own virtual environment with the engine installed --no-deps at a pinned
# version: engines are test-only, never dependencies of the package.
ENGINE_TESTS :=
ENGINE_BENCHES :=
-include mk/*.mk

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) -m tiercache demo

test: test-core test-engines

# The engine suites run in their own environments, against the engines' real code:
# the core run leaves their folders (where they would only skip) and their markers out.
test-core: install
	@command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || bash .ci/install-redis || true
	$(PY) -m pytest -q -m "not sglang and not vllm" \
	  --ignore=tests/integrations/sglang --ignore=tests/integrations/vllm

test-engines: $(ENGINE_TESTS)

bench: install
	$(PY) -m tiercache bench
	$(MAKE) --no-print-directory bench-engines

bench-engines: $(ENGINE_BENCHES)

bench-quick: install
	$(PY) -m tiercache bench --quick

# On a CUDA machine (install a CUDA build of torch: make install TORCH=torch==2.13.0
# with the CUDA wheel index): the GPU tests, then the GPU, transfer and controller
# benchmarks (quick sizes), JSON under benchmarks/results/gpu. Under 5 minutes on one GPU.
bench-gpu: install
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench-gpu needs CUDA')"
	$(PY) -m pytest -q -m "gpu and not sglang and not vllm" \
	  --ignore=tests/integrations/sglang --ignore=tests/integrations/vllm
	$(PY) -m benchmarks.run --quick --only gpu,transfer,controller --out benchmarks/results/gpu

stress: install
	TIERCACHE_STRESS_SECONDS=120 $(PY) -m pytest -q -s tests/test_stress.py

# The documentation site, built strict: a broken link, a missing reference or a docstring
# that fails to render fails the build. The site lands in build/site.
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

typecheck: install
	$(VENV)/bin/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build site *.egg-info src/*.egg-info
