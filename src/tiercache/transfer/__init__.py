"""Moving pages between memory tiers: copy streams, the copy engine, layer futures."""

from tiercache.transfer.engine import CopyEngine, TransferPlan
from tiercache.transfer.layer_done import LayerDoneCounter, LayerDoneSet
from tiercache.transfer.streams import CopyStream

__all__ = ["CopyEngine", "CopyStream", "LayerDoneCounter", "LayerDoneSet", "TransferPlan"]
