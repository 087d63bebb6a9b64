"""Reference of the experts' gated first GEMMs over the dispatch layout (torch, per segment)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                            counts: torch.Tensor) -> torch.Tensor:
    """``h[i] = silu(x[i] @ w_gate[e]) * (x[i] @ w_up[e])`` for the rows of each (source q,
    local expert e) segment (``counts[q, e]`` rows, segments in order), in float32, rounded to
    x's dtype; ``counts.sum()`` rows (x may hold more)."""
    W, E = counts.shape
    bounds = [0] + torch.cumsum(counts.flatten().long(), 0).tolist()
    h = x.new_empty((bounds[-1], w_gate.shape[2]))
    for s in range(W * E):
        lo, hi = bounds[s], bounds[s + 1]
        if hi > lo:
            xs = x[lo:hi].float()
            h[lo:hi] = (F.silu(xs @ w_gate[s % E].float()) * (xs @ w_up[s % E].float())).to(x.dtype)
    return h
