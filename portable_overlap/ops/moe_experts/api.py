"""The MoE experts' first GEMMs with the gated activation, over the dispatch layout.

On rank r, with ``x, counts, slots = moe_dispatch(...)`` (rows by source rank q, then local
expert e, ``counts[q, e]`` rows each)::

    h[i] = silu(x[i] @ w_gate[e(i)]) * (x[i] @ w_up[e(i)])        # [R, I], R = counts.sum()

one persistent grouped kernel (kernel.py) that reads ``counts`` on the device, so ``x`` may have
more rows than R (the dispatch's ``capacity``) and the call needs no host sync: it can be
captured in a CUDA graph with the dispatch and the combine around it. The gate and up tiles
share one pass over the rows, and SiLU-gating runs in the epilogue in float32. Bulk tensor
copies (TMA) load the tiles where the device has them and the operands allow
(``ops.matmul.api.tile_descriptors``'s rules, and ``hidden`` a multiple of the K block).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton

from ...tiles.gemv import dot_precision, dot_upcast
from ...kept import GrowingBuffer
from ..context import check_no_overlap
from ..registry import PartSpec, define_part
from ..matmul.api import DTYPES, MatmulConfig, tile_descriptors
from .kernel import expert_swiglu_kernel, pack_rows_kernel

OP = "expert_swiglu"
#: rows and columns of x the pack launch copies per step (8 KiB of bf16), with up to 4 programs
#: per processor: one H200 copied 1029 rows of 7168 in 8.4 us so (torch's copy of the same
#: rows, contiguous: 11.9), in 10.8 with 16 x 512 and 128 programs
PACK_BLOCK_R = 4
PACK_BLOCK_H = 1024


#: the gated GEMM's 16-bit tiles on 64-lane wavefronts (AMD CDNA; no tensor descriptors there).
#: Two accumulators per tile: compiled for gfx942 / gfx950 (bf16, pointer loads), 128 x 128 x 64
#: spills 90 / 56 VGPRs with 8 warps and 31 / 81 with 4; 128 x 64 x 64 with 4 warps and 3 stages
#: spills none (381 / 406 of 512 VGPRs, 384 / 407 with a masked K tail) in 16 / 64 KiB of LDS.
#: With 8 warps it compiles to 224 / 244 of the 256 VGPRs a wavefront then gets, without a
#: spill but 12 short of the limit on gfx950. Compiled in tests/test_compile_configs.py.
WAVE64_TILE = MatmulConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)


def default_config(dtype: torch.dtype, device: torch.device, descriptors: bool,
                   rows_per_segment: float = float("inf")) -> MatmulConfig:
    """The tiling of ``device`` (its ``DeviceFacts``): ``tile_config``."""
    if device.type == "cpu":
        return MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1,
                            num_stages=1)
    from ...backends import device_facts

    return tile_config(dtype, device_facts(device), descriptors, rows_per_segment)


def tile_config(dtype: torch.dtype, facts, descriptors: bool,
                rows_per_segment: float = float("inf")) -> MatmulConfig:
    """Two accumulators per tile. Through descriptors, 128 x 128 tiles over 8 warps compile to
    176 registers on sm_90 without a spill; with pointer loads they spill (255 registers and
    560 bytes of stack), 128 x 64 does not (249 registers). Where segments hold 64 rows or
    fewer (decode), 64 x 256 tiles: on one H200 at 128 tokens per rank they ran 0.48-0.70x the
    128 x 128 time on Mixtral-like experts and 0.97-1.03x on DeepSeek-like ones, balanced or
    Zipf routing, 2- and 8-rank layouts (benchmarks/tune_moe_experts.py); at 33-64 rows
    through descriptors the op picks its tiles on the device instead (``decode_variants``). On
    64-lane wavefronts: ``WAVE64_TILE`` (never timed on AMD hardware, so no decode variant
    there yet)."""
    if dtype == torch.float32:
        return MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    if facts.warp_size == 64:
        return WAVE64_TILE
    if rows_per_segment <= 64:
        return MatmulConfig(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3)
    return MatmulConfig(block_m=128, block_n=128 if descriptors else 64, block_k=64,
                        num_warps=8, num_stages=3)


#: the decode variants' light and heavy tiles (``decode_variants``), and the most rows per
#: non-empty segment, on average over the call, that the light ones take
LIGHT_TILE = MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
HEAVY_TILE = MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
LIGHT_ROWS = 96


#: the same two on CPU-emulated ranks (the interpreter's small tiles)
CPU_VARIANTS = (MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1,
                             num_stages=1),
                MatmulConfig(block_m=32, block_n=16, block_k=16, group_m=2, num_warps=1,
                             num_stages=1))


def decode_variants(dtype: torch.dtype, device: torch.device, facts, descriptors: bool,
                    rows_per_segment: float) -> Optional[tuple]:
    """Whether ``expert_swiglu`` picks its tiles on the device (kernel.py, ``VARIANT``): two
    launches, ``LIGHT_TILE`` where the call's segments hold ``LIGHT_ROWS`` rows or fewer on
    average and ``HEAVY_TILE`` past that, each running the call or nothing (the other costs a
    launch). For 16-bit tiles through descriptors on 32-lane warps, where segments hold 33-64
    rows on average by the host's estimate (decode sizes that packing does not serve). One
    H200, 128 tokens per rank, DeepSeek-like experts laid out for 2, 4 and 8 ranks
    (``benchmarks/tune_moe_experts.py``): 64 x 128 tiles 0.154 / 0.137 / 0.133 ms with
    balanced routing against 0.172 / 0.161 / 0.159 for the 64 x 256 ones, and 128 x 128 tiles
    0.176 / 0.162 / 0.157 with Zipf routing on the rank of the popular experts (twice the
    rows) against 0.193 / 0.177 / 0.176 for 64 x 128; the host, which never reads the counts,
    cannot tell the two apart. Returns the (light, heavy) tiles or None (on CPU-emulated ranks
    ``CPU_VARIANTS``, at the same sizes)."""
    if not 32 < rows_per_segment <= 64:
        return None
    if device.type == "cpu":
        return CPU_VARIANTS
    if dtype in (torch.bfloat16, torch.float16) and descriptors and facts.warp_size == 32:
        return LIGHT_TILE, HEAVY_TILE
    return None


def pack_rows(rows_per_segment: float, sources: int, block_m: int) -> bool:
    """Whether ``expert_swiglu`` packs experts (kernel.py: an expert's rows of all sources
    copied end to end, so its row tiles are full): with 2 sources or more where a segment fills
    at most half a row tile on average; the device then packs the experts whose row tiles that
    halves (``kernel.expert_layout``). One H200, 128 tokens per rank, 64 x 256 tiles
    (``benchmarks/tune_moe_experts.py``): Mixtral-like experts laid out for 8 ranks (32 rows
    per segment) 0.108 ms packed against 0.184 per source, for 4 ranks 0.169 against 0.201;
    DeepSeek-like ones (64 rows per segment, where packing cuts the tiles by a third, not by
    half), every expert packed, 0.170-0.195 against 0.153-0.173: the pack launch costs 8-11 us
    and the GEMM on the fewer tiles ran no faster."""
    return sources >= 2 and rows_per_segment <= block_m / 2


def pack_capacity(rows: int, rows_per_segment: float, segments: int, block_m: int) -> int:
    """Rows of the packed buffer: twice the rows the segments hold on average (experts that
    do not fit keep their per-source tiles), at most ``rows``."""
    return max(1, min(rows, max(block_m, math.ceil(2 * rows_per_segment * segments))))


def _descriptors(x, w_gate, w_up, cfg, facts) -> tuple:
    """(x, w_gate, w_up) descriptors, the weights described as one [E * H, I] stack; Nones
    where the pointer loads must do (``tile_descriptors``' rules, or H not a multiple of the K
    block, where a block would read into the next expert's rows)."""
    E, H, I = w_gate.shape
    if H % cfg.block_k or not (w_gate.is_contiguous() and w_up.is_contiguous()):
        return None, None, None
    x_desc, wg_desc = tile_descriptors(x, w_gate.view(E * H, I), cfg, facts)
    if x_desc is None:
        return None, None, None
    return x_desc, wg_desc, tile_descriptors(x, w_up.view(E * H, I), cfg, facts)[1]


def expert_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  counts: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                  config: Optional[MatmulConfig] = None, programs: Optional[int] = None,
                  gather: Optional[bool] = None, split: Optional[bool] = None,
                  rows_per_segment: Optional[float] = None) -> torch.Tensor:
    """``h`` [x.shape[0], I] of the module docstring for ``x`` [rows, H], ``w_gate`` / ``w_up``
    [E, H, I] and ``counts`` int32 [W, E] (its sum at most ``rows``; the rows past the sum are
    left as they are in ``out``, whose rows must be contiguous and must not overlap: any row
    stride of at least I). Counts that are not rows of ``x`` (a negative one, or more
    rows than it has: read on the device, never by the host) compute nothing and leave all of
    ``out`` as it is.

    ``rows_per_segment``: how many rows a (source, expert) segment holds on average, which picks
    the tiles (``default_config``) and whether experts may be packed (``pack_rows``); the host
    never reads ``counts``, so by default it is ``rows / counts.numel() / W``, the mean under a
    dispatch buffer of the default capacity (every rank's tokens). ``gather``: whether row
    tiles may hold an expert's rows of all sources together (kernel.py's packed experts):
    None packs, where segments are small (``pack_rows``), the experts whose row tiles that
    halves; True every expert with rows; False none. ``split``: whether the tiles of the
    grid's last, partial round may be cut into ranges of K steps that the idle programs run
    side by side (kernel.py, ``SPLIT_NOTE``): None (the default) or True wherever that round
    leaves at least half of the programs idle (the device decides from the tile count), False
    never. A split tile's float32 sum is taken in parts, so its bits differ from an unsplit
    call's by rounding (every call with the same counts gives the same bits). Under
    ``torch.compile`` one opaque op, ``torch.ops.portable_overlap.expert_swiglu(x, w_gate,
    w_up, counts, rows_per_segment)`` (``out``, ``config``, ``programs``, ``gather`` and
    ``split`` make it a graph break). Inference only (no autograd).

    The op keeps its buffers per device and stream between calls (``workspace``): the split
    tiles' partials and counts, and the packed experts' rows; one that grows keeps the buffer
    it replaces, which a CUDA graph captured before may still use (``free_workspaces`` drops
    them all)."""
    return EXPERT_SWIGLU((x, w_gate, w_up, counts, rows_per_segment), out=out, config=config,
                         programs=programs, gather=gather, split=split)


