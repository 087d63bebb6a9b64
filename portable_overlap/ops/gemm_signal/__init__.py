"""GEMM with tile-group signals: wave groups of finished tiles go through ordinary collectives
(AllReduce, ReduceScatter, All-to-All) gated by stream waits, then a reorder restores the layout;
or (ReduceScatter) copy-engine transfers gated by the same counters (copy_engine.py)."""
from .api import (GemmSignal, SignalConfig, gemm_all_reduce, gemm_all_to_all_signal,
                  gemm_reduce_scatter)
from .reference import (gemm_all_reduce_reference, gemm_all_to_all_signal_reference,
                        gemm_reduce_scatter_reference)
from .copy_engine import GemmReduceScatterCE, gemm_reduce_scatter_ce
from .tune import tune_partition

__all__ = ["GemmSignal", "SignalConfig", "gemm_all_reduce", "gemm_reduce_scatter",
           "gemm_all_to_all_signal", "gemm_all_reduce_reference", "gemm_reduce_scatter_reference",
           "gemm_all_to_all_signal_reference", "tune_partition",
           "GemmReduceScatterCE", "gemm_reduce_scatter_ce"]
