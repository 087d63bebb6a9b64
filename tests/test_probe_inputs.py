"""Edge inputs of the public ops on 2 CPU-emulated ranks: tiny and prime shapes, outputs that
alias an input, inputs that require grad, routing edge cases. Each result is compared with the
torch reference on a NaN-poisoned output."""
import pytest
import torch

from portable_overlap import GemvAllReduce, gemv_all_reduce_reference
from portable_overlap.testing.compare import rel_err


def _gemv_inputs(world, M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the probe reports what was raised
        return type(e).__name__, str(e)
    return "ok", ""


def _gemv_edges(world, transport):
    """Tiny / prime shapes (K below a block) against the reference, then the refusals: an out
    aliasing x or w, inputs that require grad; a normal call after them must still work."""
    ctx = GemvAllReduce(world, max_n=32, transport=transport)
    errs, refusals = [], {}
    try:
        for i, (M, N, K) in enumerate([(1, 1, 1), (1, 7, 3), (3, 13, 5), (2, 31, 17)]):
            x, w = _gemv_inputs(world, M, N, K, i)
            y = torch.full((M, N), float("nan"))
            ctx(x, w, out=y)
            errs.append(rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
        x, w = _gemv_inputs(world, 4, 4, 4, 9)
        refusals["out=x"] = _outcome(lambda: ctx(x, w, out=x))
        refusals["out=w"] = _outcome(lambda: ctx(x, w, out=w))
        buf = torch.cat([x.flatten(), torch.zeros(8)])  # out over x's last half and beyond
        refusals["out over x"] = _outcome(lambda: ctx(buf[:16].view(4, 4), w,
                                                      out=buf[8:].view(4, 4)))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        refusals["grad"] = _outcome(lambda: ctx(xg, wg))
        with torch.no_grad():
            y = ctx(xg, wg)
        errs.append(rel_err(y, gemv_all_reduce_reference(x, w, world.group)))
    finally:
        ctx.close()
    return errs, refusals


@pytest.mark.parametrize("transport", ["stores", "one_shot", "sequential"])
def test_gemv_edges_and_refusals(world2, transport):
    for errs, refusals in world2.run(_gemv_edges, transport):
        assert max(errs) < 1e-5, errs
        # an out that aliases an input: torch.mm(out=x) gave a silently wrong result
        for key in ("out=x", "out=w", "out over x"):
            assert refusals[key][0] == "ValueError" and "share memory" in refusals[key][1], \
                refusals[key]
        # the context call dropped the graph (fused) or raised autograd's own error (sequential)
        assert refusals["grad"][0] == "RuntimeError" and "no backward" in refusals["grad"][1], \
            refusals["grad"]
