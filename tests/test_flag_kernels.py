"""The kernels read the host status board past every cache on both vendors (compiled code):
the copy-engine signal kernel its header word, ``report_first`` a program's slot; and the reads
run under the interpreter."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import triton

from portable_overlap.kernel_registry import TARGETS, compile_spec
from portable_overlap.shmem.device import report_first
from portable_overlap.transports.compile_specs import specs


@triton.jit
def _report_once(status_addr, pid, code):
    report_first(status_addr, pid, code, -1, 3, 4)


def _signal_kernel(target):
    name, fn, sig, consts, aligned = next(s for s in specs() if s[0] == "ce_signal")
    return compile_spec(fn, sig, consts, aligned, target)


def _reads_past_the_caches(k, target) -> None:
    """The kernel's system-scope read: on gfx942 / gfx950 a load with both scope bits (``sc0
    sc1``: system scope, no cache hit) followed by a system-scope invalidate; on sm_90 an
    acquire load at system scope, no ``ld.volatile``."""
    if target[0] == "hip":
        asm = k.asm["amdgcn"].split(".Lfunc_end")[0]
        loads = re.findall(r"global_load_dwordx2 [^\n]*", asm)
        assert [ld for ld in loads if ld.rstrip().endswith("sc0 sc1")], asm
        assert "buffer_inv sc0 sc1" in asm
    else:
        ptx = k.asm["ptx"]
        assert re.search(r"ld\.global\.sys\.acquire\.b64", ptx), ptx
        assert "ld.volatile" not in ptx


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_the_status_read_bypasses_the_caches(target):
    """The signal kernel's only system-scope read is the status board's header word;
    ``tl.load(volatile=True)`` compiled to a plain ``global_load`` on AMD (Triton's AMD
    backend drops ``volatile``)."""
    _reads_past_the_caches(_signal_kernel(target), target)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_a_report_reads_its_slot_past_the_caches(target):
    """``report_first`` keeps an earlier report of the call: it reads the program's slot
    before writing. On AMD a ``volatile`` load there compiled to a cached scalar load, which
    may read a stale word after the host cleared the board (the cause lost, or a report
    dropped): it must be the same system-scope acquire read as the header's."""
    _reads_past_the_caches(compile_spec(_report_once, {"status_addr": "i64", "pid": "i32",
                                                       "code": "i64"}, {}, [], target), target)


_SCRIPT = textwrap.dedent("""
    import torch

    from portable_overlap.backends import get_backend
    from portable_overlap.transports.flag_kernels import signal_kernel
    from tests.test_flag_kernels import _report_once

    get_backend("cpu")
    for header in (0, 1):
        status = torch.zeros(8, dtype=torch.int64)
        status[0] = header  # a kernel of this rank gave up: the header word went to 1
        flag = torch.zeros(1, dtype=torch.int64)
        bases = torch.tensor([flag.data_ptr()], dtype=torch.int64)  # one rank: its own heap
        ctl = torch.tensor([5 << 20], dtype=torch.int64)  # the call's epoch (CALL_SHIFT up)
        clock = torch.zeros(2, dtype=torch.int64)  # no wait timed out
        signal_kernel[(1,)](flag, bases, 0, 0, ctl, 0, 7, clock, status.data_ptr())
        tag, epoch = int(flag[0]) >> 32, int(flag[0]) & 0xFFFFFFFF
        assert epoch == 5 and tag == (0x7FFFFFFF if header else 7), (header, tag, epoch)

    # report_first: a slot that holds a report keeps it, an empty one takes the new one
    for held in (0, 9):
        board = torch.zeros(12, dtype=torch.int64)
        board[8] = held  # program 1's slot: words 8..11
        _report_once[(1,)](board.data_ptr(), 1, 6)
        assert board[8:12].tolist() == ([9, 0, 0, 0] if held else [6, -1, 3, 4]), board
    print("ok")
""")


def test_the_status_read_runs_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (imports tests.)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
