"""An expert-parallel MoE feed-forward layer run on the GPU end to end: no host sync, so the
whole layer can be captured in a CUDA graph.

Rank r holds experts ``[r * E_local, (r + 1) * E_local)`` (each a SiLU-gated MLP H -> I -> H) and
its own tokens. Forward, on every rank::

    scores = softmax(tokens @ router.T); w, ids = top_k(scores)        # [S, k], renormalised
    x, counts, slots = moe_dispatch(tokens, ids)       # rows stored into the experts' ranks
    h = expert_swiglu(x, w_gate, w_up, counts)         # silu(x @ w_gate[e]) * (x @ w_up[e])
    out = moe_gemm_combine(h, w_down, counts, slots, w)        # fused down GEMM + combine

With ``fuse_dispatch=True`` the dispatch and the gated GEMM run as one launch after the routing
counts are exchanged (``moe_dispatch_swiglu``: the GEMM starts on each source's rows as they
arrive, this rank's own rows first); with ``one_launch=True`` the down GEMM and the combine's
row stores join that launch too (``ops/moe_layer``: a down tile starts once the gated tiles of
its rows are done), leaving the weighted sum to a launch of its own. The default is the staged
launches: on 2 H200s neither fused form was faster at prefill (within 1-5 % either way) and
both were 8-43 % slower at decode sizes (docs/moe.md).

The router is replicated (same weights on every rank). With ``fused=False`` the layer is the
torch path instead: ``all_to_all_single`` dispatch with host-read splits, per-segment matmuls,
``all_to_all_single`` back and the weighted sum. Either forward trains: the backward runs the
staged torch path (``moe_backward``: the tokens dispatched again with their gradient, the
experts' activations recomputed, the rows' gradients sent back), so the fused forward is what
is fast and the backward is correct.
"""
from __future__ import annotations

import functools

from typing import Optional

import torch
from torch import nn

from ..ops.moe_combine import MoeGemmCombine, moe_gemm_combine
from ..ops.moe_dispatch import MoeDispatch, moe_dispatch, moe_dispatch_swiglu
from ..ops.moe_dispatch.reference import refuse_dispatch
from ..ops.moe_experts import expert_swiglu
from ..ops.moe_layer import moe_layer, moe_layer_reference
from ..ops.context import check_sizes, refuse_call
from ..world import collective_setup
from .agreement import kind, same_arguments
from .moe_backward import MoeLayerFunction
from .copying import FusedLayerState
from .linear import autocast_dtype

NAME = "ExpertParallelMoE"


def _check_ctx(ctx, world, fused, one_launch, hidden, top_k, experts_per_rank,
               max_tokens) -> None:
    """A combine context given to the layer (``ctx``): one the fused layer can call with its
    own sizes, on its world, and with a ``"stores"`` workspace (named, or ``"auto"``'s) where
    the layer runs in one launch (``moe_layer`` stores the rows itself). Checked when the
    layer is made, where otherwise every call would fail in the combine after its dispatch had
    run (or only the calls past a smaller ``max_tokens``); the torch path uses none."""
    if ctx is None:
        return
    if not fused:
        raise ValueError(f"{NAME}: ctx is a combine context of the fused layer; the torch path "
                         f"(fused=False) uses none")
    if not isinstance(ctx, MoeGemmCombine):
        raise ValueError(f"{NAME}: ctx must be a MoeGemmCombine, got {type(ctx).__name__}")
    if ctx.world is not world:
        raise ValueError(f"{NAME}: ctx must be made on the layer's world")
    want = dict(hidden=hidden, top_k=top_k, experts_per_rank=experts_per_rank)
    for name, v in want.items():
        if getattr(ctx, name) != v:
            raise ValueError(f"{NAME}: ctx was made with {name}={getattr(ctx, name)}, the layer "
                             f"has {name}={v}")
    if ctx.max_tokens < max_tokens:
        raise ValueError(f"{NAME}: ctx was made with max_tokens={ctx.max_tokens}, fewer than "
                         f"the layer's max_tokens={max_tokens}")
    if one_launch and ctx.kernel() is None:
        raise ValueError(f"{NAME}: ctx was made with transport={ctx.transport!r}; one_launch=True "
                         f"stores the rows itself and needs a combine context with transport="
                         f"'stores' or 'auto'")


