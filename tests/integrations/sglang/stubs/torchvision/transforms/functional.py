"""Stand-in for `torchvision.transforms.functional` (see tests/integrations/sglang/stubs/README.md)."""

from .._placeholder import module_getattr

__getattr__ = module_getattr("torchvision.transforms.functional")
