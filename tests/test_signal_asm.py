"""The signal / wait helpers of shmem/device.py (and the public device API built on them), and
the copy-engine kernel gate's wait and write (backends/gate_kernels.py), compile to
system-scope release and acquire on
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
    # the kernel's own function: a helper not inlined (the deadline's entry) is a function of
    # its own, named by its module path (dots, which the kernel's name has none of)
    asm = next(c for c in k.asm["amdgcn"].split(".Lfunc_end")
               if re.search(r"^[A-Za-z_]\w*:\s*; @", c, re.M))
    ops = [line.strip() for line in asm.splitlines()
           if re.match(r"\s*(global_|buffer_)", line)]
    # release: write back L2 at system scope, then the swap at system scope
    swap = next(i for i, op in enumerate(ops) if op.startswith("global_atomic_swap_x2"))
    assert ops[swap - 1] == "buffer_wbl2 sc0 sc1" and ops[swap].endswith("sc1"), ops
    # acquire: the poll's load bypasses the caches (sc0 sc1), then invalidates at system scope
    polls = [i for i, op in enumerate(ops) if op.startswith("global_load_dwordx2")
             and op.endswith("sc0 sc1")]
    assert polls and all(ops[i + 1] == "buffer_inv sc0 sc1" for i in polls), ops


def _gate(kind: str, target):
    """The kernel gate's ``kind`` ("wait" / "write") kernel compiled for ``target`` as it is
    launched (one warp; the wait with ``debug``, which keeps its deadline trap)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from portable_overlap.backends.gate_kernels import gate_wait_kernel, gate_write_kernel

    fn, sig = {"wait": (gate_wait_kernel, {"address": "i64", "value": "i32", "budget_ns": "i64"}),
               "write": (gate_write_kernel, {"address": "i64", "value": "i32"})}[kind]
    return triton.compile(ASTSource(fn, sig, {}), target=GPUTarget(*target),
                          options={"num_warps": 1, "debug": fn.debug})


@pytest.mark.parametrize("kind", ["wait", "write"])
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_gate_wait_is_a_system_acquire_and_the_write_a_system_release(target, kind):
    """The copy-engine gate's kernels (the stream wait and write where the runtime's cannot
    serve): every read of the 32-bit word in the wait, the first and the loop's, is a
    system-scope acquire; the write is a system-scope release (L2 written back first on
    gfx942 / gfx950), so the stream's later copies see what the producer stored before it."""
    k = _gate(kind, target)
    if target[0] == "cuda":
        ptx = k.asm["ptx"]
        if kind == "wait":
            assert len(re.findall(r"ld\.global\.sys\.acquire\.b32", ptx)) >= 2, ptx
            assert not re.search(r"ld\.global(?!\.sys\.acquire)", ptx), ptx
        else:
            assert re.search(r"atom\.global\.sys\.release\.exch\.b32", ptx), ptx
        return
    # the kernel's own body: with debug the assert's printf helpers come first in the assembly
    asm = k.asm["amdgcn"]
    asm = asm[asm.index(f"\n{k.metadata.name}:"):]
    ops = [line.strip() for line in asm[:asm.index(".Lfunc_end")].splitlines()
           if re.match(r"\s*(global_|buffer_|flat_)", line)]
    if kind == "wait":
        polls = [i for i, op in enumerate(ops) if op.startswith("global_load_dword ")]
        assert len(polls) >= 2, ops
        assert all(ops[i].endswith("sc0 sc1") and ops[i + 1] == "buffer_inv sc0 sc1"
                   for i in polls), ops
    else:
        swap = next(i for i, op in enumerate(ops) if op.startswith("global_atomic_swap "))
        assert ops[swap - 1] == "buffer_wbl2 sc0 sc1" and ops[swap].endswith("sc1"), ops
