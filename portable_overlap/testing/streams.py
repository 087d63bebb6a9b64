"""Calls of one context on several streams, shared by the GPU check script (tests/gpu/) and the
probe that shows what the context's stream ordering prevents (benchmarks/)."""
from __future__ import annotations

import torch

from .compare import rel_err


def calls_on_three_streams(ctx, call, ref, shapes, gen, rounds: int, tol: float = 1e-2,
                           dtype: torch.dtype = torch.bfloat16) -> tuple:
    """``rounds`` times: ``call(*inputs)`` on a side stream s1 (inputs of ``shapes[0]``, the
    long call), on a second side stream s2 (``shapes[1]``) and on the current stream
    (``shapes[2]``), queued back to back with nothing ordering them but the context; each
    output against ``ref(*inputs)``. Fresh random inputs of ``dtype`` each round (``gen``: a
    generator on the context's device). Returns ``(rounds with an error above tol, the errors
    raised, the worst relative error)``; the first error raised ends the rounds."""
    dev = ctx.world.device
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)
    wrong, errors, worst = 0, [], 0.0
    for _ in range(rounds):
        ins = [tuple(torch.randn(sh, generator=gen, device=dev).to(dtype) for sh in group)
               for group in shapes]
        outs = [None] * len(ins)
        s1.wait_stream(main)
        s2.wait_stream(main)
        try:
            for i, stream in enumerate((s1, s2, main)):
                with torch.cuda.stream(stream):
                    outs[i] = call(*ins[i])
            main.wait_stream(s1)
            main.wait_stream(s2)
            ctx.synchronize()
        except Exception as e:  # noqa: BLE001  (reported as the finding)
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            break
        errs = [rel_err(o, ref(*a)) for o, a in zip(outs, ins)]
        worst = max(worst, *errs)
        wrong += any(e > tol for e in errs)
    return wrong, errors, worst
