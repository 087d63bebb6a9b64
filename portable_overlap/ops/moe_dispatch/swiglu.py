"""The MoE dispatch with the experts' gated first GEMM fused into its scatter.

What it computes on rank r (``E`` local experts per rank; ``w_gate``, ``w_up`` [E, H, I] are
rank r's experts)::

    x, counts, slots = moe_dispatch(tokens, topk_ids, ctx)           # the rows routed to r
    h = expert_swiglu(x, w_gate, w_up, counts)     # silu(x[i] @ w_gate[e]) * (x[i] @ w_up[e])
    return h, counts, slots

``h`` [capacity, I]: its first ``counts.sum()`` rows are this call's (by source rank, then
local expert, slot order inside a segment, as ``x``), the rest are left as they were; ``counts``
and ``slots`` and the received rows (``ctx.recv``) are the dispatch's own buffers, valid until
the context's next call. On the context's ``"stores"`` workspace (its transport, or one of
``"auto"``'s candidates) the count and exchange launches of the dispatch run first, then one
persistent launch (swiglu_kernel.py) in which some programs store the rows into their
destinations' heaps while the others compute the tiles of the rows that have arrived, this
rank's own rows first. Same faults as the dispatch (bad ids, a capacity overflow, a rank that
skips a call), same CUDA-graph capture (no host sync). A context with the ``"sequential"``
transport runs ``moe_dispatch`` then ``expert_swiglu``. One with the ``"shmem"`` transport
raises ``ValueError``: the fused kernel stores the rows itself, so it needs ``"stores"`` (its
compute programs wait for senders of the same launch, so the grid must be capped at what is
resident, which the SHMEM library's launcher does not do).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from ...tiles.gemv import dot_precision, dot_upcast
from ..context import align_key, check_no_overlap, G_MAX, refuse_grad, shape_tag
from ..matmul.api import MatmulConfig
from ..registry import PartSpec, define_part
from ..moe_experts.api import _descriptors, _validate as _validate_experts, default_config
from .swiglu_kernel import dispatch_swiglu_kernel

OP = "moe_dispatch_swiglu"
#: the most ranks: a compute program keeps one bit per source ("its rows are here") in an int64
MAX_WORLD = 64


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_senders(world_size: int, programs: int, interpreter: bool = False) -> int:
    """Programs that send when the caller does not say. Senders take GEMM tiles too once they
    have sent, so more senders cost only the time they spend sending. A world of one rank has
    nothing to hide its local copy behind: every program copies its share, then computes (on
    one H100 at 8192 tokens and H 7168, one sender took 30 ms to copy the 940 MB that the
    dispatch launch copies in 0.5 ms; with 66 or 99 senders the launch was within the
    run-to-run spread of every program, and 33 senders were 1-8 % slower, docs/moe.md).
    Otherwise a quarter of the grid: on 2 H200 (132 programs: 33) the 470 MB a rank receives
    at the DeepSeek-like prefill layout take about 1.7 ms at the 273 GB/s that 32 programs
    stored into a peer (../shared/DESIGN.md), within the 2.9 ms of GEMM tiles on the rank's own
    rows. Measured there against 8, 16, 24 and 48 senders (graph replay, 8192 tokens): 33 was
    the fastest at the DeepSeek-like layout (6.81 ms, the others 7.06-8.20, balanced; 11.72
    against 11.80-13.08 with Zipf routing), and the counts were within the run-to-run spread at
    the Mixtral-like one (docs/moe.md). Under the interpreter a world of one has one sender
    (there, several senders take no tiles: swiglu_kernel.py)."""
    if world_size == 1:
        return 1 if interpreter else programs
    return max(1, min(programs - 1, programs // 4))


def check_grid(op: str, programs: int, senders: int, senders_compute: bool) -> None:
    """The fused launch's grid (``programs`` resident) must hold the senders, and a program
    that computes where senders do not (several senders under the interpreter)."""
    least = senders if senders_compute else senders + 1
    if programs < least:
        raise ValueError(f"{op}: senders={senders} needs {least} programs of the fused kernel on "
                         f"the device at once, and {programs} fit: pass fewer senders")


def check_options(senders, config, rows_per_segment, op: str = OP) -> None:
    """The fused launch's options, named in errors as ``op``'s (the caller's)."""
    if senders is not None and (not isinstance(senders, int) or isinstance(senders, bool)
                                or not 1 <= senders <= G_MAX):
        raise ValueError(f"{op}: senders must be an int in [1, {G_MAX}], got {senders!r}")
    if config is not None and not isinstance(config, MatmulConfig):
        raise TypeError(f"{op}: config must be a MatmulConfig, got {type(config).__name__}")
    if rows_per_segment is not None and not (isinstance(rows_per_segment, (int, float))
                                             and 0 <= rows_per_segment < float("inf")):
        raise ValueError(f"{op}: rows_per_segment must be a finite number >= 0, got "
                         f"{rows_per_segment!r}")


def check_weights(ctx, w_gate, w_up, out, op: str = OP) -> None:
    """The experts' weights and ``out`` against the context (before anything is launched),
    named in errors as ``op``'s."""
    for name, t in (("w_gate", w_gate), ("w_up", w_up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor")
        if t.device != ctx.world.device:
            raise ValueError(f"{op}: {name} must be on {ctx.world.device}, got {t.device}")
    if w_gate.dtype != ctx.dtype:
        raise TypeError(f"{op}: w_gate and w_up must be {ctx.dtype} (the context's dtype), got "
                        f"{w_gate.dtype}")
    if w_gate.dim() != 3 or w_gate.shape[:2] != (ctx.experts_per_rank, ctx.hidden):
        raise ValueError(f"{op}: w_gate and w_up must be [{ctx.experts_per_rank}, {ctx.hidden}, "
                         f"I]; got {tuple(w_gate.shape)}")
    if w_gate.stride(2) != 1:
        raise ValueError(f"{op}: w_gate and w_up must have contiguous rows; got strides "
                         f"{w_gate.stride()}")
    # (named as this op's: the shared check below names expert_swiglu, which the caller did
    # not call; the kernel steps through both with w_gate's strides)
    if w_up.dtype != w_gate.dtype:
        raise TypeError(f"{op}: w_up must be w_gate's dtype {w_gate.dtype}; got {w_up.dtype}")
    if w_up.shape != w_gate.shape or w_up.stride() != w_gate.stride():
        raise ValueError(f"{op}: w_up must have w_gate's shape {tuple(w_gate.shape)} and strides "
                         f"{w_gate.stride()}; got {tuple(w_up.shape)}, {w_up.stride()}")
    _validate_experts(ctx.recv, w_gate, w_up, ctx.counts, out)


def check_arguments(ctx, tokens, topk_ids, w_gate, w_up, out, senders, config,
                    rows_per_segment) -> torch.Tensor:
    """A call's arguments against the context ``ctx`` (a workspace of any transport), before
    anything runs: returns ``out``, made ([capacity, I]) where not given."""
    from .api import check_call

    refuse_grad(OP, tokens, w_gate, w_up)  # h carries no gradient
    check_call(ctx, tokens, topk_ids)
    check_options(senders, config, rows_per_segment)
    if out is None:
        out = torch.empty((ctx.capacity, w_gate.shape[-1]), dtype=ctx.dtype,
                          device=ctx.world.device)
    check_weights(ctx, w_gate, w_up, out)
    # rows of h are stored while the senders still read the tokens and their ids
    check_no_overlap(OP, out, dict(tokens=tokens, topk_ids=topk_ids))
    return out


def run(ctx, tokens, topk_ids, w_gate, w_up, out, senders, config, rows_per_segment):
    """The ``"stores"`` call (``MoeDispatchKernel.dispatch_swiglu`` checked the arguments): the
    dispatch's count and exchange launches, then the fused launch."""
    W, E = ctx.world.world_size, ctx.experts_per_rank
    # the call's tokens balanced over every expert (the layer's own estimate)
    m = tokens.shape[0] * ctx.top_k / (W * E) if rows_per_segment is None else rows_per_segment
    # per-source row tiles always: a tile that gathered several sources' rows would wait for
    # all of them. Plans are keyed by the tiles the mean picks, not by the mean (which moves
    # with S from call to call)
    cfg = config or default_config(tokens.dtype, tokens.device, True, m)
    key = ("swiglu", tokens.dtype, tokens.stride(0), topk_ids.dtype, tuple(w_gate.shape),
           w_gate.stride(), out.stride(0), senders, config, cfg,
           align_key(tokens, topk_ids, w_gate, w_up, out))
    plan = ctx._plans.get(key)
    if plan is None:
        plan = ctx._plans[key] = _plan(ctx, tokens, topk_ids, w_gate, w_up, out, senders,
                                       config, m)
    count, exchange, fused = plan.launches
    tag = ctx.call_tag(plan.tag)
    routing = ctx._args(tokens, topk_ids, tag)
    count(routing[0])
    exchange(routing[1])
    fused(_args(ctx, tokens, topk_ids, w_gate, w_up, out, plan, tag=tag))
    return out, ctx.counts, ctx.recv_slots


def _args(ctx, tokens, topk_ids, w_gate, w_up, out, plan, programs=None, tag=None):
    W, E = ctx.world.world_size, ctx.experts_per_rank
    wg_desc = wu_desc = None
    if plan.x_desc is not None:  # per call: they hold the weights' addresses
        _, wg_desc, wu_desc = _descriptors(ctx.recv, w_gate, w_up, plan.cfg, ctx.world.facts)
    return (tokens, topk_ids, ctx._base, ctx._dest_start, ctx.recv, ctx.recv_slots, ctx.sent,
            ctx.ctl, ctx.call_clock, ctx.heap.bases, ctx.status.address, ctx.counts,
            ctx._queue, w_gate, w_up, out, plan.x_desc, wg_desc, wu_desc, topk_ids.numel(),
            ctx.top_k, ctx.hidden, tokens.stride(0), E, ctx.capacity, ctx.rank, W,
            plan.tag if tag is None else tag, ctx.timeout_us, plan.senders, w_gate.shape[2],
            w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), out.stride(0))


def dispatch_tag(op: str, ctx, dtype: torch.dtype, senders: int) -> int:
    """What the ranks' launches of a fused dispatch (``op``'s) must agree on: the dispatch's
    layout and the senders each rank waits for. Not S, the GEMM's tiles or the grid, which are
    this rank's own (ranks with other token counts may pick other tiles)."""
    return shape_tag(op, hidden=ctx.hidden, top_k=ctx.top_k, experts_per_rank=ctx.experts_per_rank,
                     dtype=str(dtype), capacity=ctx.capacity, block_t=ctx.block_t,
                     senders=senders)


def gated_consts(ctx, dtype: torch.dtype, cfg: MatmulConfig, x_desc, senders: int) -> dict:
    """The constexprs of the senders' passes and the gated GEMM's queues
    (``swiglu_kernel.dispatch_and_gate``) on ``ctx`` (a MoeDispatchKernel) at tiles ``cfg``,
    with the launch's warps and stages: this launch's, and the first part of the one-launch
    layer's."""
    W, E = ctx.world.world_size, ctx.experts_per_rank
    cpu = ctx.world.device.type == "cpu"
    elem = torch.empty((), dtype=dtype).element_size()
    return dict(BLOCK_T=ctx.block_t, BLOCK_E=ctx.block_e,
                BLOCK_H=16 if cpu else min(_pow2(ctx.hidden), 512 // elem), G_MAX=G_MAX,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages,
                EVEN_K=ctx.hidden % cfg.block_k == 0, PRECISION=dot_precision(dtype),
                UPCAST=dot_upcast(dtype), USE_DESC=x_desc is not None,
                BLOCK_SEG=_pow2(W * E), BLOCK_F=min(_pow2(senders), 128),
                # (swiglu_kernel.py: under the interpreter only one sender per rank may)
                SENDERS_COMPUTE=not cpu or senders == 1,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _plan(ctx, tokens, topk_ids, w_gate, w_up, out, senders, config, m):
    W, facts = ctx.world.world_size, ctx.world.facts
    cpu = ctx.world.device.type == "cpu"
    cfg = config or default_config(tokens.dtype, tokens.device, True, m)
    # the receive buffer has a fixed address: its descriptor is made once
    x_desc = _descriptors(ctx.recv, w_gate, w_up, cfg, facts)[0]
    if config is None and x_desc is None:
        cfg = default_config(tokens.dtype, tokens.device, False, m)
    programs = min(facts.sm_count, G_MAX)
    n_send = senders or default_senders(W, programs, cpu)
    p = SimpleNamespace(cfg=cfg, x_desc=x_desc, senders=n_send, tag=0)

    tag = dispatch_tag(OP, ctx, tokens.dtype, n_send)
    consts = gated_consts(ctx, tokens.dtype, cfg, x_desc, n_send)
    # compute programs wait for senders of this launch (the own rows): the grid must be
    # resident, which _compile ensures
    fused = ctx._compile(dispatch_swiglu_kernel, programs, consts,
                         lambda g: _args(ctx, tokens, topk_ids, w_gate, w_up, out, p, g, tag))
    check_grid(OP, fused.programs, n_send, consts["SENDERS_COMPUTE"])
    p.tag = tag
    count, exchange = ctx._plan_routing(tokens, topk_ids, fused.programs, p.tag)
    p.launches = (count, exchange, fused)
    return p


def moe_dispatch_swiglu(tokens, topk_ids, w_gate, w_up, ctx, out: Optional[torch.Tensor] = None,
                        *, senders: Optional[int] = None, config: Optional[MatmulConfig] = None,
                        rows_per_segment: Optional[float] = None) -> tuple:
    """``(h, counts, slots)`` of the module docstring: this rank's tokens routed to the ranks of
    their top-k experts and, on every rank, the gated first GEMM of its experts on the rows it
    receives, started on each source's rows as they arrive. ``ctx``: a :class:`MoeDispatch`
    (calls of this op and of ``moe_dispatch`` may alternate on it); ``out`` [capacity, I]
    receives ``h`` (default: a new tensor); ``senders``: programs that store rows (default
    ``default_senders``); ``config``, ``rows_per_segment``: the GEMM's tiling, as
    ``expert_swiglu``'s (row tiles are always per source; ``rows_per_segment`` defaults to
    this call's tokens balanced over every expert, ``S * top_k / (W * experts_per_rank)``).
    Under ``torch.compile`` one opaque op, ``torch.ops.portable_overlap.moe_dispatch_swiglu(
    tokens, topk_ids, w_gate, w_up, ctx.handle, senders, rows_per_segment)`` (``out`` and
    ``config`` make it a graph break). Inference only (no autograd)."""
    from .pattern import MoeDispatch

    if not isinstance(ctx, MoeDispatch):
        raise TypeError(f"{OP}: ctx must be a MoeDispatch (made with MoeDispatch(world, ...)), "
                        f"got {type(ctx).__name__}")
    # the part runs on the workspace itself: the one a refused call (an input that requires
    # grad) is told to the peers on, and whose handle the torch op takes
    return DISPATCH_SWIGLU((tokens, topk_ids, w_gate, w_up, ctx.swiglu_workspace(), senders,
                            rows_per_segment), out=out, config=config)


def _run_part(tokens, topk_ids, w_gate, w_up, ctx, senders=None, rows_per_segment=None,
              out=None, config=None) -> tuple:
    if not callable(getattr(ctx, "dispatch_swiglu", None)):  # (the torch op, another handle)
        raise TypeError(f"{OP}: the handle must be a MoeDispatch's, got a "
                        f"{type(ctx).__name__}'s")
    return ctx.dispatch_swiglu(tokens, topk_ids, w_gate, w_up, out, senders=senders,
                               config=config, rows_per_segment=rows_per_segment)


def _fake(tokens, topk_ids, w_gate, w_up, ctx, senders=None, rows_per_segment=None) -> tuple:
    return (tokens.new_empty((ctx.capacity, w_gate.shape[-1])),
            tokens.new_empty((ctx.world.world_size, ctx.experts_per_rank), dtype=torch.int32),
            tokens.new_empty((ctx.capacity,), dtype=torch.int32))


DISPATCH_SWIGLU = define_part(PartSpec(
    OP, "(Tensor tokens, Tensor topk_ids, Tensor w_gate, Tensor w_up, int handle, "
        "int? senders=None, float? rows_per_segment=None) -> (Tensor, Tensor, Tensor)",
    run=_run_part, fake=_fake, grad_args=("tokens", "w_gate", "w_up"), copies=(1, 2)))
