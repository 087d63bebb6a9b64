"""Compile signatures of the copy-engine transport's one-program flag kernels, at their launches'
options: one warp and one stage (``copy_engine``; the context's waits, ``ops.context``), the
refusal over 4 warps with one stage (``ops.context``)."""
from .flag_kernels import (counter_wait_kernel, epoch_kernel, landed_kernel, refuse_kernel,
                           signal_kernel, wait_kernel)


def specs():
    one = dict(num_warps=1, num_stages=1)
    yield "ce_epoch", epoch_kernel, {"ctl_ptr": "*i64"}, dict(one), []
    yield ("ce_signal", signal_kernel,
           {"flag_ptr": "*i64", "bases_ptr": "*i64", "rank": "i32", "peer": "i32",
            "ctl_ptr": "*i64", "back": "i32", "tag": "i32", "clock_ptr": "*i64",
            "status_addr": "i64"}, dict(one), [])
    yield ("ce_landed", landed_kernel,
           {"flags_ptr": "*i64", "n": "i32", "ctl_ptr": "*i64", "tag": "i32", "clock_ptr": "*i64",
            "status_addr": "i64", "BLOCK": "constexpr"}, {"BLOCK": 128, **one}, [])
    for check in (True, False):
        yield (f"ce_wait[{check}]", wait_kernel,
               {"flag_ptr": "*i64", "peer": "i32", "ctl_ptr": "*i64", "back": "i32", "tag": "i32",
                "clock_ptr": "*i64", "timeout_us": "i32", "status_addr": "i64", "slot": "i32",
                "what": "i64", "CHECK_TAG": "constexpr"}, {"CHECK_TAG": check, **one}, [])
    yield ("counter_wait", counter_wait_kernel,
           {"ctl_ptr": "*i64", "bases_ptr": "*i64", "rank": "i32", "peer": "i32",
            "clock_ptr": "*i64", "timeout_us": "i32", "status_addr": "i64", "slot": "i32",
            "what": "i64"}, dict(one), [])
    for advance, free in ((True, False), (False, False), (False, True)):
        yield (f"refuse[advance={advance},free={free}]", refuse_kernel,
               {"ctl_ptr": "*i64", "flags_ptr": "*i64", "n_slots": "i32", "bases_ptr": "*i64",
                "rank": "i32", "world": "i32", "status_addr": "i64", "clock_ptr": "*i64",
                "clean": "i32", "ADVANCE": "constexpr", "FREE": "constexpr",
                "BLOCK": "constexpr"},
               {"ADVANCE": advance, "FREE": free, "BLOCK": 1024, "num_warps": 4, "num_stages": 1},
               [])
