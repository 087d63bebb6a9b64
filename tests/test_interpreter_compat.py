"""The CPU backend runs kernels in Triton's interpreter with any numpy the user has.

numpy >= 2.4 refuses ``int()`` of a 1-element array, which the interpreter of Triton 3.6 uses for
``range`` bounds; numpy < 2.4 only warns (DeprecationWarning). Turning that one warning into an
error makes the numpy of the test environment behave like the newest one."""
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import warnings

    import torch
    import triton
    import triton.language as tl

    from portable_overlap.backends import get_backend

    get_backend("cpu")  # what every emulated rank does before its first launch

    # what numpy >= 2.4 does, on any numpy (it deprecated the conversion in 1.25)
    warnings.filterwarnings("error", message="Conversion of an array with ndim > 0",
                            category=DeprecationWarning)

    @triton.jit
    def sum_rows(x_ptr, out_ptr, n_rows, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, n_rows):  # a runtime loop bound: a scalar turned into a Python int
            acc += tl.load(x_ptr + (pid * n_rows + i) * BLOCK + offs)
        for j in range(pid, pid + 1):  # a bound from program_id
            tl.store(out_ptr + j * BLOCK + offs, acc)

    x = torch.arange(2 * 5 * 8, dtype=torch.float32).reshape(2, 5, 8)
    out = torch.empty(2, 8)
    sum_rows[(2,)](x, out, 5, BLOCK=8)
    assert torch.equal(out, x.sum(1)), (out, x.sum(1))
    print("ok")
""")


def test_interpreter_loops_with_strict_numpy():
    """A kernel whose loops have runtime bounds runs on the CPU backend even when numpy refuses
    to convert 1-element arrays to ints (numpy >= 2.4)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PORTABLE_OVERLAP_BACKEND="cpu",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
