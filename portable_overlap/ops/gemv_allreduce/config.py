"""Launch configuration of the fused GEMV + AllReduce kernel: a validated dataclass, a heuristic
default, and the table of configurations measured best on a device (see benchmarks/)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

_POW2 = (16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # output columns per tile
    block_k: int = 128  # K step of the W stream
    num_warps: int = 4
    num_stages: int = 4  # loads in flight in the K loop
    programs_per_sm: int = 2  # persistent programs per SM (clamped to what fits)

    def __post_init__(self):
        if self.block_n not in _POW2 or self.block_k not in _POW2:
            raise ValueError(f"block_n and block_k must be powers of two in {_POW2}: {self}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16: {self}")
        if not 1 <= self.num_stages <= 8 or not 1 <= self.programs_per_sm <= 8:
            raise ValueError(f"num_stages in 1..8 and programs_per_sm in 1..8: {self}")


#: Best configurations measured on a device kind, keyed by (arch, world, M bucket, N, K_local).
#: Filled from the tuning sweep of ci/gpu.sh; anything missing uses the heuristic below.
TUNED: dict = {}


def m_bucket(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, arch: str, sm_count: int,
                world: int) -> GemvConfig:
    hit = TUNED.get((arch, world, m_bucket(m), n, k))
    if hit is not None:
        return hit
    if arch == "cpu":  # the interpreter: few, small programs keep the emulated run short
        return GemvConfig(block_n=16 if n <= 64 else 32, block_k=32, num_warps=1, num_stages=1,
                          programs_per_sm=1)
    # Enough column blocks to give every SM two programs, the widest tile that still does.
    block_n = 16
    for bn in (128, 64, 32):
        if -(-n // bn) >= 2 * sm_count:
            block_n = bn
            break
    block_k = 256 if dtype != torch.float32 else 128
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=4,
                      programs_per_sm=2)
