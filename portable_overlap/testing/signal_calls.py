"""The tile-group-signal transport's three calls as functions ``fn(a, b, ctx, out=None, **kw)`` of
its own workspace (``GemmSignal``), for the tests, GPU checks and benchmarks that drive the
transport directly instead of through a pattern context."""


def gemm_all_reduce(a, b, ctx, out=None, **kw):
    return ctx.all_reduce(a, b, out, **kw)


def gemm_reduce_scatter(a, b, ctx, out=None, **kw):
    return ctx.reduce_scatter(a, b, out, **kw)


def gemm_all_to_all_signal(a, b, ctx, out=None, **kw):
    return ctx.all_to_all(a, b, out, **kw)
