# vLLM integration suite: tiercache as a secondary tier of vLLM's offloading framework,
# tested against vLLM 0.33.0's own factory and TieringOffloadingManager on CPU.
# vLLM's wheel is a CUDA build; installed --no-deps next to torch's CPU build and the
# packages in mk/vllm-0.33.0-deps.txt, the offloading modules import and run. The list is
# what those imports need: triton (1 GB, GPU kernels), numba, typer, rich and the like are
# left out; vLLM runs without them on this path.
VLLM_VERSION ?= 0.33.0
VLLM_VENV    ?= .venv-vllm-$(VLLM_VERSION)
VLLM_PY       = $(VLLM_VENV)/bin/python

.PHONY: install-vllm test-vllm bench-vllm

$(VLLM_VENV)/.installed: pyproject.toml mk/vllm.mk mk/vllm-$(VLLM_VERSION)-deps.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q -e ".[dev]"
	$(VLLM_PY) -m pip install -q --no-deps "vllm==$(VLLM_VERSION)"
	$(VLLM_PY) -m pip install -q --no-deps -r mk/vllm-$(VLLM_VERSION)-deps.txt
	touch $@

install-vllm: $(VLLM_VENV)/.installed

test-vllm: install-vllm
	@command -v redis-server >/dev/null 2>&1 || bash .ci/install-redis || true
	TIERCACHE_REQUIRE_ENGINES=1 $(VLLM_PY) -m pytest -q -m vllm

# tiercache's tier against vLLM's own fs tier, through vLLM's manager (blocks/s, ratio).
bench-vllm: install-vllm
	$(VLLM_PY) benchmarks/bench_vllm.py

ENGINE_TESTS += test-vllm
ENGINE_BENCHES += bench-vllm
