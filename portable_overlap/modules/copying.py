"""Copies of the layers (``copy.deepcopy``, ``pickle``, ``torch.save(layer)``): what they take."""
from __future__ import annotations


class FusedLayerState:
    """Mixin of the layers: a copy of a fused layer raises a ``TypeError`` that names the layer
    and the way out, where pickle would stop at a lock of its contexts ("cannot pickle
    '_thread.lock' object"). Those contexts hold memory that every rank maps together
    (symmetric heap, flags, host segments), which a copy on one rank cannot make. A layer of
    the reference path (``fused=False``) holds none and copies as any module does."""

    def __getstate__(self):
        if getattr(self, "fused", False):
            name = type(self).__name__
            raise TypeError(f"{name}: a fused layer cannot be copied or pickled (its contexts' "
                            f"symmetric memory is made by every rank together): make another "
                            f"layer with the same arguments on every rank and copy the weights "
                            f"with new.load_state_dict(layer.state_dict())")
        return super().__getstate__()
