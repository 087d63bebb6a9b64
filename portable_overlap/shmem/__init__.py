"""Symmetric heap, peer pointer table, signals and bounded waits."""
from .heap import SymmetricHeap, heap_bytes
from .status import StatusBoard

__all__ = ["SymmetricHeap", "StatusBoard", "heap_bytes"]
