"""Helpers for tests, the demo and benchmarks (importable by users writing their own tests)."""
from .emulated import EmulatedWorld, RemoteError, WorkerHang

__all__ = ["EmulatedWorld", "RemoteError", "WorkerHang"]
