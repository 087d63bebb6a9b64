"""Reference of the MoE layer after routing, with torch and torch.distributed: the dispatch by
``all_to_all_single`` with host-read splits, the experts' gated GEMM and down GEMM per
(source, expert) segment, the rows back by ``all_to_all_single`` and the weighted sum. It is
the torch path of ``ExpertParallelMoE(fused=False)`` and the layer benchmark's baseline."""
from __future__ import annotations

import torch

from ..moe_combine.reference import combine_rows, expert_outputs
from ..moe_dispatch.reference import moe_dispatch_reference
from ..moe_experts.reference import expert_swiglu_reference


def moe_layer_reference(tokens, topk_ids, topk_weights, w_gate, w_up, w_down,
                        experts_per_rank: int, group=None, accumulate_fp32: bool = True,
                        records_grad: bool = False):
    """What :func:`moe_layer` computes: ``out`` [S, H] on each rank. ``accumulate_fp32``: both
    GEMMs in float32, each rounded to the tokens' dtype as the kernels store them (to compare
    with); else in the tokens' dtype, as a model's torch path runs them (to time).
    ``records_grad``: the dispatch's (``moe_dispatch_reference``)."""
    x, counts, slots = moe_dispatch_reference(tokens, topk_ids, experts_per_rank, group,
                                              records_grad)
    if accumulate_fp32:
        h = expert_swiglu_reference(x, w_gate, w_up, counts)
    else:
        h = x.new_empty((x.shape[0], w_up.shape[2]))
        bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
        for s in range(len(bounds) - 1):
            lo, hi = bounds[s], bounds[s + 1]
            if hi > lo:
                e = s % experts_per_rank
                h[lo:hi] = (torch.nn.functional.silu(x[lo:hi] @ w_gate[e])
                            * (x[lo:hi] @ w_up[e]))
    y = expert_outputs(h, w_down, counts, accumulate_fp32)
    return combine_rows(y, slots, counts, topk_weights, group)
