"""The kernel gate: a stream value wait and write as one-program Triton kernels, for a backend
whose runtime's stream value operations cannot serve (the ROCm backend under graph capture, on a
device without the capability, and on words its command-processor wait refuses); and the reset
of gate words that are separate allocations, reached through their address table
(``GateWords``), in one launch.

A graph capture records a kernel launch on every runtime, while ROCm's stream value operations
are recorded only by releases whose capture hooks cover them; on older ones they run at capture
time and the graph holds nothing. A device without
``hipDeviceAttributeCanUseStreamWaitValue`` has no runtime wait at all.

It costs what the runtime's default wait costs: the runtime waits with a spinning blit kernel
(one workgroup) unless ``GPU_STREAMOPS_CP_WAIT=1``, and this is one spinning program as well
(``DeviceFacts.gate_programs`` = 1 lets the persistent grids leave it room). Unlike the
runtime's wait it is bounded: a word that never reaches its value (the producer kernel failed)
ends the wait after ``WAIT_BUDGET_NS`` with a device trap, which the runtime reports as a failed
kernel at the next synchronization, instead of spinning forever or letting the stream run on
over unfinished data."""
from __future__ import annotations

import triton
import triton.language as tl

from .device_clock import now_ns

#: how long the kernel gate waits before it traps: the waits gate on this rank's own producer
#: kernel (a GEMM of at most seconds), so a minute only ever passes when that kernel failed
WAIT_BUDGET_NS = 60 * 1_000_000_000


# debug=True keeps the device_assert, which compiles to ``s_trap 2`` on gfx942; without it
# Triton drops the assert and a timeout would fall through. No argument is specialized: one
# binary serves every word and value, so the binary loaded before any capture (the backend's
# ``alloc_gate_words``) is the one every later wait runs, never a new compile inside a capture.
@triton.jit(debug=True, do_not_specialize=["address", "value", "budget_ns"])
def gate_wait_kernel(address, value, budget_ns):
    """Spin until the int32 at ``address`` is >= ``value`` (acquire at system scope: Triton's
    AMD backend drops volatile loads), at most ``budget_ns`` from the kernel's start."""
    word = address.to(tl.pointer_type(tl.int32))
    start = now_ns()
    seen = tl.atomic_add(word, 0, sem="acquire", scope="sys")
    late = False
    while (seen < value) & (not late):
        seen = tl.atomic_add(word, 0, sem="acquire", scope="sys")
        late = now_ns() - start > budget_ns
    tl.device_assert(seen >= value, "portable_overlap kernel gate: stream wait timed out")


@triton.jit(do_not_specialize=["address", "value"])
def gate_write_kernel(address, value):
    """Store ``value`` to the int32 at ``address`` (release at system scope, as the runtime's
    stream write is visible to every agent)."""
    tl.atomic_xchg(address.to(tl.pointer_type(tl.int32)), value, sem="release", scope="sys")


#: words one program of ``gate_zero_kernel`` zeroes per step (a workspace's words, in one step)
ZERO_BLOCK = 256


@triton.jit(do_not_specialize=["n"])
def gate_zero_kernel(table_ptr, n, BLOCK: tl.constexpr):
    """Store 0 to the int32 words whose addresses are ``table_ptr[0:n]`` (int64): gate words that
    are separate allocations (``GateWords``), zeroed by one launch instead of one per word."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        i = start + offs
        addr = tl.load(table_ptr + i, mask=i < n, other=0)
        tl.store(addr.to(tl.pointer_type(tl.int32)), 0, mask=i < n)


def launch_wait(address: int, value: int) -> None:
    """Queue the bounded wait on the current stream."""
    gate_wait_kernel[(1,)](address, value, WAIT_BUDGET_NS, num_warps=1)


def launch_write(address: int, value: int) -> None:
    """Queue the write on the current stream."""
    gate_write_kernel[(1,)](address, value, num_warps=1)


def launch_zero(table, n: int) -> None:
    """Queue the zeroing of the words at ``table[0:n]`` on the current stream."""
    gate_zero_kernel[(1,)](table, n, BLOCK=ZERO_BLOCK, num_warps=1)
