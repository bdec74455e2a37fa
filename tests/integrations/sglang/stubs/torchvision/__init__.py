"""Stand-in for `torchvision` (see tests/integrations/sglang/stubs/README.md)."""

from _tiercache_standin import module_getattr

__version__ = "0.0.0+tiercache.stand.in"
__getattr__ = module_getattr("torchvision")
