"""The signal / wait helpers of shmem/device.py (and the public device API built on them)
compile to system-scope release and acquire on
both vendors: a peer flag is written after this program's stores are visible to the whole
system, and a poll reads past every cache. Checked in the compiled code for sm_90, gfx942 and
gfx950 (the helpers' memory semantics are what the protocol rests on; a compiler that dropped
them would pass every test on one GPU and fail across GPUs)."""
import re

import pytest
import triton
import triton.language as tl

from portable_overlap.kernel_registry import TARGETS, compile_spec
from portable_overlap.shmem.device import signal_peer, wait_flag


@triton.jit
def _signal_then_wait(flag_ptr, bases_ptr, clock_ptr, out_ptr, rank, peer, value, want, call,
                      timeout_us):
    signal_peer(flag_ptr, value, bases_ptr, rank, peer)
    got, ok = wait_flag(flag_ptr, want, call, clock_ptr, timeout_us)
    tl.store(out_ptr, got)


SIG = {"flag_ptr": "*i64", "bases_ptr": "*i64", "clock_ptr": "*i64", "out_ptr": "*i64",
       "rank": "i32", "peer": "i32", "value": "i64", "want": "i64", "call": "i64",
       "timeout_us": "i32"}


def _language_kernel():
    """The public device API's kernel of every primitive (its compile spec's bf16 entry)."""
    from portable_overlap.language.compile_specs import specs

    name, fn, sig, consts, aligned = next(specs())
    return fn, sig, consts, aligned


KERNELS = {"shmem.device": lambda: (_signal_then_wait, SIG, {}, []),
           "language": _language_kernel}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_signal_is_a_system_release_and_the_poll_a_system_acquire(target, kernel):
    k = compile_spec(*KERNELS[kernel](), target)
    if target[0] == "cuda":
        ptx = k.asm["ptx"]
        if kernel == "language":  # pol.fence_bulk_reads: the acquire ordered before TMA reads
            assert "fence.proxy.async.global" in ptx
        assert re.search(r"atom\.global\.sys\.release\.exch\.b64", ptx), ptx
        assert re.search(r"ld\.global\.sys\.acquire\.b64", ptx), ptx
        return
    asm = k.asm["amdgcn"].split(".Lfunc_end")[0]
    ops = [line.strip() for line in asm.splitlines()
           if re.match(r"\s*(global_|buffer_)", line)]
    # release: write back L2 at system scope, then the swap at system scope
    swap = next(i for i, op in enumerate(ops) if op.startswith("global_atomic_swap_x2"))
    assert ops[swap - 1] == "buffer_wbl2 sc0 sc1" and ops[swap].endswith("sc1"), ops
    # acquire: the poll's load bypasses the caches (sc0 sc1), then invalidates at system scope
    polls = [i for i, op in enumerate(ops) if op.startswith("global_load_dwordx2")
             and op.endswith("sc0 sc1")]
    assert polls and all(ops[i + 1] == "buffer_inv sc0 sc1" for i in polls), ops
