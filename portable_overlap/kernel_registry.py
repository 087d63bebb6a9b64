"""Every Triton kernel the package launches, with representative compile signatures.

The compile matrix test compiles each entry for every target in ``TARGETS`` (CUDA sm_90, ROCm
gfx942 and gfx950) on a CPU-only machine at the options its launch uses (warps and pipeline
stages: register spills and the LDS a program takes depend on them), and checks that no
``*_kernel`` in the package is missing.

A spec is ``(name, jit function, signature, constexprs, aligned argument names)``. Its constexprs
may hold ``num_warps`` and ``num_stages`` (``LAUNCH_OPTIONS``), as the library's own launch dicts
do; they are compile options, not arguments. One that is absent means Triton's default for the
target, which is what a launch that does not pass it gets (Triton 3.6: 4 warps; 3 stages on CUDA,
2 on ROCm). Where an option differs between the vendors' launches, a spec holds the value of the
launch whose tile it describes, else the CUDA launch's (its module says which)."""
from __future__ import annotations

from typing import Optional

#: NVIDIA H100 / H200, AMD MI300X (CDNA3), AMD MI355X (CDNA4)
TARGETS = (("cuda", 90, 32), ("hip", "gfx942", 64), ("hip", "gfx950", 64))

#: kernels that call a vendor's SHMEM device library: linked by the library's launcher on GPUs,
#: not compilable here (their body is shared with a registered kernel that is)
NEEDS_SHMEM_LIBRARY = {"moe_gemm_put_kernel": "moe_gemm_scatter_kernel",
                       "embedding_alltoall_put_kernel": "embedding_alltoall_kernel",
                       "dispatch_put_kernel": "dispatch_scatter_kernel"}


#: constexpr keys of a spec that are its launch's compile options (``compile_spec``)
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def launch_options(constexprs: dict) -> dict:
    """The compile options a spec's constexprs carry (``LAUNCH_OPTIONS``): those of its launch."""
    return {k: constexprs[k] for k in LAUNCH_OPTIONS if k in constexprs}


def compile_spec(fn, signature: dict, constexprs: dict, aligned, target,
                 num_warps: Optional[int] = None, num_stages: Optional[int] = None):
    """Compile one spec for ``target`` (backend, arch, warp size) without a GPU, at its launch's
    options: ``num_warps`` / ``num_stages`` where given, else the spec's (``launch_options``),
    else Triton's defaults for the target, as at a launch that passes none. ``aligned`` names
    the arguments the JIT would mark divisible by 16 at run time."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = launch_options(constexprs)
    options.update({k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
                    if v is not None})
    consts = {k: v for k, v in constexprs.items() if k not in LAUNCH_OPTIONS}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget(*target), options=options)


#: kernel lists of building blocks outside the op table (the persistent GEMM core, the
#: experts' gated grouped GEMM, the one-launch MoE layer, the backends' kernel gate, the public
#: device API)
SHARED_SPECS = ("portable_overlap.ops.matmul.compile_specs",
                "portable_overlap.ops.moe_experts.compile_specs",
                "portable_overlap.ops.moe_layer.compile_specs",
                "portable_overlap.backends.compile_specs",
                "portable_overlap.language.compile_specs")


def spec_modules() -> list:
    """The modules whose ``specs()`` list the package's kernels: each op's (from the op table,
    ``ops.registry.SPECS``) and the shared building blocks', each once."""
    import portable_overlap  # noqa: F401  (defines every op)
    from .ops.registry import SPECS

    names = list(SHARED_SPECS)
    for spec in SPECS.values():
        names += [m for m in spec.compile_specs if m not in names]
    return names


def all_specs():
    """(name, jit function, signature, constexprs, aligned argument names) of every kernel, the
    constexprs with the launch's options where the spec gives them (``LAUNCH_OPTIONS``)."""
    import importlib

    for name in spec_modules():
        yield from importlib.import_module(name).specs()