#: the op's buffers kept between calls, by (device, stream, name, dtype): see ``workspace``
_WORKSPACES: dict = {}


def workspace(device: torch.device, name: str, numel: int, dtype: torch.dtype,
              zero: bool = False) -> torch.Tensor:
    """``numel`` elements of the buffer ``name`` kept for ``device`` and its current stream,
    grown (and zero-filled where ``zero``) when a call needs more. Calls on one stream run in
    order, so they may share it; a buffer the kernel needs zeroed (the split tiles' counts) is
    left zeroed by the kernel itself, so it is filled once, when made.

    A buffer that grows is replaced, at least doubled, and the old one is kept, not freed
    (``kept.GrowingBuffer``): a graph captured with it (warm-up and capture at a small token
    count, then a larger call, as torch's capture recipe runs them) replays into its
    addresses. ``free_workspaces`` drops both, once no captured graph that used them is
    replayed."""
    stream = getattr(torch.get_device_module(device).current_stream(device), "stream_id", 0)
    key = (device, stream, name, dtype)
    buf = _WORKSPACES.get(key)
    if buf is None:
        buf = _WORKSPACES[key] = GrowingBuffer(device, dtype, zero)
    return buf.get(numel)


def free_workspaces(device: Optional[torch.device] = None) -> None:
    """Drop the buffers ``expert_swiglu`` keeps between calls (``workspace``), and those it
    replaced by larger ones, on ``device`` or on every device; the next call makes them again.
    No CUDA graph captured with them may be replayed after this."""
    for key in [k for k in _WORKSPACES if device is None or k[0] == torch.device(device)]:
        del _WORKSPACES[key]


