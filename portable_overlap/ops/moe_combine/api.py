"""The fused transports of MoE expert GEMM + combine All-to-All (expert parallelism),
payload-efficient: the workspace and launches of ``"stores"`` and ``"shmem"``.

What the op computes on rank r (``pattern.py`` has the context and the op; the dispatch layout
is ``moe_dispatch``'s, ops/moe_dispatch)::

    # x [R, I]: rows for r's experts, by source rank q, then local expert e (counts[q, e] rows)
    # w [E_local, I, H]: r's experts (global expert r * E_local + e); slots [R]: row -> slot
    y = cat([x[seg(q, e)] @ w[e] for q in ranks for e in local experts])      # [R, H]
    rows_q = all_to_all(y, splits=counts.sum(1))       # rows back to the ranks their tokens left
    placed[slots_q] = rows_q                           # [S * k, H] on each source rank
    out[s] = sum_j topk_weights[s, j] * placed[s * k + j]                       # [S, H]

with one persistent grouped-GEMM kernel that sends each finished tile's rows to the source
rank's combine buffer at their slots, tiles for other ranks first, and a combine kernel that
waits for the rows and takes the weighted sum (kernel.py). Only real rows travel; ranks may
receive different row counts and hold different token counts S. The two fused transports:

- ``"stores"`` (scale-up): plain stores into the peer's heap (zero-copy);
- ``"shmem"`` (the scale-out design): device-initiated puts by the vendor's SHMEM library
  (NVSHMEM / ROC_SHMEM, shmem/providers), rows staged per program, then put row by row into the
  peer's symmetric combine buffer; completion (quiet) before the same release signals.

Routing data lives on the device and is never read by the host on a call; the kernels check it
completely and raise ``InvalidInputError`` at the context's next check (``ctx.synchronize()``):
a slot outside the combine buffer is skipped and reported by the sender; on the source rank,
a row count that does not add up to S * k, or a slot of [0, S * k) that got no row in this
call (the trace of a duplicate slot, or of one in [S * k, max_slots), on any sender: every
stored row stamps its slot with the call's epoch) is reported, and the tokens of such a slot
get NaN. The ranks stay in step: the next call may go on. ``validate_routing`` makes the same
checks on the host (a device sync), for debugging.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch
import torch.distributed as dist
import triton

from ...tiles.gemv import dot_precision, dot_upcast
from ..context import (align_key, check_sizes, collective_call, G_MAX, output_tensor,
                       OverlapContext, refuse_grad, shape_tag)
from ..launch import PlannedLaunch
from ...shmem.providers import agreed_put_provider
from ..matmul.api import DTYPES, MatmulConfig, default_config, tile_config, tile_descriptors
from .kernel import (FLAG_NAMES, moe_combine_kernel, moe_gemm_put_kernel,
                     moe_gemm_scatter_kernel, segment_starts_kernel)

#: the transports this module runs (``pattern.py`` adds ``"sequential"`` and ``"auto"``)
FUSED_TRANSPORTS = ("stores", "shmem")
#: the GEMM's tile walks: by the call's size (``decode_walk``), expert by expert, source by source
WALKS = ("auto", "experts", "sources")

OP = "moe_gemm_combine"


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """Tiling of the weighted-sum kernel: tokens per program (``block_s``; None: by the call's
    token count, ``combine_block``) and hidden columns per program step."""
    block_s: Optional[int] = None
    block_h: int = 256
    num_warps: int = 4

    def __post_init__(self):
        def pow2(v, least):  # (a bool is an int to Python: True passed as 1)
            return (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= least
                    and not v & (v - 1))

        if not ((self.block_s is None or pow2(self.block_s, 1)) and pow2(self.block_h, 16)
                and pow2(self.num_warps, 1) and self.num_warps <= 16):
            raise ValueError(f"{OP}: block_s (None or a power of two), block_h (a power of two "
                             f">= 16) and num_warps (1-16, a power of two) of {self}")


def combine_block(tokens: int, sm_count: int) -> int:
    """Tokens per program of the weighted sum: the most of 4, 2, 1 that still gives every
    processor two programs. Each token reads k rows of H, so a program of few tokens has little
    in flight, and a grid of fewer programs than processors leaves the rest idle: on one H100
    at 128 tokens (k 8, H 7168) 8 tokens per program (16 programs) took 91.7 us, 1 token (128)
    23.1; at 8192 tokens 8 per program took 400.7 us, 4 367.9 (the rows at the HBM rate:
    315.5; ``tune_moe_experts.py --combine``)."""
    for block in (4, 2):
        if -(-tokens // block) >= 2 * sm_count:
            return block
    return 1


#: mean rows of a (source, expert) segment at or below which a call is a decode size
DECODE_ROWS = 64


def decode_walk(tokens: int, top_k: int, world: int, experts_per_rank: int) -> bool:
    """Whether the GEMM of a call with ``tokens`` tokens on this rank walks its tiles expert by
    expert with ``decode_config``'s tiles: where the (source, expert) segments hold
    ``DECODE_ROWS`` rows or fewer on average, ``tokens * top_k / (world * experts_per_rank)``
    (this rank's token count standing in for its peers', which the host does not know).
    There a row tile or two per source read all of an expert's weights, which bound the time:
    walked source by source, every source's tiles read them from memory again (twice on 2
    ranks, 8 times on 8); walked expert by expert, the sources' tiles of one weight column block
    run one after another and share it through the L2 cache. At prefill sizes the source-major
    walk stays: it sends the peers' rows first and the weights are re-read per row-tile group
    anyway."""
    return tokens * top_k <= DECODE_ROWS * world * experts_per_rank


def decode_config(dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The GEMM's tiles at decode sizes on ``device`` (its ``DeviceFacts``): ``decode_tile``;
    ``default_config`` under the interpreter."""
    if device.type == "cpu":
        return default_config(dtype, device)
    from ...backends import device_facts

    return decode_tile(dtype, device_facts(device))


