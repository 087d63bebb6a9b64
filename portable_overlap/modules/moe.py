"""An expert-parallel MoE feed-forward layer whose combine is the fused expert GEMM + All-to-All.

Rank r holds experts ``[r * E_local, (r + 1) * E_local)`` (each a SiLU-gated MLP H -> I -> H) and
its own tokens. Forward, on every rank::

    scores = softmax(tokens @ router.T); w, ids = top_k(scores)        # [S, k], renormalised
    x, counts, slots = dispatch(tokens, ids)                            # all_to_all, real rows only
    h = silu(x @ w_gate[e]) * (x @ w_up[e])                             # per (source, expert) segment
    out = moe_gemm_combine(h, w_down, counts, slots, w)                 # fused down GEMM + combine

The router is replicated (same weights on every rank). With ``fused=False`` the last line runs
the torch reference instead (per-segment matmul, all_to_all_single with splits, weighted sum).
Forward only (inference): neither the fused op nor the dispatch defines a backward yet.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.moe_combine import MoeGemmCombine, moe_gemm_combine
from ..ops.moe_dispatch import moe_dispatch_reference
from ..ops.moe_combine.reference import combine_rows, expert_outputs


class ExpertParallelMoE(nn.Module):
    """The expert-parallel MoE feed-forward layer of the module docstring: ``num_experts``
    experts split evenly over the ranks, ``top_k`` of them per token; ``forward(tokens)`` takes
    this rank's ``[S, hidden]`` tokens and returns their ``[S, hidden]`` outputs. Collective to
    construct and to :meth:`close` (every rank, same arguments); ``max_tokens`` sizes the
    combine context it makes when ``fused`` and no ``ctx`` is given."""

    def __init__(self, world, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 max_tokens: int, dtype: torch.dtype = torch.bfloat16, fused: bool = True,
                 ctx: Optional[MoeGemmCombine] = None, seed: int = 0):
        super().__init__()
        W = world.world_size
        if num_experts % W:
            raise ValueError(f"num_experts={num_experts} must split evenly over {W} ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.world, self.top_k, self.fused = world, top_k, fused
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
        self.ctx = ctx
        if fused and ctx is None:
            self.ctx = MoeGemmCombine(world, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                                      experts_per_rank=E)

    def route(self, tokens):
        scores = torch.softmax((tokens @ self.router.T).float(), dim=-1)
        w, ids = scores.topk(self.top_k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(tokens)
        x, counts, slots = moe_dispatch_reference(tokens, ids, self.experts_per_rank,
                                                  self.world.group)
        bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
        h = x.new_empty((x.shape[0], self.w_up.shape[2]))
        for s in range(len(bounds) - 1):  # first expert GEMMs, per (source, expert) segment
            lo, hi = bounds[s], bounds[s + 1]
            if hi > lo:
                e = s % self.experts_per_rank
                h[lo:hi] = F.silu(x[lo:hi] @ self.w_gate[e]) * (x[lo:hi] @ self.w_up[e])
        if self.fused:
            if torch.is_grad_enabled() and (h.requires_grad or self.w_down.requires_grad
                                            or weights.requires_grad):
                raise RuntimeError("ExpertParallelMoE: the fused combine has no backward; run "
                                   "the layer under torch.no_grad() (inference) or make it "
                                   "with fused=False to train")
            return moe_gemm_combine(h, self.w_down, counts, slots, weights, self.ctx)
        y = expert_outputs(h, self.w_down, counts, accumulate_fp32=False)
        return combine_rows(y, slots, counts, weights, self.world.group)

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
