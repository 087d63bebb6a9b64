"""Helpers for tests, the demo and benchmarks (importable by users writing their own tests)."""
from .emulated import EmulatedWorld, RemoteError, WorkerHang
from .faults import call_while_peers_skip, error_of_one_call

__all__ = ["EmulatedWorld", "RemoteError", "WorkerHang", "call_while_peers_skip",
           "error_of_one_call"]
