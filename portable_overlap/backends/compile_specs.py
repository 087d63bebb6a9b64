"""Representative compile signatures of the backends' own kernels (the kernel gate and the reset
of separate gate words) for the compile matrix. Their scalar arguments are never specialized
(``gate_kernels``), so one signature is the binary every launch runs. One warp, as launched;
Triton's default stages (the launches pass none)."""
from .gate_kernels import ZERO_BLOCK, gate_wait_kernel, gate_write_kernel, gate_zero_kernel


def specs():
    one = {"num_warps": 1}
    yield ("gate_wait", gate_wait_kernel, {"address": "i64", "value": "i32", "budget_ns": "i64"},
           one, [])
    yield "gate_write", gate_write_kernel, {"address": "i64", "value": "i32"}, one, []
    yield ("gate_zero", gate_zero_kernel, {"table_ptr": "*i64", "n": "i32", "BLOCK": "constexpr"},
           {"BLOCK": ZERO_BLOCK, **one}, ["table_ptr"])
