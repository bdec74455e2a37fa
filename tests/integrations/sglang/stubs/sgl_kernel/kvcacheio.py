"""Stand-in for `sgl_kernel.kvcacheio` (see tests/integrations/sglang/stubs/README.md)."""

from _tiercache_standin import module_getattr

__getattr__ = module_getattr("sgl_kernel.kvcacheio")
