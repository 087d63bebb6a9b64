"""``async_proxy_fence()``: order this thread's earlier generic-proxy memory operations (an
acquire that saw a peer's flag) before its later bulk tensor copies (TMA loads through a tensor
descriptor).

NVIDIA's memory model keeps the generic proxy (ordinary loads, stores and atomics) and the
async proxy (TMA) apart: an acquire orders later *generic* loads after the peer's release, and
``fence.proxy.async.global`` extends that order to the async proxy's reads of global memory.
Without it a descriptor load of rows that a peer stored over NVLink may be issued as if the
acquire had not happened. AMD targets and the Triton interpreter have no async proxy (Triton's
AMD backend lowers descriptor loads to ordinary loads): there the fence is nothing.

Chosen when the kernel is compiled, from its target, like ``device_clock.now_ns``."""
from __future__ import annotations

from triton.language import core


def async_proxy_fence(_semantic=None):
    """Emit the fence (see the module docstring); returns an int32 0 that callers ignore. A
    Triton builtin: call it inside ``@triton.jit`` code."""
    if _semantic is None:  # the interpreter: no proxies to order
        from triton.runtime.interpreter import interpreter_semantic

        return core.tensor(interpreter_semantic.builder.get_int32(0), core.int32)
    arch = str(getattr(_semantic.builder.options, "arch", "") or "")
    if arch.startswith("gfx"):
        return _semantic.to_tensor(0)
    return core.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
                                       dtype=core.int32, is_pure=False, pack=1,
                                       _semantic=_semantic)


# marked by hand, as device_clock.now_ns is: the interpreter calls it without a semantic object
async_proxy_fence.__triton_builtin__ = True


def bulk_stores_done(_semantic=None):
    """Wait until this thread's bulk tensor stores (TMA stores through a tensor descriptor) have
    completed, their writes performed and not only their shared-memory source read, then order
    them before its later generic-proxy operations: the release that tells a peer the rows are
    there must not overtake them. Triton waits only for the source reads (``wait_group.read``)
    before reusing the shared buffer, which leaves the writes in flight. Each thread waits for
    the stores it issued; a barrier after this (``language.signal`` makes one) holds the
    others until the issuing thread is through. Nothing on AMD targets and under the
    interpreter, which have no async proxy (see the module docstring)."""
    if _semantic is None:
        from triton.runtime.interpreter import interpreter_semantic

        return core.tensor(interpreter_semantic.builder.get_int32(0), core.int32)
    arch = str(getattr(_semantic.builder.options, "arch", "") or "")
    if arch.startswith("gfx"):
        return _semantic.to_tensor(0)
    return core.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
        dtype=core.int32, is_pure=False, pack=1, _semantic=_semantic)


bulk_stores_done.__triton_builtin__ = True
