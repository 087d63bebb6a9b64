"""A clock that Triton kernels can read, for bounded waits: ``now_ns()`` in a kernel gives
nanoseconds from a clock that runs at a constant rate whatever the SM clocks do (on GPUs a wall
clock; under the interpreter the rank's CPU time, below).

- NVIDIA: the ``%globaltimer`` register (ns since the epoch; it ticks about every microsecond);
- AMD CDNA (gfx9): ``s_memrealtime``, the constant 100 MHz real-time counter, scaled to ns
  (the rate ``hipDeviceAttributeWallClockRate`` reports on MI200/MI300);
- the Triton interpreter (the CPU-emulated backend): the CPU time of the rank's process
  (``host_now_ns``), offset to read as ns since 1970 like NVIDIA's clock, so the CPU tests see
  numbers of the size the GPU code handles. CPU time, not wall time: the emulated ranks are
  processes sharing the host's cores (eight ranks on two cores in CI), and a GPU's clock runs
  while its kernel runs, not while the host runs another rank. A wait then gives up after
  ``timeout_s`` of its own spinning, however many ranks share a core, where a wall clock made
  a rank time out because its peer had been descheduled for a few seconds; a waiting rank has
  the core to itself when its peers block (they skipped the call), so a missing peer still
  costs about ``timeout_s`` of wall time.

The choice is made when the kernel is compiled, from the compile target, so one kernel source
serves every target (the compile matrix builds sm_90 and gfx942 on a CPU-only machine)."""
from __future__ import annotations

import time

from triton.language import core

#: ns per tick of the AMD real-time counter (100 MHz)
_AMD_REALTIME_NS = 10


#: ``host_now_ns()`` at import is the wall clock's reading then
_CPU_TIME_OFFSET_NS = time.time_ns() - time.process_time_ns()


def host_now_ns() -> int:
    """The interpreter's clock (ns): this process's CPU time (every thread's), plus the wall
    clock's reading when this module was imported."""
    return _CPU_TIME_OFFSET_NS + time.process_time_ns()


def now_ns(_semantic=None):
    """Current time in ns (int64 scalar). A Triton builtin: call it inside ``@triton.jit`` code."""
    if _semantic is None:
        # The interpreter runs kernels as Python and calls builtins it did not patch without a
        # semantic object: read the rank's clock and hand it back as an interpreter tensor.
        from triton.runtime.interpreter import interpreter_semantic

        return core.tensor(interpreter_semantic.builder.get_int64(host_now_ns()),
                           core.int64)
    arch = str(getattr(_semantic.builder.options, "arch", "") or "")
    if arch.startswith("gfx"):
        from triton.language.extra.hip import memrealtime

        ticks = memrealtime(_semantic=_semantic)
        return _semantic.mul(ticks, _semantic.to_tensor(_AMD_REALTIME_NS), True)
    from triton.language.extra.cuda import globaltimer

    return globaltimer(_semantic=_semantic)


# Marked by hand rather than with ``core.builtin``: that wrapper refuses a call without a
# semantic object, which is exactly how the interpreter calls it.
now_ns.__triton_builtin__ = True
