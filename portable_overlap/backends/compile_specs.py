"""Representative compile signatures of the backends' own kernels (the kernel gate) for the
compile matrix. Their arguments are never specialized (``gate_kernels``), so one signature is
the binary every launch runs."""
from .gate_kernels import gate_wait_kernel, gate_write_kernel


def specs():
    yield ("gate_wait", gate_wait_kernel, {"address": "i64", "value": "i32", "budget_ns": "i64"},
           {}, [])
    yield "gate_write", gate_write_kernel, {"address": "i64", "value": "i32"}, {}, []
