"""Launch configuration of the fused GEMV + AllReduce kernel: a validated dataclass, a heuristic
default, and the table of configurations measured best on a device (see benchmarks/)."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch

from ..context import G_MAX

_POW2 = (16, 32, 64, 128, 256, 512)
#: the most K slices per column block (``GemvConfig.split_k``): past a few the reducer's sum of
#: ``world * split_k`` partials and the partial stores cost more than the fuller grid gains
MAX_SPLIT_K = 8


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # output columns per tile
    block_k: int = 128  # K step of the W stream
    num_warps: int = 4
    num_stages: int = 4  # loads in flight in the K loop
    programs_per_sm: int = 2  # persistent programs per SM (clamped to what fits)
    # K slices per column block, one program each (the one-shot transport only; kernel.py)
    split_k: int = 1

    def __post_init__(self):
        # ints, not bools or floats (True passed every check below as 1, 1.5 the ranges)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                   for v in dataclasses.astuple(self)):
            raise ValueError(f"GemvConfig: every field must be an int: {self}")
        # as Python ints: a NumPy int (a sweep's value) was refused as split_k below, and
        # would key the plans and name the config apart from an equal one of ints
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, int(getattr(self, f.name)))
        if self.block_n not in _POW2 or self.block_k not in _POW2:
            raise ValueError(f"block_n and block_k must be powers of two in {_POW2}: {self}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16: {self}")
        if not 1 <= self.num_stages <= 8 or not 1 <= self.programs_per_sm <= 8:
            raise ValueError(f"num_stages in 1..8 and programs_per_sm in 1..8: {self}")
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"split_k must be an int in 1..{MAX_SPLIT_K}: {self}")


#: Best configurations measured on a device kind, keyed by (arch, world, M bucket, N); the
#: comment names the K_local each was measured at. Not keyed by K: each rank passes its own K
#: shard, and ranks whose shards differ must still pick the same column blocks and grid (the
#: flags' tag carries them), which a choice by K would split. Filled from the tuning sweep of
#: ci/gpu.sh; anything missing uses the heuristic below. Measured on nvidia-h200-x2
#: (benchmarks/results/nvidia-h200-x2.jsonl, op "gemv_allreduce_tuning"): bf16, graph replay,
#: fastest of the sweep in bench_gemv_allreduce.py; taken for 16-bit dtypes.
TUNED: dict = {
    ("sm_90", 2, 16, 8192): GemvConfig(64, 128, 4, 6, 1),  # K 14336; M=1: 68.4 us, M=8: 69.1
    ("sm_90", 2, 32, 8192): GemvConfig(64, 128, 4, 6, 1),  # K 14336; 73.1 us
    ("sm_90", 2, 16, 16384): GemvConfig(128, 128, 4, 4, 1),  # K 26624; 208.5 us
    ("sm_90", 2, 16, 4096): GemvConfig(32, 256, 4, 4, 2),  # K 7168; 33.5 us
}


def m_bucket(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def stage_bytes(cfg: GemvConfig, m: int, dtype: torch.dtype) -> int:
    """Shared memory of the K loop's pipeline, counted high: a W tile [block_n, block_k] and an
    x tile [max(16, m rounded up to a power of two), block_k] per stage. Triton's pipeliners
    allocate num_stages - 1 of them for some loops and num_stages for others (compiled: fp32
    32 x 64 at 4 stages and M = 64, 72 KiB on gfx942, three; bf16 32 x 256 at 5 stages and
    M = 64, 240 KiB on sm_90, five: tests/test_compile_configs.py)."""
    block_m = max(16, 1 << (max(1, m) - 1).bit_length())
    return cfg.num_stages * (cfg.block_n + block_m) * cfg.block_k * dtype.itemsize


def fit_shared(cfg: GemvConfig, m: int, dtype: torch.dtype, limit: int) -> GemvConfig:
    """``cfg`` with fewer stages, then shorter K steps, until its pipeline fits ``limit`` bytes of
    shared memory (LDS): gfx942 has 64 KiB per workgroup, where fp32 at M = 64 needs 72 KiB with
    the heuristic's 4 stages; H200 has 227 KiB."""
    while stage_bytes(cfg, m, dtype) > limit:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, arch: str, sm_count: int,
                world: int, shared_limit: int = 0, partial_room: int = 0) -> GemvConfig:
    """The measured config for this device and shape, else the heuristic below; with
    ``shared_limit`` (bytes one program may take), made to fit it (``fit_shared``). ``k``
    (this rank's K shard) does not move the choice: every rank of a call picks the same
    config whatever its shard (``TUNED``). ``partial_room``: the elements of one rank's slot
    of the one-shot transport's partials (64 x ``max_n``), where a K split may be picked
    (``split_for``); 0 (the two-shot transport): never."""
    cfg = _pick(m, n, k, dtype, arch, sm_count, world)
    if shared_limit:
        cfg = fit_shared(cfg, m, dtype, shared_limit)
    if partial_room:
        cfg = dataclasses.replace(cfg, split_k=split_for(cfg, m, n, dtype, arch, sm_count,
                                                         partial_room))
    return cfg