class ExpertParallelMoE(FusedLayerState, nn.Module):
    """The expert-parallel MoE feed-forward layer of the module docstring: ``num_experts``
    experts split evenly over the ranks, ``top_k`` of them per token; ``forward(tokens)`` takes
    this rank's ``[S, hidden]`` tokens of the layer's dtype (under ``torch.autocast``, tokens of
    another are cast to it) and returns their ``[S, hidden]`` outputs. Collective to
    construct and to :meth:`close` (every rank, same arguments). When ``fused``, ``max_tokens``
    (most tokens a rank passes) and ``capacity`` (most rows a rank's experts receive in a call;
    default: every rank's tokens, which no routing exceeds) size the dispatch and combine
    contexts it makes (with the library's default transport, ``"auto"`` on a GPU world, except
    the dispatch's of the fused schedules below, ``"stores"``; ``ctx``: a combine context to use
    instead, made on the layer's world with its ``hidden``, ``top_k`` and experts per rank and
    at least its ``max_tokens``, and for ``one_launch`` with the ``"stores"`` or ``"auto"``
    transport, else ``ValueError``; it stays the caller's to close); ``fuse_dispatch``: the
    dispatch and the gated GEMM in one launch; ``one_launch``: the dispatch and both expert
    GEMMs in one launch (module docstring); ``dedup``: the staged dispatch sends a token once
    per rank it reaches (``MoeDispatch``; None: its rule; the fused schedules send a row per
    expert). The ranks compare their arguments (``RankMismatchError`` on every rank where they
    differ: the router, made from ``seed``, must be the same on every rank), and an argument
    refused on one rank raises ``PeerSetupError`` on the others."""

    @collective_setup
    def __init__(self, world, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 max_tokens: int, dtype: torch.dtype = torch.bfloat16, fused: bool = True,
                 ctx: Optional[MoeGemmCombine] = None, capacity: Optional[int] = None,
                 seed: int = 0, fuse_dispatch: bool = False, one_launch: bool = False,
                 dedup: Optional[bool] = None):
        super().__init__()
        W = world.world_size
        # (0 failed in the weights' initialisation, 0 ** -0.5, with a ZeroDivisionError)
        check_sizes(NAME, hidden=hidden, intermediate=intermediate,
                    num_experts=num_experts, top_k=top_k)
        if num_experts % W:
            raise ValueError(f"{NAME}: num_experts={num_experts} must split evenly over {W} "
                             f"ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{NAME}: top_k must be in [1, {num_experts}], got {top_k}")
        for name, v in (("fuse_dispatch", fuse_dispatch), ("one_launch", one_launch)):
            if v and not fused:
                raise ValueError(f"{NAME}: {name}=True needs fused=True (the torch path has no "
                                 f"launches to fuse)")
        if fuse_dispatch and one_launch:
            raise ValueError(f"{NAME}: fuse_dispatch and one_launch are two schedules of the "
                             f"fused layer: pass one")
        _check_ctx(ctx, world, fused, one_launch, hidden, top_k, num_experts // W, max_tokens)
        if dedup and (fuse_dispatch or one_launch or not fused):
            raise ValueError(f"{NAME}: dedup=True is an option of the staged fused layer "
                             f"(fused=True without fuse_dispatch or one_launch): the others send "
                             f"a row per expert")
        same_arguments(world, NAME, hidden=hidden, intermediate=intermediate,
                       num_experts=num_experts, top_k=top_k, max_tokens=max_tokens,
                       dtype=dtype, fused=bool(fused), ctx=kind(ctx), capacity=capacity,
                       seed=seed, fuse_dispatch=bool(fuse_dispatch),
                       one_launch=bool(one_launch), dedup=dedup)
        self.world, self.top_k, self.fused = world, top_k, fused
        self.fuse_dispatch, self.one_launch = bool(fuse_dispatch), bool(one_launch)
        self.experts_per_rank = E = num_experts // W
        dev = world.device
        g = torch.Generator(device="cpu").manual_seed(seed)  # same router on every rank
        self.router = nn.Parameter((torch.randn(num_experts, hidden, generator=g)
                                    * hidden ** -0.5).to(dev, dtype))
        g.manual_seed(seed + 1 + world.rank)  # this rank's experts
        std_in, std_mid = hidden ** -0.5, intermediate ** -0.5
        self.w_gate = nn.Parameter((torch.randn(E, hidden, intermediate, generator=g) * std_in)
                                   .to(dev, dtype))
        self.w_up = nn.Parameter((torch.randn(E, hidden, intermediate, generator=g) * std_in)
                                 .to(dev, dtype))
        self.w_down = nn.Parameter((torch.randn(E, intermediate, hidden, generator=g) * std_mid)
                                   .to(dev, dtype))
        self.ctx, self.dispatch_ctx, self._h = ctx, None, None
        self._owns_ctx = fused and ctx is None  # a ctx given stays the caller's to close
        if fused:
            if ctx is None:
                self.ctx = MoeGemmCombine(world, max_tokens=max_tokens, top_k=top_k,
                                          hidden=hidden, experts_per_rank=E)
            staged = not (fuse_dispatch or one_launch)
            # (the fused schedules store rows themselves: they run on the "stores" workspace)
            self.dispatch_ctx = MoeDispatch(world, max_tokens=max_tokens, top_k=top_k,
                                            hidden=hidden, experts_per_rank=E, dtype=dtype,
                                            capacity=capacity,
                                            transport=None if staged else "stores",
                                            dedup=dedup if staged else False)
            if not one_launch:  # (the one-launch layer keeps its own on the dispatch context)
                # the gated activations of every received row, reused by each call
                self._h = torch.empty((self.dispatch_ctx.capacity, intermediate), dtype=dtype,
                                      device=dev)

    def extra_repr(self) -> str:
        schedule = ("torch path" if not self.fused else "one launch" if self.one_launch
                    else "fused dispatch" if self.fuse_dispatch else "staged")
        E, H, intermediate = self.w_gate.shape
        return (f"hidden={H}, intermediate={intermediate}, "
                f"num_experts={E * self.world.world_size}, top_k={self.top_k}, "
                f"world={self.world.world_size}, schedule={schedule}")

    def route(self, tokens):
        scores = torch.softmax((tokens @ self.router.T).float(), dim=-1)
        w, ids = scores.topk(self.top_k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if autocast_dtype(tokens) is not None:
            # under torch.autocast the layer computes in its own dtype, the one its fused
            # contexts were made for: tokens of another (the fp32 residual stream) are cast
            tokens = tokens.to(self.router.dtype)
        try:
            self._check_tokens(tokens)
        except (TypeError, ValueError) as e:
            self._refuse_call(e)
            raise
        weights, ids = self.route(tokens)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (
                tokens, weights, self.w_gate, self.w_up, self.w_down)):
            return MoeLayerFunction.apply(tokens, weights, ids, self.w_gate, self.w_up,
                                          self.w_down, functools.partial(self._forward,
                                                                         records_grad=True),
                                          self.experts_per_rank, self.world.group)
        return self._forward(tokens, weights, ids)

    def _check_tokens(self, tokens) -> None:
        """``tokens`` against the layer (before the router): a [S, hidden] tensor of its dtype
        and device. A batch of sequences is flattened by the caller (``x.view(-1, hidden)``)."""
        r = self.router
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 \
                or tokens.shape[1] != r.shape[1]:
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
            raise ValueError(f"ExpertParallelMoE: tokens must be a [S, {r.shape[1]}] tensor "
                             f"(flatten the batch first); got {got}")
        if tokens.dtype != r.dtype or tokens.device != r.device:
            raise TypeError(f"ExpertParallelMoE: tokens must be {r.dtype} on {r.device} (the "
                            f"layer's); got {tokens.dtype} on {tokens.device}")
        if self.fused and self.dispatch_ctx.dtype != r.dtype:
            # module.to(dtype) / .half() / .float() convert the parameters, not the contexts'
            # buffers made for the layer's dtype
            raise TypeError(f"ExpertParallelMoE: the layer's parameters are {r.dtype}, its "
                            f"fused contexts were made for {self.dispatch_ctx.dtype} "
                            f"(module.to(dtype), .half() and .float() convert the parameters "
                            f"only): build the layer with dtype={r.dtype}")

    def _refuse_call(self, error: BaseException) -> None:
        """This rank's tokens failed the layer's check, before its first fused op: refuse that
        op's call, so that the peers fail it at once ("rank r gave up") and stay in step,
        instead of waiting for this rank until their timeout (which breaks the contexts, after
        pairing their call with this rank's next one). The caller raises ``error`` then. On the
        torch path (``fused=False``) this rank takes part in the dispatch's counts exchange,
        the peers' first collective of the call, with a refusal (``refuse_dispatch``): they
        raise ``PeerTimeoutError`` for it at once instead of waiting in it for the process
        group's timeout (gloo's: half an hour)."""
        if not self.fused:
            W = self.world.world_size
            refuse_dispatch(W, self.experts_per_rank, self.router.device, self.world.group)
            return
        try:
            if self.one_launch:  # (ops/moe_layer: one call of both contexts' workspaces)
                refuse_call([self.dispatch_ctx.kernel(), self.ctx.kernel()], error)
            elif self.fuse_dispatch:
                refuse_call([self.dispatch_ctx.swiglu_workspace()], error)
            else:  # the peers' call as "auto" keys it: tokens of the context's dtype and width
                meta = dict(device="meta")
                self.dispatch_ctx.refuse(
                    error, torch.empty((0, self.dispatch_ctx.hidden), dtype=self.dispatch_ctx.dtype,
                                       **meta),
                    torch.empty((0, self.top_k), dtype=torch.int64, **meta))
        except Exception:  # noqa: BLE001  (an interrupt still propagates)
            # the refusal raises ``error``, or the context's own error where it is closed or
            # broken: the caller raises ``error`` either way
            pass

    def _forward(self, tokens, weights, ids, records_grad: bool = False) -> torch.Tensor:
        """The layer after routing. ``records_grad``: autograd records the call (its backward
        then holds collectives on every rank); the dispatch carries it, so ranks that differ
        raise ``RankMismatchError`` here on every rank instead of some waiting in the
        backward for ever."""
        if not self.fused:
            return moe_layer_reference(tokens, ids, weights, self.w_gate, self.w_up, self.w_down,
                                       self.experts_per_rank, self.world.group,
                                       accumulate_fp32=False, records_grad=records_grad)
        if not records_grad:  # (the inference forward, which torch.compile traces)
            return self._fused_forward(tokens, weights, ids)
        with self.dispatch_ctx.recording():
            return self._fused_forward(tokens, weights, ids)

    def _fused_forward(self, tokens, weights, ids) -> torch.Tensor:
        # the fused ops take tokens with contiguous rows (a transposed view is a valid input of
        # the layer, as of nn.Linear)
        tokens = tokens.contiguous()
        # each source sends an expert S * k / (all experts) rows on average (balanced). Traced,
        # that float of the token count became a constant guarded on it, one graph per count
        # (torch.compile's limit of 8 then failed a fullgraph layer at the 9th): there the
        # fused parts compute it from the call's own S (moe_layer, moe_dispatch_swiglu), or
        # from the receive buffer's rows (expert_swiglu, after the unfused dispatch)
        m = None if torch.compiler.is_compiling() else \
            tokens.shape[0] * self.top_k / (self.experts_per_rank * self.world.world_size)
        # Any layout of the parameters is the layer's to take (a column-major one is what
        # load_state_dict(..., assign=True) leaves of such a checkpoint): the fused ops read
        # rows, so a copy where they are not contiguous (none where they are, as built)
        w_gate, w_up, w_down = (w.contiguous() for w in (self.w_gate, self.w_up, self.w_down))
        if self.one_launch:
            return moe_layer(tokens, ids, weights, w_gate, w_up, w_down, self.dispatch_ctx,
                             self.ctx, rows_per_segment=m)
        # under torch.compile the parts are functional ops (one node each, no out=)
        h_buf = None if torch.compiler.is_compiling() else self._h
        if self.fuse_dispatch:
            h, counts, slots = moe_dispatch_swiglu(tokens, ids, w_gate, w_up, self.dispatch_ctx,
                                                   out=h_buf, rows_per_segment=m)
        else:
            x, counts, slots = moe_dispatch(tokens, ids, self.dispatch_ctx)
            try:
                h = expert_swiglu(x, w_gate, w_up, counts, out=h_buf, rows_per_segment=m)
            except Exception as e:
                # expert_swiglu is local, between two collective ops: raised on this rank
                # alone (weights of another dtype here), it left the peers waiting in the
                # combine until their timeout, and this rank's next combine paired with their
                # call of this step (its output: the previous tokens' rows, no error). The
                # combine's call is refused instead, as the peers key it (eager calls: a
                # compiled graph runs the parts with no handler between them).
                if h_buf is not None:
                    self._refuse_combine(e, h_buf, w_down, counts, slots, weights)
                raise
        return moe_gemm_combine(h, w_down, counts, slots, weights, self.ctx)

    def _refuse_combine(self, error, h, w_down, counts, slots, weights) -> None:
        """Refuse this step's combine call (its arguments as the peers pass them), so that the
        peers fail it at once and stay in step; the caller raises ``error``."""
        try:
            self.ctx.refuse(error, h, w_down, counts, slots, weights)
        except Exception as e:  # noqa: BLE001  (the refusal raises error, or the context's own)
            note = getattr(error, "add_note", None)  # (Python 3.11 on)
            if e is not error and note is not None:
                note(f"(the combine's refusal was not sent to the peers: {type(e).__name__}: "
                     f"{e}; they may wait in this step's combine until their timeout)")

    def synchronize(self) -> None:
        """Wait for this rank's queued work and raise what the fused ops' kernels found."""
        for c in (self.dispatch_ctx, self.ctx):
            if c is not None:
                c.synchronize()

    def close(self) -> None:
        """Collective: free the contexts the layer made (a ``ctx`` given stays the caller's, as
        the parallel linear layers leave theirs: layers sharing one are closed one by one)."""
        if self.dispatch_ctx is not None:
            self.dispatch_ctx.close()
        if self._owns_ctx:
            self._owns_ctx = False
            self.ctx.close()
