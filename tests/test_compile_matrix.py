"""Every Triton kernel the package launches compiles for NVIDIA sm_90 and AMD gfx942 (MI300X)
and gfx950 (MI355X) on this CPU-only machine (Triton cross-compiles; the targets are
``kernel_registry.TARGETS``), and none is missing from the registry."""
import importlib
import pkgutil

import pytest
import triton

import portable_overlap
from portable_overlap.kernel_registry import (NEEDS_SHMEM_LIBRARY, TARGETS, all_specs,
                                              compile_spec)

SPECS = list(all_specs())


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("spec", SPECS, ids=[s[0] for s in SPECS])
def test_kernel_compiles(spec, target):
    name, fn, signature, constexprs, aligned = spec
    compiled = compile_spec(fn, signature, constexprs, aligned, target)
    binary = "cubin" if target[0] == "cuda" else "hsaco"
    assert compiled.asm.get(binary), f"{name}: no {binary} for {target}"


def test_every_kernel_is_in_the_registry():
    launched = set()
    for mod in pkgutil.walk_packages(portable_overlap.__path__, "portable_overlap."):
        if mod.name.startswith("portable_overlap.testing"):
            continue
        m = importlib.import_module(mod.name)
        for attr, obj in vars(m).items():
            if attr.endswith("_kernel") and isinstance(obj, triton.runtime.JITFunction):
                launched.add(obj)
    registered = {s[1] for s in SPECS}
    missing = [k.__name__ for k in launched - registered
               if k.__name__ not in NEEDS_SHMEM_LIBRARY]
    assert not missing, f"kernels without a compile spec: {missing}"
    assert launched, "found no kernels at all"


@pytest.mark.parametrize("target", [t for t in TARGETS if t[0] == "hip"],
                         ids=lambda t: f"gate-{t[0]}-{t[1]}")
def test_kernel_gate_wait_is_bounded_on_amd(target):
    """The kernel gate's wait (backends/gate_kernels.py) reads the constant real-time counter
    and traps at its deadline (the device_assert survives: the kernel is compiled with
    debug)."""
    from portable_overlap.backends.gate_kernels import gate_wait_kernel

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = gate_wait_kernel
    sig = {"address": "i64", "value": "i32", "budget_ns": "i64"}
    asm = triton.compile(ASTSource(fn, sig, {}), target=GPUTarget(*target),
                         options={"num_warps": 1, "debug": fn.debug}).asm["amdgcn"]
    assert "s_memrealtime" in asm and "s_trap" in asm
    assert compile_spec(fn, sig, {}, [], target).asm.get("hsaco")
