"""Stand-in for `torchvision.transforms` (see tests/integrations/sglang/stubs/README.md)."""

from _tiercache_standin import module_getattr

__getattr__ = module_getattr("torchvision.transforms")
