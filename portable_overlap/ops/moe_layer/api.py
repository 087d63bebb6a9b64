"""The expert-parallel MoE layer after routing, from the dispatch to the combine, with the
dispatch's scatter, both expert GEMMs and the combine's row stores in one persistent launch.

What it computes on rank r (``E`` local experts per rank; ``w_gate``, ``w_up`` [E, H, I] and
``w_down`` [E, I, H] are rank r's experts, global experts ``r * E .. r * E + E - 1``)::

    x, counts, slots = moe_dispatch(tokens, topk_ids, dispatch_ctx)     # rows routed to r
    h = expert_swiglu(x, w_gate, w_up, counts)     # silu(x[i] @ w_gate[e]) * (x[i] @ w_up[e])
    out = moe_gemm_combine(h, w_down, counts, slots, topk_weights, combine_ctx)
    # out [S, H]: out[s] = sum_j topk_weights[s, j] * expert_{topk_ids[s, j]}(tokens[s])

Four launches (kernel.py): the dispatch's count and exchange, then one persistent launch in
which some programs store the rows into their destinations' heaps while the others compute the
gated GEMM's tiles as the rows arrive (this rank's own first) and then the down GEMM's tiles
as their activations are finished, each row stored straight into its source's combine buffer;
then the combine's weighted sum. No host sync: capturable in a CUDA graph. Same faults as the
dispatch and the combine, raised on every rank for the same call (by the dispatch context for
routing faults and the rows that arrive, by the combine context for the rows that leave).

The two contexts are the staged path's own (``MoeDispatch`` and ``MoeGemmCombine``, each with
the ``"stores"`` transport or ``"auto"``: the launches run on their ``"stores"`` workspaces),
made with the same ``hidden``, ``top_k`` and ``experts_per_rank`` on the same world; calls of
this op and of the staged ops may alternate on them.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

import torch

from ...kept import kept_empty, kept_zeros
from ..context import G_MAX, align_key, output_tensor, refuse_grad, run_collective, shape_tag
from ..matmul.api import MatmulConfig
from ..moe_combine import MoeGemmCombine
from ..moe_combine.api import OP as COMBINE_OP, MoeGemmCombineKernel, check_inputs, decode_walk
from ..moe_dispatch import MoeDispatch
from ..moe_dispatch.api import MoeDispatchKernel
from ..moe_dispatch import swiglu
from ..moe_experts.api import _descriptors, default_config
from ..registry import PartSpec, define_part
from .kernel import moe_layer_kernel

OP = "moe_layer"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def down_config(gated: MatmulConfig, down: MatmulConfig) -> MatmulConfig:
    """The down GEMM's tiles inside the layer's launch: ``down``'s, with the gated GEMM's row
    tile height (a down tile waits for the gated tiles of exactly one row tile) and warps (one
    launch has one warp count)."""
    return dataclasses.replace(down, block_m=gated.block_m, num_warps=gated.num_warps)


def _check_contexts(dctx, cctx) -> None:
    if not isinstance(dctx, MoeDispatch):
        raise TypeError(f"{OP}: dispatch_ctx must be a MoeDispatch, got {type(dctx).__name__}")
    if not isinstance(cctx, MoeGemmCombine):
        raise TypeError(f"{OP}: combine_ctx must be a MoeGemmCombine, got "
                        f"{type(cctx).__name__}")
    if dctx.world is not cctx.world:
        raise ValueError(f"{OP}: the dispatch and combine contexts must be made on the same "
                         f"world")
    for name in ("hidden", "top_k", "experts_per_rank"):
        if getattr(dctx, name) != getattr(cctx, name):
            raise ValueError(f"{OP}: the contexts disagree on {name}: dispatch "
                             f"{getattr(dctx, name)}, combine {getattr(cctx, name)}")
    # (each context's "stores" workspace: named, or "auto"'s)
    if dctx.kernel() is None or cctx.kernel() is None:
        raise ValueError(f"{OP}: the one-launch layer stores rows itself and needs both contexts "
                         f"with transport='stores' or 'auto' (whose 'stores' workspace it runs "
                         f"on); got dispatch {dctx.transport!r}, combine {cctx.transport!r} "
                         f"(call the staged ops instead)")
    if dctx.world.world_size > swiglu.MAX_WORLD:
        raise ValueError(f"{OP}: at most {swiglu.MAX_WORLD} ranks, got "
                         f"{dctx.world.world_size}")


def moe_layer(tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              dispatch_ctx: MoeDispatch, combine_ctx: MoeGemmCombine,
              out: Optional[torch.Tensor] = None, *, senders: Optional[int] = None,
              rows_per_segment: Optional[float] = None) -> torch.Tensor:
    """``out`` [S, H] of the module docstring for this rank's ``tokens`` [S, H], ``topk_ids``
    [S, k] (global expert ids) and ``topk_weights`` [S, k]. ``senders``: programs that store
    rows (``swiglu.default_senders``); ``rows_per_segment``: the mean rows of a (source,
    expert) segment, which picks the tiles (default ``S * k / (W * E)``, this rank's S standing
    in for its peers'). Collective: every rank calls it in the same order as its other calls on
    the two contexts. Under ``torch.compile`` one opaque op,
    ``torch.ops.portable_overlap.moe_layer(tokens, topk_ids, topk_weights, w_gate, w_up, w_down,
    dispatch_ctx.handle, combine_ctx.handle, senders, rows_per_segment)`` (``out`` makes it a
    graph break). Inference only (no autograd)."""
    _check_contexts(dispatch_ctx, combine_ctx)
    # the layer's launches run on the contexts' "stores" workspaces (also under "auto"): the
    # part's own contexts, which a refused call tells its peers of
    return MOE_LAYER((tokens, topk_ids, topk_weights, w_gate, w_up, w_down,
                      dispatch_ctx.kernel(), combine_ctx.kernel(), senders, rows_per_segment),
                     out=out)


def _run_part(tokens, topk_ids, topk_weights, w_gate, w_up, w_down, dispatch_ctx, combine_ctx,
              senders=None, rows_per_segment=None, out=None) -> torch.Tensor:
    if not (isinstance(dispatch_ctx, MoeDispatchKernel)
            and isinstance(combine_ctx, MoeGemmCombineKernel)):
        # (the torch op called with the contexts' handles; swapped or other contexts' handles
        # are refused here, not met as a missing attribute inside the call)
        _check_contexts(dispatch_ctx, combine_ctx)
        dispatch_ctx, combine_ctx = dispatch_ctx.kernel(), combine_ctx.kernel()
    # one call of both contexts: a refusal (bad input on this rank) is told to the peers on
    # both, and the dispatch's errors (routing, the rows that arrive), which cause the
    # combine's, are raised first
    return run_collective((dispatch_ctx, combine_ctx), _run,
                          (dispatch_ctx, combine_ctx, tokens, topk_ids, topk_weights, w_gate,
                           w_up, w_down, out, senders, rows_per_segment))


def _fake(tokens, topk_ids, topk_weights, w_gate, w_up, w_down, dispatch_ctx, combine_ctx,
          senders=None, rows_per_segment=None) -> torch.Tensor:
    return tokens.new_empty((tokens.shape[0], combine_ctx.hidden))


MOE_LAYER = define_part(PartSpec(
    OP, "(Tensor tokens, Tensor topk_ids, Tensor topk_weights, Tensor w_gate, Tensor w_up, "
        "Tensor w_down, int dispatch_handle, int handle, int? senders=None, "
        "float? rows_per_segment=None) -> Tensor",
    run=_run_part, fake=_fake,
    grad_args=("tokens", "topk_weights", "w_gate", "w_up", "w_down")))


def _activations(dctx, w_gate) -> torch.Tensor:
    """The gated activations' buffer ([capacity, I]), one per I, made on first use (the first
    call of a shape is not capturable anyway: it compiles)."""
    I = w_gate.shape[2]
    h = dctx._layer_h.get(I)
    if h is None:
        h = dctx._layer_h[I] = kept_empty((dctx.capacity, I), dctx.dtype, dctx.world.device)
    return h


def _run(dctx, cctx, tokens, topk_ids, topk_weights, w_gate, w_up, w_down, out, senders,
         rows_per_segment):
    """The call (``run_collective`` holds both contexts' guards): every check, then the
    launches."""
    refuse_grad(OP, tokens, topk_weights, w_gate, w_up, w_down)
    dctx._validate(tokens, topk_ids)
    swiglu.check_options(senders, None, rows_per_segment, OP)
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or min(t.shape) < 1:
            raise ValueError(f"{OP}: {name} must be a non-empty 3-d tensor")
    h = _activations(dctx, w_gate)
    swiglu.check_weights(dctx, w_gate, w_up, h, OP)
    # w_down and topk_weights in this op's terms first: check_inputs names them as the
    # combine's (its x is the layer's activations, never passed by the caller)
    E, H, I = dctx.experts_per_rank, dctx.hidden, w_gate.shape[2]
    if w_down.dtype != tokens.dtype:
        raise TypeError(f"{OP}: w_down must be {tokens.dtype} (the tokens' and w_gate's dtype); "
                        f"got {w_down.dtype}")
    if tuple(w_down.shape) != (E, I, H):
        raise ValueError(f"{OP}: w_down must be [{E}, {I}, {H}] (experts per rank, w_gate's I, "
                         f"hidden); got {tuple(w_down.shape)}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() \
            or tuple(topk_weights.shape) != (tokens.shape[0], dctx.top_k):
        got = (f"{topk_weights.dtype} {tuple(topk_weights.shape)}"
               if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__)
        raise ValueError(f"{OP}: topk_weights must be a float [{tokens.shape[0]}, {dctx.top_k}] "
                         f"tensor (a weight per token and choice); got {got}")
    check_inputs(cctx, h, w_down, dctx.counts, dctx.recv_slots, topk_weights)
    if w_down.stride(2) != 1:
        raise ValueError(f"{OP}: w_down must have contiguous rows; got strides "
                         f"{w_down.stride()}")
    out = output_tensor(OP, out, (tokens.shape[0], cctx.hidden), tokens,
                        dict(tokens=tokens, topk_weights=topk_weights, w_gate=w_gate, w_up=w_up,
                             w_down=w_down))
    S = tokens.shape[0]
    W, E = dctx.world.world_size, dctx.experts_per_rank
    m = S * dctx.top_k / (W * E) if rows_per_segment is None else rows_per_segment
    decode = decode_walk(S, dctx.top_k, W, E)
    expert_major = {"auto": decode, "experts": True, "sources": False}[cctx.walk]
    plan = _plan(dctx, cctx, tokens, topk_ids, topk_weights, w_gate, w_up, w_down, h, out,
                 senders, m, decode, expert_major)
    count, exchange, fused = plan.launches
    tag = dctx.call_tag(plan.tag)
    routing = dctx._args(tokens, topk_ids, tag)
    args = _args(dctx, cctx, plan, tokens, topk_ids, w_gate, w_up, w_down, h, tag)
    comb = plan.combine
    comb_args = cctx._comb_args(topk_weights, out, tokens.dtype, plan.c_tag, fused.programs)
    dctx._launched = cctx._launched = True  # from here on the call is under way on both
    count(routing[0])
    exchange(routing[1])
    fused(args)
    comb.programs = max(1, -(-S // comb.block_s))  # one weighted-sum program per token block
    comb(comb_args)
    return out


def _plan(dctx, cctx, tokens, topk_ids, topk_weights, w_gate, w_up, w_down, h, out, senders, m,
          decode, expert_major):
    cfg1 = default_config(tokens.dtype, tokens.device, True, m)
    cfg2 = down_config(cfg1, cctx._gemm_config(h, decode))
    cc = cctx._combine_config(tokens.device, topk_weights.shape[0])
    # per dispatch context too (its handle, never reused): the plan holds descriptors over
    # its receive and activation buffers and ready counters sized by its capacity, and
    # several layers' dispatch contexts may share one combine context
    key = ("layer", dctx.handle, tokens.dtype, tokens.stride(0), topk_ids.dtype,
           tuple(w_gate.shape), w_gate.stride(), w_down.stride(), topk_weights.dtype,
           topk_weights.stride(), senders, cfg1, cfg2, cc, expert_major,
           align_key(tokens, topk_ids, topk_weights, w_gate, w_up, w_down, out))
    plan = cctx._plans.get(key)
    if plan is not None:
        return plan
    W, E, facts = dctx.world.world_size, dctx.experts_per_rank, dctx.world.facts
    I = w_gate.shape[2]
    cpu = dctx.world.device.type == "cpu"
    x_desc = _descriptors(dctx.recv, w_gate, w_up, cfg1, facts)[0]
    h_desc = cctx._descriptors(h, w_down, cfg2)[0]
    if x_desc is None:  # the pointer loads' tiles (the gated GEMM spills at 128 x 128 there)
        cfg1 = default_config(tokens.dtype, tokens.device, False, m)
        cfg2 = down_config(cfg1, cfg2)
        h_desc = cctx._descriptors(h, w_down, cfg2)[0]
    programs = min(facts.sm_count, G_MAX)
    n_send = senders or swiglu.default_senders(W, programs, cpu)
    # one ready counter per row tile: every segment adds at most one partial row tile
    n_ready = -(-dctx.capacity // cfg1.block_m) + W * E
    ready = kept_zeros(max(n_ready, 1), torch.int32, dctx.world.device)
    queue = kept_zeros(3, torch.int32, dctx.world.device)
    p = SimpleNamespace(cfg1=cfg1, cfg2=cfg2, x_desc=x_desc, h_desc=h_desc, senders=n_send,
                        ready=ready, queue=queue,
                        tag=swiglu.dispatch_tag(OP, dctx, tokens.dtype, n_send), c_tag=0)

    def combine_tag(g):
        # what the sources' weighted sums wait for: this launch's programs (the grid)
        return shape_tag(COMBINE_OP, hidden=cctx.hidden, intermediate=I, experts_per_rank=E,
                         top_k=cctx.top_k, dtype=str(tokens.dtype), config=cctx.config,
                         programs=g, layer=True)

    def args_of(g):
        p.c_tag = combine_tag(g)
        return _args(dctx, cctx, p, tokens, topk_ids, w_gate, w_up, w_down, h, p.tag)

    consts = dict(swiglu.gated_consts(dctx, tokens.dtype, cfg1, x_desc, n_send),
                  BLOCK_N2=cfg2.block_n, BLOCK_K2=cfg2.block_k, GROUP_M2=cfg2.group_m,
                  NUM_STAGES2=cfg2.num_stages, EVEN_K2=I % cfg2.block_k == 0,
                  USE_DESC2=h_desc is not None,
                  # (kernel.py: under the interpreter senders take no down tiles, unless the
                  # grid is senders only: then its one program, which computes, has taken
                  # every gated tile before it takes a down tile, and no later program would)
                  SENDERS_DOWN=not cpu or programs <= n_send, EXPERT_MAJOR=expert_major,
                  BLOCK_SRC=_pow2(W))
    # programs wait for programs of the same launch (the own rows, the activations): the grid
    # must be resident, which _compile ensures
    fused = cctx._compile(moe_layer_kernel, programs, consts, args_of)
    swiglu.check_grid(OP, fused.programs, n_send, consts["SENDERS_COMPUTE"])
    p.c_tag = combine_tag(fused.programs)
    count, exchange = dctx._plan_routing(tokens, topk_ids, fused.programs, p.tag)
    p.launches = (count, exchange, fused)
    p.combine = cctx._plan_combine(topk_weights, out, tokens.dtype,
                                   SimpleNamespace(tag=p.c_tag, programs=fused.programs), cc)
    cctx._plans[key] = p
    return p


def _args(dctx, cctx, p, tokens, topk_ids, w_gate, w_up, w_down, h, tag):
    """The one-launch kernel's arguments; ``tag``: the call's tag on the dispatch's side
    (``ContextBase.call_tag``)."""
    W, E = dctx.world.world_size, dctx.experts_per_rank
    wg_desc = wu_desc = wd_desc = None
    if p.x_desc is not None:  # per call: they hold the weights' addresses
        _, wg_desc, wu_desc = _descriptors(dctx.recv, w_gate, w_up, p.cfg1, dctx.world.facts)
    if p.h_desc is not None:
        wd_desc = cctx._descriptors(h, w_down, p.cfg2)[1]
    return (tokens, topk_ids, dctx._base, dctx._dest_start, dctx.recv, dctx.recv_slots,
            dctx.sent, dctx.ctl, dctx.call_clock, dctx.heap.bases, dctx.status.address,
            dctx.counts, p.queue, p.ready, w_gate, w_up, h, p.x_desc, wg_desc, wu_desc,
            topk_ids.numel(), dctx.top_k, dctx.hidden, tokens.stride(0), E, dctx.capacity,
            dctx.rank, W, tag, dctx.timeout_us, p.senders, w_gate.shape[2], w_gate.stride(0),
            w_gate.stride(1), w_gate.stride(2), h.stride(0),
            w_down, p.h_desc, wd_desc, cctx._combine[tokens.dtype], cctx.slot_epoch, cctx.sent,
            cctx.rows_in, cctx.rows_mine, cctx.consumed, cctx.ctl, cctx.call_clock,
            cctx.heap.bases, cctx.status.address, cctx.max_slots, w_down.stride(0),
            w_down.stride(1), w_down.stride(2), p.c_tag, cctx.timeout_us)