def decode_tile(dtype: torch.dtype, facts) -> MatmulConfig:
    """64 x 256 x 64 over 8 warps with 4 stages (152 registers, no spill on sm_90). Segments of
    a source's rows of an expert hold 32-64 rows at 128 tokens per rank, where 128-row tiles
    compute at least half zeros and the weights' bytes set the time: more loads in flight (4
    stages, not 3) matter more than the tile's rows. On one H100, one source's rows of rank 0's
    experts (``tune_moe_experts.py --down``, layouts of 2 and 8 ranks, DeepSeek-like and
    Mixtral-like): 0.095 / 0.166 / 0.030 / 0.085 ms against 0.093 / 0.184 / 0.038 / 0.116 for
    the default tiles. The default tiles (``matmul.api.tile_config``) for float32 and on
    64-lane wavefronts (never timed on AMD hardware)."""
    base = tile_config(dtype, facts)
    if dtype == torch.float32 or facts.warp_size == 64 or base.block_m <= 64:
        return base
    # 40 KiB of operand tiles per stage (16-bit): 4 stages where the shared memory holds them
    # with room to spare (227 KiB on H100 / H200), 3 where not (164 KiB on A100)
    stages = 4 if 4 * 40 * 1024 + 32 * 1024 <= facts.shared_per_program else 3
    return MatmulConfig(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=stages)


