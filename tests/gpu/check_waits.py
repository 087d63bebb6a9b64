"""Bounded waits on a real GPU, one process (runs on a single-GPU machine too).

Checks, on the device's own clock (shmem.device.call_deadline, wait_flag):
1. ``now_ns`` runs at wall-clock rate: a kernel's clock span against the host's over a spin;
2. a wait for a flag that never comes gives up at the deadline: the copy-engine transport's
   one-program wait kernel with timeout 0.3 s returns within [0.3, 0.6] s, reports a timeout on
   the status board, marks the context out of step; the context then raises PeerTimeoutError and,
   on the next call, ContextBrokenError;
3. one deadline per call: a launch of many more waiting programs than fit on the device at once
   (waves run one after another) still ends within 2x the timeout, not once per wave.
Prints PASS/FAIL lines and exits non-zero on a failure.

    python tests/gpu/check_waits.py
"""
import sys
import time

import torch
import triton
import triton.language as tl

from portable_overlap import ContextBrokenError, GemvAllReduce, PeerTimeoutError, World
from portable_overlap.backends.device_clock import now_ns
from portable_overlap.language.host import CALL_SHIFT
from portable_overlap.shmem.device import calls_done, wait_flag
from portable_overlap.transports.flag_kernels import wait_kernel

failures = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


@triton.jit
def _clock_span(out_ptr, spins):
    t0 = now_ns()
    x = tl.zeros((), tl.int64)
    for i in range(0, spins):  # dependent arithmetic the compiler cannot fold
        x = (x * 3 + i) % 1000003
    tl.store(out_ptr, now_ns() - t0)
    tl.store(out_ptr + 1, x)


@triton.jit
def _many_waiters(flag_ptr, clock_ptr, ctl_ptr, timeout_us, out_ptr):
    epoch = calls_done(ctl_ptr) + 1
    v, arrived = wait_flag(flag_ptr, epoch, epoch, clock_ptr, timeout_us)
    tl.atomic_add(out_ptr, arrived.to(tl.int64))


def main():
    world = World.from_env()
    dev = world.device
    # 1. the clock's rate
    out = torch.zeros(2, dtype=torch.int64, device=dev)
    spins = 2_000_000
    _clock_span[(1,)](out, spins)  # compiled before the timed launch
    torch.cuda.synchronize()
    t0 = time.monotonic()
    _clock_span[(1,)](out, spins)
    torch.cuda.synchronize()
    host = time.monotonic() - t0
    dev_s = out[0].item() / 1e9
    check("now_ns rate", 0.8 * host <= dev_s <= 1.02 * host,
          f"device span {dev_s * 1e3:.1f} ms, host span {host * 1e3:.1f} ms")

    # 2. a wait that never ends gives up at the deadline, and the context says so
    pattern = GemvAllReduce(world, max_n=64, transport="stores", timeout_s=0.3)
    ctx = pattern.impl  # the fused transport's workspace
    flag = torch.zeros(8, dtype=torch.int64, device=dev)
    ctl = torch.full((1,), 1 << CALL_SHIFT, dtype=torch.int64, device=dev)  # call 1

    def wait(expect_tag):  # for flag[3] to hold epoch ctl[0] and the tag
        wait_kernel[(1,)](flag[3:], 1, ctl, 0, expect_tag, ctx.call_clock, ctx.timeout_us,
                          ctx.status.address, 0, (1 << 32) | 3, CHECK_TAG=True, num_warps=1)

    flag[3] = (7 << 32) | 1  # call 1's flag is there: compiles the kernel, no wait
    wait(7)
    torch.cuda.synchronize()
    check("a flag that is there is taken", not ctx.status.failed())
    ctl.fill_(2 << CALL_SHIFT)  # call 2: its flag never comes
    t0 = time.monotonic()
    wait(7)
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    # the start is kept in units of 2**20 ns: the deadline may come up to 1.05 ms early
    # (shmem.device.call_deadline)
    check("wait gives up at the deadline", 0.298 <= took <= 0.6, f"{took:.4f} s (timeout 0.3 s)")
    check("timeout on the status board", ctx.status.failed())
    check("context marked out of step on the device", ctx.call_clock[1].item() != 0)
    try:
        ctx.check()
        check("PeerTimeoutError raised", False, "no error")
    except PeerTimeoutError as e:
        check("PeerTimeoutError raised", "timed out" in str(e), str(e).splitlines()[1][:120])
    x, w = torch.randn(2, 64, device=dev), torch.randn(64, 64, device=dev)
    try:
        ctx(x, w)
        check("next call refused", False, "no error")
    except ContextBrokenError:
        check("next call refused", True)
    pattern.close()

    # 3. one deadline for all waves of a launch
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = sms * 256  # one warp each: about 8 waves of resident programs
    clock = torch.zeros(2, dtype=torch.int64, device=dev)
    arrived = torch.zeros(1, dtype=torch.int64, device=dev)
    ctl.fill_(0)  # the kernel waits for epoch 1
    there = torch.ones(1, dtype=torch.int64, device=dev)
    _many_waiters[(programs,)](there, clock, ctl, 200_000, arrived, num_warps=1)  # compiles
    torch.cuda.synchronize()
    arrived.zero_()
    t0 = time.monotonic()
    _many_waiters[(programs,)](flag, clock, ctl, 200_000, arrived, num_warps=1)  # flag[0] is 0
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    check("one deadline for a launch of many waves", took <= 0.4 and arrived.item() == 0,
          f"{programs} programs, {took:.3f} s (timeout 0.2 s)")
    print(f"wait checks: {len(failures)} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
