"""The tile-group-signal transport's configuration and constants, apart from its workspace
(api.py) so that the tuner (tune.py) and the copy-engine variant (copy_engine.py) import them
without importing the workspace that calls them."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch

from ...schedule import WaveGroups, as_wave_groups
from ..matmul.api import MatmulConfig

OP = "gemm_signal"
#: the public op of each kind (errors name it)
KINDS = {"all_reduce": "matmul_all_reduce", "reduce_scatter": "matmul_reduce_scatter",
         "all_to_all": "matmul_all_to_all"}
MAX_GROUPS = 256  # counters per context; a partition has at most this many groups
#: SMs the GEMM leaves to the collectives' kernels by default, per 132 (scaled by the device's
#: count): none. FlashOverlap leaves SMs to NCCL so that a group's collective runs beside the
#: GEMM; on 2x H200 NCCL made no measurable progress there (comm_slowdown 5-717) and a reserve
#: of 16 only slowed the GEMM: reserve 0 measured 4-7 % faster at 8192^3 and the tuner kept 0 at
#: all 4 shapes (docs/gemm_signal.md).
RESERVE_PER_132 = 0
#: the other reserve the tuner tries when the configured one is 0 (16 of 132 SMs, scaled)
ALT_RESERVE_PER_132 = 16


@dataclasses.dataclass(frozen=True)
class SignalConfig:
    """``matmul``: GEMM tiling (None: ``matmul.default_config``). ``reserve_sms``: SMs / CUs the
    GEMM grid leaves free for the collectives (None: ``RESERVE_PER_132``, i.e. none; a
    reserve helps only where a collective progresses beside the GEMM, which ``tune`` measures).
    ``partition``: wave-group sizes in tiles, schedule order; None: ``default_partition``;
    ``"tune"``: the first call of each shape runs ``GemmSignal.tune`` (collective, ~0.2–1.6 s on
    2x H200, cached on disk per shape and device) and every later call uses its pick.
    ``max_groups``: bound for the default partition: 2 (one wave, then the rest). On 2x H200
    NCCL's collectives made almost no progress beside the persistent GEMM (``comm_slowdown``
    5–717), so each extra group only adds its collective's fixed cost: up to 8 doubling groups
    measured 8–13 % slower than the best measured partition at each of the 4 shapes, one group
    1–3 %, [one wave, rest] 1–2 % (at the 2 shapes where the tuner measured it). ``gate``:
    ``"value"`` (each group's collective waits on its counter: the overlap) or ``"event"`` (the
    collectives wait for the whole GEMM by an event: the same kernels without overlap, a
    baseline and a fallback where a stream value wait cannot be captured in a graph)."""

    matmul: Optional[MatmulConfig] = None
    reserve_sms: Optional[int] = None
    partition: "Optional[tuple | str]" = None
    max_groups: int = 2
    gate: str = "value"

    def __post_init__(self):
        if self.gate not in ("value", "event"):
            raise ValueError(f"SignalConfig: gate must be 'value' or 'event': {self}")
        if self.matmul is not None and not isinstance(self.matmul, MatmulConfig):
            raise ValueError(f"SignalConfig: matmul must be a MatmulConfig or None: {self}")
        # counts are ints (not bools, not floats): a partition of (1.5, 2.5) was read as (1, 2)
        if self.reserve_sms is not None and (not _is_int(self.reserve_sms)
                                             or self.reserve_sms < 0):
            raise ValueError(f"SignalConfig: reserve_sms must be an int >= 0: {self}")
        if not _is_int(self.max_groups) or not 1 <= self.max_groups <= MAX_GROUPS:
            raise ValueError(f"SignalConfig: max_groups must be an int in 1..{MAX_GROUPS}: "
                             f"{self}")
        if isinstance(self.partition, str):
            if self.partition != "tune":
                raise ValueError(f"SignalConfig: partition must be group sizes, None or "
                                 f"'tune': {self}")
        elif self.partition is not None:
            sizes = (self.partition.sizes if isinstance(self.partition, WaveGroups)
                     else self.partition)
            if not hasattr(sizes, "__iter__") or not all(_is_int(s) for s in sizes):
                raise ValueError(f"SignalConfig: partition must be group sizes (ints), None or "
                                 f"'tune': {self}")
            object.__setattr__(self, "partition", as_wave_groups(self.partition).sizes)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: the per-call options of the signal_collective transport and the types each takes: a pattern
#: context made with ``transport="auto"`` runs a call that passes any of them on this transport
SIGNAL_CALL_OPTIONS = {"config": SignalConfig, "rms_weight": torch.Tensor, "eps": (int, float),
                       "normed": torch.Tensor}
