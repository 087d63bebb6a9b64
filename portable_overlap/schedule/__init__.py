"""Host-side schedules of the fused ops: which output tiles form a wave group, and where each tile
travels in a contiguous staging buffer (see wave_groups.py)."""
from .wave_groups import (TileLayout, WaveGroups, as_wave_groups, default_partition,
                          default_partitions, grouped_tile, tile_layout)

__all__ = ["WaveGroups", "TileLayout", "as_wave_groups", "default_partition",
           "default_partitions", "grouped_tile", "tile_layout"]
