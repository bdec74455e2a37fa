"""Whether vLLM's real code can be tested here.

Call `require_vllm` at the top of a test module, before importing vLLM: where
vLLM is not installed the module is skipped with the reason, except under
``TIERCACHE_REQUIRE_ENGINES=1`` (``make test-vllm``, CI), where a missing
engine fails the run.
"""

from __future__ import annotations

import importlib
import os
import warnings

import pytest

VLLM_VERSION = "0.33.0"


#: vLLM's modules the tests use. Importing vLLM (and torch's compiler, which it
#: pulls in) emits deprecation warnings that are vLLM's, not ours: they are
#: imported once here with warnings silenced, since pytest turns warnings into
#: errors.
VLLM_MODULES = (
    "vllm.config.kv_transfer",
    "vllm.v1.kv_offload.tiering.factory",
    "vllm.v1.kv_offload.tiering.spec",
    "vllm.v1.kv_offload.tiering.manager",
    "vllm.v1.kv_offload.tiering.fs.manager",
)


def require_vllm() -> None:
    """Skip the calling module when vLLM is missing, unless engines are required."""
    required = os.environ.get("TIERCACHE_REQUIRE_ENGINES") == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for module in VLLM_MODULES:
                importlib.import_module(module)
        except ImportError as e:
            if required:
                raise
            pytest.skip(
                f"vllm is not importable ({e}): `make test-vllm` builds a venv with "
                f"vllm=={VLLM_VERSION}",
                allow_module_level=True,
            )
