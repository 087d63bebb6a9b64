"""The tile-group-signal transport of the GEMM patterns: a persistent GEMM counts finished tiles
per wave group; each group's counter gates an ordinary collective (AllReduce, ReduceScatter,
All-to-All) on a side stream and a reorder restores the layout (api.py), or gates copy-engine
transfers (ReduceScatter, copy_engine.py). Used through ``MatmulAllReduce``,
``MatmulReduceScatter`` and ``MatmulAllToAll`` with ``transport="signal_collective"`` /
``"signal_copy_engine"``."""
from .api import GemmSignal, SignalConfig
from .reference import (gemm_all_reduce_reference, gemm_all_to_all_signal_reference,
                        gemm_reduce_scatter_reference)
from .copy_engine import GemmReduceScatterCE
from .tune import tune_partition

__all__ = ["GemmSignal", "SignalConfig", "gemm_all_reduce_reference",
           "gemm_reduce_scatter_reference", "gemm_all_to_all_signal_reference", "tune_partition",
           "GemmReduceScatterCE"]
