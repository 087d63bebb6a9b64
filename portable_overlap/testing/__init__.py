"""Helpers for tests, the demo, the tutorials and benchmarks (importable by users writing their
own tests)."""
from ..schedule.tuning import time_call, time_paths
from .emulated import EmulatedWorld, RemoteError, WorkerHang
from .environment import environ
from .faults import (call_while_peers_skip, error_of_one_call, late_and_refused,
                     not_refused_together, outcomes)
from .spmd import launched, report, run_on_ranks

__all__ = ["EmulatedWorld", "RemoteError", "WorkerHang", "call_while_peers_skip", "environ",
           "error_of_one_call", "late_and_refused", "launched", "not_refused_together",
           "outcomes", "report", "run_on_ranks", "time_call", "time_paths"]
