"""Fault injection for tests of the fused ops: calls that some ranks skip."""
from __future__ import annotations

from typing import Callable

from ..errors import PeerTimeoutError


def call_while_peers_skip(world, make_ctx: Callable[[], object], call: Callable[[object], object],
                          caller: int = 0) -> str:
    """Collective: every rank makes a context (``make_ctx()``, with a short timeout), rank
    ``caller`` makes one ``call(ctx)`` that the other ranks skip, every rank closes the context.
    Returns, on ``caller``, the text of the ``PeerTimeoutError`` the call raised (``"no error"``
    if none did); ``"ok"`` on the others. The error must name the rank that never came and the
    flag it was waited on for."""
    ctx = make_ctx()
    result = "ok"
    if world.rank == caller:
        try:
            call(ctx)
            ctx.synchronize()
            result = "no error"
        except PeerTimeoutError as e:
            result = str(e)
    ctx.close()
    return result