def split_for(cfg: GemvConfig, m: int, n: int, dtype: torch.dtype, arch: str, sm_count: int,
              partial_room: int) -> int:
    """The K split of the one-shot transport for ``cfg``'s column blocks: where they are fewer
    than 0.6 of the SMs (narrow N), the larger of 2 and 4 whose ``n_blocks * split`` programs
    fit the persistent grid (``programs_per_sm`` per SM, ``G_MAX``) and whose partials fit the
    rank's slot (``split * m * n <= partial_room``). 1 for fp32 (it streams twice the bytes per
    column: not measured split) and under the interpreter (its programs run one after
    another). Like the rest of the choice, not by K: ranks whose shards differ must split
    alike (the flags' tag carries the split).

    From one H200 (a world of one, bf16, graph replay; docs/gemv_allreduce.md, "Where it falls
    short"): the 0.6 from N = 1536 (96 blocks, 0.73 of the SMs), where a split of 2 ran 0.90x
    the unsplit kernel, the partials' stores and their reduction costing more than the fuller
    grid gains; 4 before 2 because 4 runs 1.04-1.15x a split of 2 at four shapes of N = 1024,
    1.3-1.4x at N = 512, and 3 % slower at 16 x 1024 x 2048, whose short K neither split
    helps."""
    n_blocks = -(-n // cfg.block_n)
    if arch == "cpu" or dtype.itemsize != 2 or n_blocks >= 0.6 * sm_count:
        return 1
    fits = [s for s in (4, 2)
            if split_misfit(dataclasses.replace(cfg, split_k=s), m, n, sm_count,
                            partial_room) is None]
    return fits[0] if fits else 1


def split_misfit(cfg: GemvConfig, m: int, n: int, sm_count: int,
                 partial_room: int) -> Optional[str]:
    """Why ``cfg``'s K split does not fit (None where it does): its partials past the rank's
    slot of ``partial_room`` elements, or its ``n_blocks * split_k`` programs past a
    persistent grid (``programs_per_sm`` per SM, at most ``G_MAX``), all of which must run at
    once (kernel.py). The rule (``split_for``) picks only splits that fit; a config given with
    one that does not is refused with this reason."""
    split, n_blocks = cfg.split_k, -(-n // cfg.block_n)
    if split * m * n > partial_room:
        return (f"split_k={split} at M={m}, N={n} needs {split * m * n} partial elements per "
                f"rank, past the context's {partial_room} (64 x max_n); use split_k <= "
                f"{max(1, partial_room // (m * n))}")
    cap = min(sm_count * cfg.programs_per_sm, G_MAX)
    if n_blocks * split > cap:
        return (f"split_k={split} needs {n_blocks * split} programs ({n_blocks} column blocks "
                f"x {split}), past the {cap} of a persistent grid here (programs_per_sm x SMs, "
                f"at most {G_MAX}); use a smaller split_k")
    return None


def _pick(m: int, n: int, k: int, dtype: torch.dtype, arch: str, sm_count: int,
          world: int) -> GemvConfig:
    # measured for bf16: a 16-bit dtype's stream (fp32 moves twice the bytes per column and
    # spilled registers in the 128-wide tiles on sm_90)
    hit = TUNED.get((arch, world, m_bucket(m), n)) if dtype.itemsize == 2 else None
    if hit is not None:
        return hit
    if arch == "cpu":  # the interpreter: few, small programs keep the emulated run short
        return GemvConfig(block_n=16 if n <= 64 else 32, block_k=32, num_warps=1, num_stages=1,
                          programs_per_sm=1)
    if dtype == torch.float32:
        return GemvConfig(block_n=32, block_k=64, num_warps=4, num_stages=4, programs_per_sm=2)
    # By 64-column blocks per SM: every SM needs W rows to stream, so the fewer the columns, the
    # narrower the tile and the longer its K step. From a sweep of 10 configs at 24 decode
    # shapes on one H200 (M 1 / 8 / 32, N 1024-28672, K 1024-18944; benchmarks/results/logs/
    # 2026-11-24-h200-gemv-untuned-shapes): each band's pick ran at 0.94-1.00 of the sweep's
    # best at every shape in it, and at 0.76-1.00 (median 0.99) at 16 other shapes, where a
    # two-band rule (64 x 128 over six stages, else 16- or 32-wide tiles with K steps of 256)
    # ran at 0.70-1.00 and 0.68-1.00. K moves the best choice too (short K favours two
    # programs per SM), which the bands do not model yet.
    cols = n / 64 / sm_count
    if cols >= 1.2:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2)
    if cols >= 0.9:
        return GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=6, programs_per_sm=2)
    if cols >= 0.55:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6, programs_per_sm=1)
    if cols >= 0.25:
        return GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=6, programs_per_sm=1)
    return GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, programs_per_sm=2)
