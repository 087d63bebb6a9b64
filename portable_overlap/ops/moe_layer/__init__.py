"""The MoE layer after routing (dispatch, both expert GEMMs, combine) with the dispatch's
scatter, the two GEMMs and the combine's stores in one persistent launch."""
from .api import moe_layer
from .reference import moe_layer_reference

__all__ = ["moe_layer", "moe_layer_reference"]
