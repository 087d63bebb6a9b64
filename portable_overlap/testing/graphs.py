"""Graph-replay checks shared by the GPU check scripts (tests/gpu/)."""
from __future__ import annotations

import torch

from .compare import rel_err


def worst_over_graph_replays(ctx, call, a, out, ref, gen, replays: int = 3) -> float:
    """Capture ``call()`` once in a CUDA graph, then replay it ``replays`` times, with fresh
    random values in ``a`` and a poisoned ``out`` before each replay; the worst relative error of
    ``out`` against ``ref()`` (the reference on the current inputs). ``ctx.synchronize()``
    raises what the op's kernels reported."""
    call()
    ctx.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    worst = 0.0
    for _ in range(replays):
        a.copy_(torch.randn(tuple(a.shape), generator=gen, device=a.device,
                            dtype=torch.float32).to(a.dtype))
        out.fill_(float("nan"))
        graph.replay()
        ctx.synchronize()
        worst = max(worst, rel_err(out, ref()))
    return worst
