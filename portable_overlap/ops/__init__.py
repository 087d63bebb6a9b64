"""The fused ops, one folder each (api: validate, workspace, launch; kernel; reference), the
contexts' shared base (context.py, pattern.py) and the op table (registry.py)."""
from .registry import SPECS, OpSpec

__all__ = ["SPECS", "OpSpec"]