def _run(x, w_gate, w_up, counts, rows_per_segment=None, out=None, config=None, programs=None,
         gather=None, split=None) -> torch.Tensor:
    _validate(x, w_gate, w_up, counts, out)
    if rows_per_segment is not None and not (isinstance(rows_per_segment, (int, float))
                                             and 0 <= rows_per_segment < float("inf")):
        raise ValueError(f"{OP}: rows_per_segment must be a finite number >= 0, got "
                         f"{rows_per_segment!r}")
    E, H, I = w_gate.shape
    if out is None:
        out = torch.empty((x.shape[0], I), dtype=x.dtype, device=x.device)
    from ...backends import device_facts

    facts = device_facts(x.device)
    G = max(1, programs or facts.sm_count)
    n_seg, W = counts.numel(), counts.shape[0]
    m = x.shape[0] / n_seg / W if rows_per_segment is None else rows_per_segment
    cfg = config or default_config(x.dtype, x.device, True, m)
    x_desc, wg_desc, wu_desc = _descriptors(x, w_gate, w_up, cfg, facts)
    if config is None and wu_desc is None:
        cfg = default_config(x.dtype, x.device, False, m)
    use_desc = wu_desc is not None
    pack = (1 if pack_rows(m, W, cfg.block_m) else 0) if gather is None else (2 if gather else 0)
    consts = dict(BLOCK_SRC=1 << max(0, W - 1).bit_length(),
                  BLOCK_E=1 << max(0, E - 1).bit_length(), PACK=pack)
    packed = row_map = p_desc = None
    cap = 0
    if pack:
        cap = x.shape[0] if pack == 2 else pack_capacity(x.shape[0], m, n_seg, cfg.block_m)
        packed = workspace(x.device, "packed", cap * H, x.dtype).view(cap, H)
        row_map = workspace(x.device, "row_map", cap, torch.int32)
        if use_desc:  # (x's descriptor held H in whole K blocks: so does a contiguous copy)
            p_desc = tile_descriptors(packed, w_gate.view(E * H, I), cfg, facts)[0]
        pack_rows_kernel[(max(1, min(4 * G, triton.cdiv(cap, PACK_BLOCK_R))),)](
            x, counts, packed, row_map, H, W, E, cap, x.shape[0], x.stride(0), x.stride(1),
            packed.stride(0), BLOCK_M=cfg.block_m, BLOCK_R=PACK_BLOCK_R,
            BLOCK_H=min(PACK_BLOCK_H, triton.next_power_of_2(H)), **consts, num_warps=4)
    launches = [(cfg, 0, x_desc, wg_desc, wu_desc)]
    variants = None if config or pack else decode_variants(x.dtype, x.device, facts, use_desc, m)
    if variants:
        launches = [(c, v + 1, *(_descriptors(x, w_gate, w_up, c, facts) if use_desc
                                 else (None, None, None)))
                    for v, c in enumerate(variants)]
    split = split is None or bool(split)
    ws = done = None
    if split:  # a partial tile pair per program and a count per tile (zero between calls)
        ws = workspace(x.device, "split_partials",
                       G * 2 * max(c.block_m * c.block_n for c, *_ in launches), torch.float32)
        done = workspace(x.device, "split_counts", G, torch.int32, zero=True)
    for c, variant, xd, gd, ud in launches:
        expert_swiglu_kernel[(G,)](
            x, w_gate, w_up, counts, out, xd, gd, ud, packed, p_desc, row_map, cap, ws, done,
            LIGHT_ROWS, x.shape[0], I, H, n_seg, E, x.stride(0), x.stride(1), w_gate.stride(0),
            w_gate.stride(1), w_gate.stride(2), out.stride(0), packed.stride(0) if pack else 0,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            NUM_STAGES=c.num_stages, EVEN_K=H % c.block_k == 0, PRECISION=dot_precision(x.dtype),
            UPCAST=dot_upcast(x.dtype), USE_DESC=use_desc,
            BLOCK_SEG=1 << max(0, n_seg - 1).bit_length(), VARIANT=variant, SPLIT=split,
            **consts, num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def _fake(x, w_gate, w_up, counts, rows_per_segment=None):
    return x.new_empty((x.shape[0], w_gate.shape[-1]))


EXPERT_SWIGLU = define_part(PartSpec(
    OP, "(Tensor x, Tensor w_gate, Tensor w_up, Tensor counts, float? rows_per_segment=None) "
        "-> Tensor", run=_run, fake=_fake, grad_args=("x", "w_gate", "w_up")))


def _validate(x, w_gate, w_up, counts, out) -> None:
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("counts", counts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a tensor")
        if t.device != x.device:
            raise ValueError(f"{OP}: {name} must be on {x.device}, got {t.device}")
    if x.dtype not in DTYPES or w_gate.dtype != x.dtype or w_up.dtype != x.dtype:
        raise TypeError(f"{OP}: x, w_gate and w_up must share one dtype of {DTYPES}; got "
                        f"{x.dtype}, {w_gate.dtype}, {w_up.dtype}")
    if x.dim() != 2 or w_gate.dim() != 3 or w_up.shape != w_gate.shape \
            or w_up.stride() != w_gate.stride() or w_gate.shape[1] != x.shape[1]:
        raise ValueError(f"{OP}: need x [rows, H] and w_gate, w_up [E, H, I] of one shape and "
                         f"strides; got {tuple(x.shape)}, {tuple(w_gate.shape)} strides "
                         f"{w_gate.stride()}, {tuple(w_up.shape)} strides {w_up.stride()}")
    E = w_gate.shape[0]
    # (no source row, [0, E], divided the mean rows per segment by zero)
    if counts.dtype != torch.int32 or counts.dim() != 2 or counts.shape[1] != E \
            or counts.shape[0] < 1 or not counts.is_contiguous():
        raise ValueError(f"{OP}: counts must be a contiguous int32 [W, {E}] tensor, W >= 1; got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    if min(w_gate.shape) < 1:
        raise ValueError(f"{OP}: empty weights {tuple(w_gate.shape)}")
    # rows that overlap (an expanded out, a row stride below I) would be stored into the same
    # memory: every row but the last one written would be lost, with no error
    if out is not None and (out.shape != (x.shape[0], w_gate.shape[2]) or out.dtype != x.dtype
                            or out.device != x.device or out.stride(1) != 1
                            or (out.shape[0] > 1 and out.stride(0) < out.shape[1])):
        raise ValueError(f"{OP}: out must be a {x.dtype} [{x.shape[0]}, {w_gate.shape[2]}] "
                         f"tensor on {x.device} with contiguous rows that do not overlap; got "
                         f"{out.dtype} {list(out.shape)} strides {tuple(out.stride())}")
    if out is not None:  # tiles of h are stored while other tiles still read x's rows
        check_no_overlap(OP, out, dict(x=x, w_gate=w_gate, w_up=w_up))
