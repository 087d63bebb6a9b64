"""The configs the planners pick for a device fit that device: compiled on this CPU machine for
each target of ``kernel_registry.TARGETS`` with the launch options the op would use, over the
benchmark shapes and others, each program's shared memory (LDS on AMD) is within the target's
limit. (The plain compile matrix compiles one representative config per kernel and would not
see a config that only the planner picks, e.g. for the 304 compute units of gfx942.)"""
import pytest
import torch

from portable_overlap.kernel_registry import TARGETS, compile_spec
from portable_overlap.ops.gemv_allreduce.compile_specs import _PTRS, _SCALARS
from portable_overlap.ops.gemv_allreduce.config import pick_config
from portable_overlap.ops.gemv_allreduce.kernel import gemv_allreduce_kernel

#: per target: (arch name the planners key on, SMs / CUs, shared memory one program may take):
#: H100/H200 227 KiB opt-in per block, MI300X 64 KiB LDS, MI355X 160 KiB LDS
DEVICES = {("cuda", 90, 32): ("sm_90", 132, 227 * 1024),
           ("hip", "gfx942", 64): ("gfx942", 304, 64 * 1024),
           ("hip", "gfx950", 64): ("gfx950", 256, 160 * 1024)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: decode batch sizes x output widths (Llama / Mixtral / DeepSeek qkv, o, MLP), K per rank
GEMV_SHAPES = [(m, n, 7168) for m in (1, 8, 33, 64) for n in (4096, 8192, 14336, 28672, 53248)]


def _gemv_compile(target, dt: str, m: int, cfg):
    sig = {k: v.format(dt=dt) for k, v in _PTRS.items()}
    sig.update(dict(kv.split(":") for kv in _SCALARS.split()))
    consts = dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN_K=True, EVEN_N=True,
                  PRECISION="ieee", UPCAST=False, G_MAX=1024)
    sig.update({k: "constexpr" for k in consts})
    return compile_spec(gemv_allreduce_kernel, sig, consts, [*_PTRS, "K", "stride_xm",
                                                              "stride_wn"], target,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_gemv_configs_fit_the_device(target):
    arch, units, limit = DEVICES[target]
    seen, over = set(), []
    for m, n, k in GEMV_SHAPES:
        for dt, dtype in DTYPES.items():
            cfg = pick_config(m, n, k, dtype, arch, units, 2, limit)
            key = (dt, max(16, 1 << (m - 1).bit_length()), cfg)
            if key in seen:
                continue
            seen.add(key)
            shared = _gemv_compile(target, dt, m, cfg).metadata.shared
            if shared > limit:
                over.append((dt, m, n, cfg, shared))
    assert seen and not over, f"configs over {limit} bytes of shared memory on {arch}: {over}"


@pytest.mark.parametrize("target", [("hip", "gfx942", 64)], ids=["hip-gfx942"])
def test_the_lds_limit_is_what_changes_the_gemv_config(target):
    """fp32 at M = 64 on gfx942: the heuristic's 4 stages compile to 72 KiB, over the 64 KiB of
    LDS a workgroup has; under the limit the planner drops a stage (48 KiB)."""
    free = pick_config(64, 4096, 7168, torch.float32, "gfx942", 304, 2)
    fit = pick_config(64, 4096, 7168, torch.float32, "gfx942", 304, 2, 64 * 1024)
    assert fit.num_stages < free.num_stages
    assert _gemv_compile(target, "fp32", 64, free).metadata.shared > 64 * 1024
    assert _gemv_compile(target, "fp32", 64, fit).metadata.shared <= 64 * 1024