class MoeGemmCombineKernel(OverlapContext):
    """Workspace of a fused transport (``"stores"``, ``"shmem"``) on one rank: a combine buffer
    of ``max_tokens * top_k`` rows of ``hidden`` (the most tokens any rank holds in a call), one
    epoch stamp per row, flags and row counters in the symmetric heap. Collective to create and
    close; calls in the same order on every rank, on any streams (each call runs after the last).

    ``config``: the GEMM's tiles (default: ``default_config``, or ``decode_config`` for calls
    of decode size). ``walk``: the order of the GEMM's tiles, ``"sources"`` (the peers' rows
    first), ``"experts"`` (each expert's tiles of all sources together) or ``"auto"`` (experts
    at decode sizes, ``decode_walk``). The tiles and walk that a call's size picks may differ
    between the ranks of one call."""

    OP = OP
    TRANSPORTS = FUSED_TRANSPORTS
    FLAG_NAMES = FLAG_NAMES

    def __init__(self, world, *, max_tokens: int, top_k: int, hidden: int,
                 experts_per_rank: int, timeout_s: float = 10.0,
                 config: Optional[MatmulConfig] = None,
                 combine_config: Optional[CombineConfig] = None, transport: str = "stores",
                 walk: str = "auto"):
        check_sizes(OP, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                    experts_per_rank=experts_per_rank)
        if transport not in FUSED_TRANSPORTS:
            raise ValueError(f"{OP}: transport must be one of {FUSED_TRANSPORTS}, got "
                             f"{transport!r}")
        if walk not in WALKS:
            raise ValueError(f"{OP}: walk must be one of {WALKS}, got {walk!r}")
        W = world.world_size
        if W > 64:  # the GEMM kernel keeps one bit per peer in an int64
            raise ValueError(f"{OP}: at most 64 ranks, got {W}")
        world.check_same(f"{OP} context arguments", (max_tokens, top_k, hidden, experts_per_rank,
                                                     config, combine_config, transport, walk))
        self.transport, self.walk = transport, walk
        # one rank has no peer to put to: the store kernel serves it; with peers, every rank
        # learns whether all can have the library before any allocates from it
        self._provider = (agreed_put_provider(world, OP, transport)
                          if world.world_size > 1 else None)
        self.max_slots = max_tokens * top_k
        super().__init__(world, [
            ("_combine_raw", (self.max_slots * hidden,), torch.float32),  # viewed per dtype
            # the call whose row last landed in each slot (kernel.py: the combine's check that
            # the rows are exactly one per slot)
            ("slot_epoch", (self.max_slots,), torch.int64),
            ("sent", (W, G_MAX), torch.int64), ("rows_in", (W, G_MAX), torch.int64),
            ("rows_mine", (W, G_MAX), torch.int64), ("consumed", (W,), torch.int64),
            ("ctl", (4,), torch.int64),
        ], timeout_s)
        self.call_protocol(self.ctl, call_flags=(self.sent,), free_flags=(self.consumed,))
        # after a call this rank refused or failed, the peers' late rows of it land first (the
        # weighted sum's last program frees the buffer, after the launch that stored them)
        self.late_stores_guard(self.consumed, "combine-consumed", epoch=self.ctl)
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        self.experts_per_rank = experts_per_rank
        self.config, self.combine_config = config, combine_config
        self._combine_configs = {}  # block_s -> the filled-in CombineConfig
        n = self.max_slots * hidden  # the raw buffer fits n float32s: n elements of any dtype
        self._combine = {dt: self._combine_raw.view(torch.uint8).view(dt)[:n]
                         .view(self.max_slots, hidden) for dt in DTYPES}
        self._stage = self._combine  # the zero-copy transport stages nothing
        self._sym = self._put_kernel = None
        # the segments' counts as the GEMM reads them, and their first rows in x
        # (``segment_starts_kernel``)
        self._safe_counts = torch.empty(W * experts_per_rank, dtype=torch.int32,
                                        device=world.device)
        self._starts = torch.empty(W * experts_per_rank, dtype=torch.int32, device=world.device)
        if self._provider is not None:
            # the library's symmetric memory: combine rows, then one staging tile per program
            G = min(world.facts.sm_count, G_MAX)
            tile = max(c.block_m * c.block_n for dt in DTYPES for c in
                       (config or default_config(dt, world.device),
                        config or decode_config(dt, world.device)))
            sym = self._provider.symmetric_empty(4 * n + 256 + 4 * G * tile)
            self._sym = sym
            self._combine = {dt: sym[:4 * n].view(dt)[:n].view(self.max_slots, hidden)
                             for dt in DTYPES}
            self._stage = {dt: sym[4 * n + 256:].view(dt) for dt in DTYPES}
            self._put_kernel = self._provider.wrap(moe_gemm_put_kernel)

    def close(self) -> None:
        """Collective: also lets the library's symmetric memory go (torch frees it once no view
        of it is left)."""
        super().close()
        self._combine = self._stage = self._sym = self._put_kernel = None

    @collective_call
    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                 slots: torch.Tensor, topk_weights: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        refuse_grad(OP, x, w, topk_weights)  # the result would carry no gradient
        check_inputs(self, x, w, counts, slots, topk_weights)
        out = output_tensor(OP, out, (topk_weights.shape[0], self.hidden), x,
                            dict(x=x, w=w, topk_weights=topk_weights))
        gemm, combine, _ = self._launches(x, w, counts, slots, topk_weights, out)
        gemm()
        combine()
        return out

    def phases(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
               slots: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> dict:
        """Collective (one call of the op, which plans it): the call's two kernels on these
        tensors as separate launches, to time or inspect them apart. Returns::

            gemm()       # the grouped GEMM: each row stored (and stamped) at its slot
            combine()    # the weighted sum of each token's slots into out
            gemm_kernel  # the compiled GEMM (registers, spills, PTX); None under the interpreter

        Each launch is one half of a call: with peers, ``gemm()`` waits for their previous
        ``combine()`` and ``combine()`` for their ``gemm()``, so time them on a world of one."""
        self(x, w, counts, slots, topk_weights, out=out)
        gemm, combine, planned = self._launches(x, w, counts, slots, topk_weights, out)
        return {"gemm": gemm, "combine": combine, "gemm_kernel": planned.compiled}

    def _launches(self, x, w, counts, slots, topk_weights, out) -> tuple:
        """(gemm, combine, the GEMM's PlannedLaunch): the call's two launches, planned on first
        use, as callables."""
        S = topk_weights.shape[0]
        # the counts checked against x's rows and the segments' row starts, in the context's
        # buffers: one launch, no host sync, no allocation (the previous call's kernels read
        # them earlier in stream order)
        n_seg = counts.numel()
        block = triton.next_power_of_2(n_seg)
        # (the counts' alignment too: the planned launch skips the JIT, which specializes on it)
        starts_key = ("starts", block, align_key(counts))
        starts_launch = self._plans.get(starts_key)
        if starts_launch is None:
            starts_launch = self._plans[starts_key] = self._compile(
                segment_starts_kernel, 1, dict(BLOCK=block, num_warps=4),
                lambda g: self._starts_args(counts, x))
        # (untracked: it sends nothing, so a call refused after it is still a refusal)
        starts_launch.run_untracked(self._starts_args(counts, x))
        counts, starts = self._safe_counts.view(counts.shape), self._starts
        # R and S are data-dependent and never specialized on (kernel.py), so plans depend only
        # on what is fixed for a model (dtype, I, strides, pointer alignment) and on whether
        # S is a decode size (``decode_walk``: two plans at most)
        decode = decode_walk(S, self.top_k, self.world.world_size, self.experts_per_rank)
        expert_major = {"auto": decode, "experts": True, "sources": False}[self.walk]
        cfg = self._gemm_config(x, decode)
        # the descriptors hold the tensors' addresses: built per call (a few microseconds);
        # whether there are any is part of the plan (an empty x has none)
        descs = self._descriptors(x, w, cfg)
        key = (x.dtype, x.shape[1], x.stride(), w.stride(), topk_weights.stride(),
               topk_weights.dtype, align_key(x, w, counts, slots, topk_weights, out),
               descs[0] is not None, decode, expert_major)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(x, w, counts, starts, slots, topk_weights, out,
                                                 descs, cfg, expert_major)
        gemm = plan
        cc = self._combine_config(x.device, S)
        comb = self._plans.get(("combine", key, cc))
        if comb is None:
            comb = self._plans[("combine", key, cc)] = self._plan_combine(topk_weights, out,
                                                                          x.dtype, gemm, cc)
        args = self._gemm_args(x, w, counts, starts, slots, gemm.tag, gemm.programs, descs)
        comb_args = self._comb_args(topk_weights, out, x.dtype, gemm.tag, gemm.programs)
        blocks = max(1, -(-S // comb.block_s))  # one combine program per block of tokens

        def launch_gemm():
            if self._provider is None:
                gemm(args)
            else:  # through the library's launcher (it sets up each compiled module)
                self._put_kernel[(gemm.programs,)](*args, **gemm.consts)

        def launch_combine():
            comb.programs = blocks
            comb(comb_args)

        return launch_gemm, launch_combine, gemm

    # -- launches ------------------------------------------------------------------------------
    def _gemm_config(self, x, decode: bool) -> MatmulConfig:
        """The GEMM's tiling: the context's ``config``, else ``default_config``, or at decode
        sizes ``decode_config``."""
        if self.config is not None:
            return self.config
        if decode:
            return decode_config(x.dtype, x.device)
        return default_config(x.dtype, x.device)

    def _descriptors(self, x, w, cfg: MatmulConfig) -> tuple:
        """(x_desc, w_desc) over x and the weights stacked as [E * I, H], or Nones where the
        pointer loads must do (``tile_descriptors``' rules, or I not a multiple of the K block,
        where a block would read into the next expert's rows)."""
        E, I, H = w.shape
        if I % cfg.block_k or not w.is_contiguous():
            return None, None
        x_desc, w_desc = tile_descriptors(x, w.view(E * I, H), cfg, self.world.facts)
        return (None, None) if x_desc is None else (x_desc, w_desc)

    def _gemm_args(self, x, w, counts, starts, slots, tag, programs, descs):
        W = self.world.world_size
        return (x, w, counts, starts, slots, self._combine[x.dtype], self._stage[x.dtype],
                self.slot_epoch, self.sent, self.rows_in,
                self.rows_mine, self.consumed, self.ctl, self.call_clock, self.heap.bases,
                self.status.address, x.shape[0], self.hidden, x.shape[1], self.experts_per_rank,
                self.max_slots, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                programs, self.rank, W, tag, self.timeout_us, *descs)

    def _starts_args(self, counts, x):
        return (counts, self._safe_counts, self._starts, self.status.address, counts.numel(),
                x.shape[0])

    def _comb_args(self, topk_weights, out, dtype, tag, gemm_programs):
        S, k = topk_weights.shape
        return (self._combine[dtype], topk_weights, out, self.slot_epoch, self.sent,
                self.rows_in, self.consumed, self.ctl, self.call_clock, self.heap.bases,
                self.status.address, S, self.hidden, k, topk_weights.stride(0),
                topk_weights.stride(1), gemm_programs, self.rank, self.world.world_size, tag,
                self.timeout_us)

    def _plan(self, x, w, counts, starts, slots, topk_weights, out, descs, cfg, expert_major):
        inner = x.shape[1]  # (I of the shapes above)
        W = self.world.world_size
        gemm_consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                           GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
                           EVEN_K=inner % cfg.block_k == 0, USE_DESC=descs[0] is not None,
                           PRECISION=dot_precision(x.dtype),
                           UPCAST=dot_upcast(x.dtype), G_MAX=G_MAX, EXPERT_MAJOR=expert_major,
                           BLOCK_SRC=1 << max(0, W - 1).bit_length(),
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        # The grid does not depend on the data-dependent row count: ranks receive different
        # numbers of rows, and a peer's combine waits for every program of this launch.
        programs = min(self.world.facts.sm_count, G_MAX)

        # what must agree across ranks: not R or S, which may differ, nor the tiles and walk
        # that follow from S (``decode_walk``): they are this rank's own business, while the
        # grid is every peer's (its combine counts this launch's programs)
        def tag_of(g):
            return shape_tag(OP, hidden=self.hidden, intermediate=inner,
                             experts_per_rank=self.experts_per_rank, top_k=self.top_k,
                             dtype=str(x.dtype), config=self.config, programs=g)

        if self._provider is None:
            gemm = self._compile(moe_gemm_scatter_kernel, programs, gemm_consts,
                                 lambda g: self._gemm_args(x, w, counts, starts, slots, tag_of(g),
                                                           g, descs))
        else:  # compiled by the library's launcher on first use; no intra-launch waits, no cap
            gemm = PlannedLaunch(moe_gemm_put_kernel, None, programs, gemm_consts, None)
        gemm.tag = tag_of(gemm.programs)
        return gemm

    def _combine_config(self, device, S: int) -> CombineConfig:
        """The weighted sum's tiling for a call of S tokens: the context's ``combine_config``
        with ``block_s`` filled in by ``combine_block`` where it is None."""
        if device.type == "cpu":  # the interpreter: small blocks keep emulated runs short
            base = self.combine_config or CombineConfig(block_s=4, block_h=16, num_warps=1)
        else:
            base = self.combine_config or CombineConfig()
        if base.block_s is not None:
            return base
        block = combine_block(S, self.world.facts.sm_count)
        cc = self._combine_configs.get(block)  # made once per block: this runs every call
        if cc is None:
            cc = self._combine_configs[block] = dataclasses.replace(base, block_s=block)
        return cc

    def _plan_combine(self, topk_weights, out, dtype, gemm, cc: CombineConfig):
        S = topk_weights.shape[0]
        comb_consts = dict(BLOCK_S=cc.block_s, BLOCK_H=cc.block_h, G_MAX=G_MAX,
                           num_warps=cc.num_warps, num_stages=1)
        # every program waits for the peers' rows, none for another program of this launch,
        # so the grid needs no cap: one program per block of tokens (one when S is 0)
        comb = self._compile(moe_combine_kernel, max(1, -(-S // cc.block_s)), comb_consts,
                             lambda g: self._comb_args(topk_weights, out, dtype, gemm.tag,
                                                       gemm.programs))
        comb.block_s = cc.block_s
        return comb


def check_inputs(ctx, x, w, counts, slots, topk_weights) -> None:
    """The host checks of a call (every transport's): devices, dtypes, shapes and the token
    count against ``ctx``'s sizes (``hidden``, ``top_k``, ``experts_per_rank``,
    ``max_tokens``); the routing data's values are checked on the device."""
    W, E, H = ctx.world.world_size, ctx.experts_per_rank, ctx.hidden
    dev = ctx.world.device
    for name, t in (("x", x), ("w", w), ("counts", counts), ("slots", slots),
                    ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a tensor")
        if t.device != dev:
            raise ValueError(f"{OP}: {name} must be on {dev}, got {t.device}")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise TypeError(f"{OP}: x and w must share one dtype of {DTYPES}; got {x.dtype}, "
                        f"{w.dtype}")
    if x.dim() != 2 or w.dim() != 3 or w.shape[0] != E or w.shape[1] != x.shape[1] \
            or w.shape[2] != H:
        raise ValueError(f"{OP}: need x [R, I] and w [{E}, I, {H}]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if x.shape[1] < 1:
        raise ValueError(f"{OP}: I must be >= 1")
    if counts.dtype != torch.int32 or tuple(counts.shape) != (W, E) \
            or not counts.is_contiguous():
        raise ValueError(f"{OP}: counts must be a contiguous int32 [{W}, {E}] tensor (rows "
                         f"from each source rank for each local expert); got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    if slots.dtype != torch.int32 or tuple(slots.shape) != (x.shape[0],) \
            or not slots.is_contiguous():
        raise ValueError(f"{OP}: slots must be a contiguous int32 [{x.shape[0]}] tensor "
                         f"(one per row of x); got {slots.dtype} {tuple(slots.shape)}")
    if topk_weights.dim() != 2 or topk_weights.shape[1] != ctx.top_k \
            or not topk_weights.is_floating_point():
        raise ValueError(f"{OP}: topk_weights must be a float [S, {ctx.top_k}] tensor; got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if topk_weights.shape[0] > ctx.max_tokens:
        raise ValueError(f"{OP}: S={topk_weights.shape[0]} tokens exceed this context's "
                         f"max_tokens={ctx.max_tokens}")


def validate_routing(x, counts, slots, S: int, top_k: int, world) -> None:
    """Collective host-side check of the routing data (syncs the device; for debugging), raised
    as a ValueError on every rank when any rank's data is wrong: each rank's counts add up to
    its rows of x, each row's slot is inside its source rank's ``S * top_k`` slots, and the
    slots of the rows that go back to a source rank are exactly one per slot (no duplicate,
    none missing). The kernels find the same faults without a sync (out-of-range slots on the
    sender, a missing slot or a wrong row count on the source), at the context's next check."""
    W = world.world_size
    problem = None
    total = int(counts.sum())
    if total != x.shape[0] or slots.numel() != x.shape[0]:
        problem = f"counts add up to {total} rows, x has {x.shape[0]}, slots {slots.numel()}"
    sizes = world.all_gather_object(S * top_k)
    send = counts.sum(1).long() if problem is None else torch.zeros(W, dtype=torch.long)
    bounds = [0] + torch.cumsum(send, 0).tolist()
    for q, n_slots in enumerate(sizes):
        s = slots[bounds[q]:bounds[q + 1]]
        if problem is None and s.numel() and (int(s.min()) < 0 or int(s.max()) >= n_slots):
            problem = (f"rows from rank {q} must have slots in [0, {n_slots}); got "
                       f"[{int(s.min())}, {int(s.max())}]")
    # the slots back to their source ranks (as the combine sends the rows)
    mine = slots[:bounds[-1]].long()
    if W > 1:
        send = send.to(slots.device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=world.group)
        got = mine.new_empty(int(recv.sum()))
        dist.all_to_all_single(got, mine, recv.tolist(), send.tolist(), group=world.group)
    else:
        got = mine
    n = S * top_k
    if problem is None:
        inside = got[(got >= 0) & (got < n)]
        hits = torch.bincount(inside, minlength=n)
        if got.numel() != n:
            problem = f"{got.numel()} rows come back to this rank, it has S*top_k = {n} slots"
        elif bool((hits != 1).any()):
            p = int((hits != 1).nonzero()[0, 0])
            problem = (f"its slot {p} gets {int(hits[p])} rows (each of its S*top_k slots "
                       f"must get one: a duplicate or out-of-range slot on a sender)")
    found = [(q, m) for q, m in enumerate(world.all_gather_object(problem)) if m]
    if found:
        raise ValueError(f"{OP}: invalid routing data: "
                         + "; ".join(f"rank {q}: {m}" for q, m in found))
