"""Every Triton kernel the package launches compiles for NVIDIA sm_90 and AMD gfx942 (MI300X)
and gfx950 (MI355X) on this CPU-only machine (Triton cross-compiles; the targets are
``kernel_registry.TARGETS``) at the warps and stages its launch uses, and none is missing from
the registry."""
import importlib
import pkgutil

import pytest
import triton

import portable_overlap
from portable_overlap.kernel_registry import (NEEDS_SHMEM_LIBRARY, TARGETS, all_specs,
                                              compile_spec, launch_options)

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


def _dtype_of(signature: dict) -> str:
    """The element type of a spec's first typed tensor argument (bf16, fp16 or fp32)."""
    return next(t[1:] for t in signature.values() if t in ("*bf16", "*fp16", "*fp32"))


def _gemm_picks():
    """Per GEMM kernel, the configs its planner picks (``tile_config`` on 32- and 64-lane
    warps, per dtype; the experts' over descriptors or not, prefill or decode, and their decode
    variants; the combine's decode tile), keyed by dtype."""
    from types import SimpleNamespace

    import torch

    from portable_overlap.ops.allgather_gemm.kernel import allgather_gemm_kernel
    from portable_overlap.ops.gemm_alltoall.kernel import gemm_alltoall_kernel
    from portable_overlap.ops.gemm_signal.kernel import gemm_signal_kernel
    from portable_overlap.ops.matmul.api import tile_config as matmul_tile
    from portable_overlap.ops.matmul.kernel import persistent_matmul_kernel
    from portable_overlap.ops.matmul_reduce.kernel import matmul_reduce_stores_kernel
    from portable_overlap.ops.moe_combine.api import decode_tile
    from portable_overlap.ops.moe_combine.kernel import moe_gemm_scatter_kernel
    from portable_overlap.ops.moe_dispatch.swiglu_kernel import dispatch_swiglu_kernel
    from portable_overlap.ops.moe_experts.api import HEAVY_TILE, LIGHT_TILE
    from portable_overlap.ops.moe_experts.api import tile_config as experts_tile
    from portable_overlap.ops.moe_experts.kernel import expert_swiglu_kernel
    from portable_overlap.ops.moe_layer.kernel import moe_layer_kernel

    devices = [SimpleNamespace(warp_size=w, shared_per_program=227 * 1024, sm_count=132)
               for w in (32, 64)]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    # the full tile, and the tiles of products too small for it (with descriptors or not)
    core = {dt: [matmul_tile(t, f, M, N, desc) for f in devices
                 for M, N in ((None, None), (256, 8192), (128, 1024))
                 for desc in (True, False)] for dt, t in dtypes.items()}
    experts = {dt: [experts_tile(t, f, desc, rows) for f in devices
                    for desc in (True, False) for rows in (float("inf"), 32)]
               + [LIGHT_TILE, HEAVY_TILE] for dt, t in dtypes.items()}
    combine = {dt: core[dt] + [decode_tile(t, f) for f in devices] for dt, t in dtypes.items()}
    picks = {k: core for k in (persistent_matmul_kernel, gemm_signal_kernel, gemm_alltoall_kernel,
                               matmul_reduce_stores_kernel, allgather_gemm_kernel)}
    picks.update({k: experts for k in (expert_swiglu_kernel, dispatch_swiglu_kernel,
                                       moe_layer_kernel)})
    picks[moe_gemm_scatter_kernel] = combine
    return picks


def test_gemm_specs_compile_at_their_tiles_launch_options():
    """Each GEMM kernel's spec holds the warps and stages of the config its planner picks for
    that tile (``tile_config``), and the loop's stages (``NUM_STAGES``) equal the launch's, so a
    change of a planner's config that the specs do not follow fails here."""
    picks, seen, bad = _gemm_picks(), 0, []
    for name, fn, signature, consts, _ in SPECS:
        if fn not in picks:
            continue
        seen += 1
        tile = (consts["BLOCK_M"], consts["BLOCK_N"], consts["BLOCK_K"])
        configs = {(c.num_warps, c.num_stages) for c in picks[fn][_dtype_of(signature)]
                   if (c.block_m, c.block_n, c.block_k) == tile}
        options = launch_options(consts)
        got = (options.get("num_warps"), options.get("num_stages"))
        if got not in configs or consts["NUM_STAGES"] != got[1]:
            bad.append((name, tile, got, sorted(configs)))
    assert seen == 59, seen
    assert not bad, f"(spec, tile, its warps and stages, the planners' for that tile): {bad}"


def test_small_kernel_specs_compile_at_their_launch_options():
    """The GEMV's 16-bit specs at the heuristic's widest band (``pick_config``), the combine's
    weighted sum at ``CombineConfig``'s warps."""
    import torch

    from portable_overlap.ops.gemv_allreduce.config import pick_config
    from portable_overlap.ops.moe_combine.api import CombineConfig

    for name, fn, signature, consts, _ in SPECS:
        options = launch_options(consts)
        if name.startswith("gemv_allreduce[") and _dtype_of(signature) != "fp32":
            cfg = pick_config(1, 64 * 132 * 2, 7168, torch.bfloat16, "sm_90", 132, 2)
            assert (consts["BLOCK_N"], consts["BLOCK_K"], consts["NUM_STAGES"]) == \
                (cfg.block_n, cfg.block_k, cfg.num_stages), name
            assert options == {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, name
        elif name.startswith("moe_combine["):
            assert options == {"num_warps": CombineConfig().num_warps, "num_stages": 1}, name
