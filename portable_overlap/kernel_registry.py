"""Every Triton kernel the package launches, with representative compile signatures.

The compile matrix test compiles each entry for every target in ``TARGETS`` (CUDA sm_90 and
ROCm gfx942) on a CPU-only machine, and checks that no ``*_kernel`` in the package is missing."""
from __future__ import annotations

TARGETS = (("cuda", 90, 32), ("hip", "gfx942", 64))

#: kernels that call a vendor's SHMEM device library: linked by the library's launcher on GPUs,
#: not compilable here (their body is shared with a registered kernel that is)
NEEDS_SHMEM_LIBRARY = {"moe_gemm_put_kernel": "moe_gemm_scatter_kernel",
                       "embedding_alltoall_put_kernel": "embedding_alltoall_kernel"}


def compile_spec(fn, signature: dict, constexprs: dict, aligned, target):
    """Compile one spec for ``target`` (backend, arch, warp size) without a GPU; ``aligned``
    names the arguments the JIT would mark divisible by 16 at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature, constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget(*target), options={"num_warps": 4, "num_stages": 4})


def all_specs():
    """(name, jit function, signature, constexprs, aligned argument names) of every kernel."""
    from .ops.gemv_allreduce.compile_specs import specs as gemv_allreduce_specs
    from .ops.gemm_alltoall.compile_specs import specs as gemm_alltoall_specs
    from .ops.gemm_signal.compile_specs import specs as gemm_signal_specs
    from .ops.matmul.compile_specs import specs as matmul_specs
    from .ops.moe_combine.compile_specs import specs as moe_combine_specs
    from .transports.compile_specs import specs as transport_specs
    from .ops.embedding_alltoall.compile_specs import specs as embedding_alltoall_specs

    yield from gemv_allreduce_specs()
    yield from matmul_specs()
    yield from gemm_alltoall_specs()
    yield from moe_combine_specs()
    yield from transport_specs()
    yield from gemm_signal_specs()
    yield from embedding_alltoall_specs()
