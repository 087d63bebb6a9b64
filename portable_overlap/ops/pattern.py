"""Contexts of the patterns that more than one transport implements (GEMM + ReduceScatter,
GEMM + AllReduce, GEMM + All-to-All): the user makes one context per pattern and names the
transport; the context owns the transport's workspace and forwards calls, checks and closing
to it.

The transport is fixed when the context is made because each one's workspace (symmetric
buffers, flags, streams, process groups) is collective to create and cannot be made inside a
call."""
from __future__ import annotations

from typing import Optional

from .context import check_timeout, register_context, unregister_context


class PatternContext:
    """Base of the multi-transport pattern contexts. A subclass sets ``OP`` (the public op
    name), ``TRANSPORTS`` (names, the first is the default) and ``_make(world, transport,
    timeout_s, **options)`` returning the transport's workspace ``impl``; ``__call__`` runs the
    op on it."""

    OP = "op"
    TRANSPORTS: tuple = ()

    def __init__(self, world, transport: Optional[str], timeout_s: Optional[float], options):
        transport = self.TRANSPORTS[0] if transport is None else transport
        if transport not in self.TRANSPORTS:
            raise ValueError(f"{self.OP}: transport must be one of {self.TRANSPORTS}, got "
                             f"{transport!r}")
        if timeout_s is not None:
            check_timeout(self.OP, timeout_s)
        world.check_same(f"{self.OP} transport", transport)
        self.world, self.rank, self.transport = world, world.rank, transport
        self.impl = self._make(world, transport, timeout_s, **options)
        self.handle = register_context(self)

    def _make(self, world, transport, timeout_s, **options):
        raise NotImplementedError

    @property
    def timeout_s(self) -> float:
        """How long the transport's waits last before a missing peer raises (seconds)."""
        return self.impl.timeout_s

    def check(self) -> None:
        """Raise an error a kernel of an earlier call recorded (see OverlapContext.check)."""
        self.impl.check()

    def synchronize(self) -> None:
        """Wait for this context's work on the device, then :meth:`check`."""
        self.impl.synchronize()

    def close(self) -> None:
        """Free the workspace (collective: every rank closes)."""
        unregister_context(self.handle)
        self.impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}/{self.world.world_size}, "
                f"transport={self.transport!r})")


class MatmulPattern(PatternContext):
    """A GEMM pattern's context: sized by the largest result, ``max_m`` x ``max_n`` (the full
    product's rows and columns), from which each transport sizes its own buffers."""

    def __init__(self, world, max_m: int, max_n: int, *, transport: Optional[str] = None,
                 timeout_s: Optional[float] = None, **options):
        for name, v in (("max_m", max_m), ("max_n", max_n)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.OP}: {name} must be an int >= 1, got {v!r}")
        self.max_m, self.max_n = max_m, max_n
        super().__init__(world, transport, timeout_s, options)


def timeout_kw(timeout_s: Optional[float]) -> dict:
    """``timeout_s`` as a keyword for a transport's workspace, or nothing (its own default)."""
    return {} if timeout_s is None else {"timeout_s": timeout_s}
