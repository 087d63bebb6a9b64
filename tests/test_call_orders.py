"""The call protocol over many calls and many contexts, on CPU-emulated ranks: call numbers
far from 0 (a context that ran for hours), the deadline's stamp of an earlier call, contexts
called in other orders on other ranks."""
import time

import pytest
import torch

from portable_overlap import GemvAllReduce, PortableOverlapError, gemv_all_reduce_reference
from portable_overlap.language.host import CALL_SHIFT, CTX_CLOCK


def _inputs(world, M, N, K, seed):
    g = torch.Generator().manual_seed(seed * 1000 + world.rank)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def _skip_calls(ws, n: int) -> None:
    """Move the workspace ``ws`` (a fused GEMV + AllReduce's, between calls, on every rank)
    ``n`` calls on, as if it had made them: its call counter, and every flag word its peers
    wrote, which holds the last call's number in its low half."""
    done = int(ws.ctx[0]) >> CALL_SHIFT
    ws.ctx[0] = (done + n) << CALL_SHIFT
    for flags in (ws.ready, ws.bcast):
        seen = flags != 0
        epoch = (flags & 0xFFFFFFFF) + n
        flags.copy_(torch.where(seen, (flags & ~0xFFFFFFFF) | (epoch & 0xFFFFFFFF), flags))


def _burn_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this process's CPU time: the interpreter's clock
    (``backends.device_clock``) is CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _stamp_of_an_earlier_call(world, transport, skip):
    """Call 2 spins on rank 0 (rank 1 comes late) and stamps the deadline clock; the context
    then moves ``skip`` calls on (its counter and flags), rank 0 spends more than the timeout
    of CPU time, and rank 1 comes late to the next call again."""
    ctx = GemvAllReduce(world, max_n=64, timeout_s=2.0, transport=transport)
    outcomes = []
    for call in range(3):
        x, w = _inputs(world, 2, 40, 16, call)
        ref = gemv_all_reduce_reference(x, w, world.group)
        if call == 2:
            _skip_calls(ctx.impl, skip)
            if world.rank == 0:
                _burn_cpu(2.5)
        world.barrier()
        if world.rank == 1 and call >= 1:
            time.sleep(0.5)  # rank 0's first wait of the call spins
        try:
            y = ctx(x, w, out=torch.full((2, 40), float("nan")))
            outcomes.append("ok" if torch.allclose(y, ref, rtol=1e-4, atol=1e-4) else "wrong")
        except PortableOverlapError as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    stamp = int(ctx.impl.ctx[CTX_CLOCK]) & 0xFFFFFFFF
    ctx.close()
    return outcomes, stamp


@pytest.mark.parametrize("transport", ["stores", "one_shot"])
def test_the_deadline_of_a_call_many_calls_on_is_its_own(world2, transport):
    """The deadline clock stamps the call whose wait spun first. A stamp of the call 65536
    calls back (a rank whose flags were there at every call in between, the last rank to
    arrive) read as this call's gave rank 0's first wait the old start: a timeout at once,
    the context broken for good."""
    skip = 65535  # the call after it is call 2 + 65536
    for rank, (outcomes, stamp) in enumerate(world2.run(_stamp_of_an_earlier_call, transport,
                                                        skip, timeout=300)):
        assert outcomes == ["ok"] * 3, (rank, outcomes)
        if rank == 0:
            assert stamp == 3 + skip, stamp
