"""Host-side schedules of the fused ops: which output tiles form a wave group, and where each tile
travels in a contiguous staging buffer (wave_groups.py); the predictive search over group
partitions (predict.py); decisions cached per shape and shared by the ranks (tuning.py)."""
from .predict import Calibration, candidate_partitions, predict_ms, search, search_top
from .tuning import MemoryCache, TuningCache, cache_key, decide, measure_comm_curve, time_call
from .wave_groups import (TileLayout, WaveGroups, as_wave_groups, default_partition,
                          default_partitions, grouped_tile, tile_layout)

__all__ = ["WaveGroups", "TileLayout", "as_wave_groups", "default_partition",
           "default_partitions", "grouped_tile", "tile_layout", "Calibration",
           "candidate_partitions", "predict_ms", "search", "search_top", "MemoryCache",
           "TuningCache", "cache_key", "decide", "measure_comm_curve", "time_call"]
