"""The MoE experts' first GEMMs (gate and up) with SiLU-gating, grouped over the dispatch layout."""
from .api import expert_swiglu
from .reference import expert_swiglu_reference

__all__ = ["expert_swiglu", "expert_swiglu_reference"]
