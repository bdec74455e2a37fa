"""Stand-in for `sgl_kernel` (see tests/integrations/sglang/stubs/README.md).

SGLang 0.5.9 imports its CUDA transfer kernels at module level in the host
pool module; the storage paths the tests drive never call them.
"""

from _tiercache_standin import module_getattr

__getattr__ = module_getattr("sgl_kernel")
