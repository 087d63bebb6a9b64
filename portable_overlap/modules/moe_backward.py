"""Autograd for the expert-parallel MoE layer: any forward (the fused ops or the torch path), one
backward through the staged torch path.

With ``x`` the rows dispatched to rank r's experts (rows by source rank, then by local expert),
``y[i] = (silu(x[i] @ w_gate[e]) * (x[i] @ w_up[e])) @ w_down[e]`` for row i of local expert e,
and slot ``s * k + j`` naming token s's j-th choice on its source rank, the layer computes on
every rank ``out[s] = sum_j weights[s, j] * y[row of slot s * k + j]``. Its backward on rank r,
given ``dout`` [S, H] (the rank's upstream gradient)::

    g     = dispatch(dout)                       # dout[s] to every expert token s went to
    dy[i] = weights[slot(i)] * g[i]              # the weights travel with the rows
    dweights[s, j] = <dout[s], y[row of slot s * k + j]>   (on the expert's rank: <g[i], y[i]>)
    dw_gate, dw_up, dw_down, dx = vjp of the experts at dy (local, per expert)
    dtokens[s] = sum_j dx[row of slot s * k + j]           (rows sent back, summed per token)

The forward's dispatch buffers are not kept (the fused ones are the contexts', reused by the
next call): the backward dispatches the tokens again beside ``dout`` and recomputes the experts'
activations, trading one more exchange of the tokens for not holding ``R x H`` rows per layer.
The gradients reach ``tokens`` and ``weights`` (so the router, through torch's own autograd of
the routing) and this rank's expert weights; no gradient is exchanged between ranks beyond
the rows above, so a replicated router needs its gradient reduced over the ranks like any
data-parallel parameter. The backward holds collectives: every rank of the group runs it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops.moe_combine.reference import return_rows
from ..ops.moe_dispatch import moe_dispatch_reference


def _experts(x: torch.Tensor, w_gate, w_up, w_down, counts: torch.Tensor) -> torch.Tensor:
    """``y`` [R, H] of the module docstring, differentiable: each local expert's rows of all
    sources gathered into one matmul chain (E matmul chains, not W * E)."""
    W, E = counts.shape
    seg_expert = torch.arange(W * E, device=x.device) % E
    row_expert = seg_expert.repeat_interleave(counts.flatten().long())
    order = torch.argsort(row_expert, stable=True)
    per_expert = torch.bincount(row_expert, minlength=E).tolist()
    parts = []
    for e, xe in enumerate(torch.split(x[order], per_expert)):
        if xe.shape[0]:
            parts.append((F.silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e])
    if not parts:
        return x.new_zeros((0, w_down.shape[2]))
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    return torch.cat(parts)[inv]  # back to the dispatch layout


def dense_layer_reference(tokens, router, w_gate, w_up, w_down, top_k: int) -> torch.Tensor:
    """The layer on one process, differentiable: ``tokens`` [S, H] of every rank, all experts'
    weights (global ids, ``[E, H, I]`` / ``[E, I, H]``), the router [E, H]. What the distributed
    forward and backward are checked against."""
    scores = torch.softmax(tokens @ router.T, -1)
    w, ids = scores.topk(top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for g in range(w_gate.shape[0]):
        tok, j = (ids == g).nonzero(as_tuple=True)
        if tok.numel():
            xe = tokens[tok]
            ye = (F.silu(xe @ w_gate[g]) * (xe @ w_up[g])) @ w_down[g]
            out = out.index_add(0, tok, w[tok, j].unsqueeze(1) * ye)
    return out


class MoeLayerFunction(torch.autograd.Function):
    """``out = forward(tokens, weights, ids)`` (any implementation of the layer's forward, e.g.
    the fused ops), differentiated by the staged torch path of the module docstring with
    respect to ``tokens``, ``weights``, ``w_gate``, ``w_up`` and ``w_down``. Once: a second
    derivative (``create_graph=True``, then a gradient of the gradients) raises."""

    @staticmethod
    def forward(ctx, tokens, weights, ids, w_gate, w_up, w_down, forward: Callable,
                experts_per_rank: int, group: Optional[dist.ProcessGroup]):
        ctx.save_for_backward(tokens, weights, ids, w_gate, w_up, w_down)
        ctx.experts_per_rank, ctx.group = experts_per_rank, group
        return forward(tokens, weights, ids)

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():
            # (a backward with create_graph=True runs in grad mode) the gradients below are
            # taken on detached copies of the weights and tokens: their graph holds no path to
            # the weights, so a second derivative (a gradient penalty) would miss the experts'
            # part with no error. Raised before the first exchange: ranks that all ask for it
            # all raise
            raise RuntimeError("ExpertParallelMoE: the layer's backward is not differentiable "
                               "(create_graph=True): its second derivatives are not computed")
        tokens, weights, ids, w_gate, w_up, w_down = ctx.saved_tensors
        E, group = ctx.experts_per_rank, ctx.group
        S, k = ids.shape
        H = tokens.shape[1]
        # tokens and their upstream gradient travel together (one exchange), the routing
        # weights beside them in float32 (their gradient's inner products need the precision)
        both = torch.cat([tokens.detach(), dout.to(tokens.dtype)], 1)
        xg, counts, slots = moe_dispatch_reference(both, ids, E, group)
        wr = moe_dispatch_reference(weights.detach().float(), ids, E, group)[0]
        x, g = xg[:, :H], xg[:, H:]
        w_row = wr.gather(1, (slots.long() % k).unsqueeze(1)).squeeze(1)
        # every rank runs the same exchanges whatever it needs (a rank skipping one would
        # leave its peers waiting in it), so dx and the inner products are always computed
        params = [p.detach().requires_grad_(n)
                  for p, n in zip((w_gate, w_up, w_down), ctx.needs_input_grad[3:6])]
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            y = _experts(xr, *params, counts)
            dy = (w_row.unsqueeze(1) * g.float()).to(y.dtype)
            inputs = [xr] + [p for p in params if p.requires_grad]
            got = iter(torch.autograd.grad(y, inputs, dy, allow_unused=True)
                       if y.requires_grad else [None] * len(inputs))
        grads = [next(got) if t.requires_grad else None for t in (xr, *params)]
        grads = [torch.zeros_like(t) if gr is None and t.requires_grad else gr
                 for gr, t in zip(grads, (xr, *params))]
        dtokens = return_rows(grads[0], slots, counts, S * k, group).view(S, k, H).sum(1)
        dots = (g.float() * y.detach().float()).sum(1, keepdim=True)
        dweights = return_rows(dots, slots, counts, S * k, group).view(S, k)
        return (dtokens.to(tokens.dtype) if ctx.needs_input_grad[0] else None,
                dweights.to(weights.dtype) if ctx.needs_input_grad[1] else None, None,
                grads[1], grads[2], grads[3], None, None, None)
