"""The configs the planners pick for a device fit that device: compiled on this CPU machine for
each target of ``kernel_registry.TARGETS`` with the launch options the op would use, over the
benchmark shapes and others, each program's shared memory (LDS on AMD) is within the target's
limit. (The plain compile matrix compiles one representative config per kernel and would not
see a config that only the planner picks, e.g. for the 304 compute units of gfx942.) The GEMV
configs and the GEMM ops' tiles (the fused kernels' too) are also checked for register spills:
VGPRs sent to scratch on gfx942 / gfx950 (``.vgpr_spill_count``), spill stores to local memory
on sm_90 (ptxas's report)."""
import contextlib
import re

import pytest
import torch

from portable_overlap.backends.base import DeviceFacts
from portable_overlap.kernel_registry import TARGETS, compile_spec
from portable_overlap.ops.gemv_allreduce.compile_specs import _PTRS, _SCALARS
from portable_overlap.ops.gemv_allreduce.config import pick_config
from portable_overlap.ops.gemv_allreduce.kernel import gemv_allreduce_kernel
from portable_overlap.ops.matmul.api import MatmulConfig
from portable_overlap.ops.matmul.api import tile_config as matmul_tile
from portable_overlap.ops.moe_experts.api import HEAVY_TILE, LIGHT_TILE
from portable_overlap.ops.moe_experts.api import tile_config as experts_tile

#: per target: (arch name the planners key on, SMs / CUs, shared memory one program may take):
#: H100/H200 227 KiB opt-in per block, MI300X 64 KiB LDS, MI355X 160 KiB LDS
DEVICES = {("cuda", 90, 32): ("sm_90", 132, 227 * 1024),
           ("hip", "gfx942", 64): ("gfx942", 304, 64 * 1024),
           ("hip", "gfx950", 64): ("gfx950", 256, 160 * 1024)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: decode batch sizes x output widths (Llama / Mixtral / DeepSeek qkv, o, MLP), K per rank
GEMV_SHAPES = [(m, n, 7168) for m in (1, 8, 33, 64) for n in (4096, 8192, 14336, 28672, 53248)]
#: the GEMV benchmark's shapes at 2 ranks (benchmarks/bench_gemv_allreduce.py: K 28672 and 53248
#: in all, 14336 and 26624 per rank), which hit the sm_90 entries of gemv_allreduce.config.TUNED
#: (16-bit dtypes), and N 16384 at K 14336 per rank
GEMV_SHAPES += [(1, 8192, 14336), (8, 8192, 14336), (32, 8192, 14336), (1, 16384, 26624),
                (1, 16384, 14336)]


def _gemv_compile(target, dt: str, m: int, cfg, one_shot: bool = False):
    sig = {k: v.format(dt=dt) for k, v in _PTRS.items()}
    sig.update(dict(kv.split(":") for kv in _SCALARS.split()))
    consts = dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, EVEN_K=True, EVEN_N=True,
                  PRECISION="ieee", UPCAST=False, G_MAX=1024, ONE_SHOT=one_shot,
                  SPLIT_K=cfg.split_k)
    sig.update({k: "constexpr" for k in consts})
    return compile_spec(gemv_allreduce_kernel, sig, consts,
                        [*_PTRS, "K", "stride_xm", "stride_wn"], target,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@contextlib.contextmanager
def _ptxas_reports():
    """sm_90 compiles print ptxas -v's report (to stdout; a cached kernel would skip ptxas)."""
    import triton

    old = triton.knobs.nvidia.dump_ptxas_log, triton.knobs.compilation.always_compile
    triton.knobs.nvidia.dump_ptxas_log = triton.knobs.compilation.always_compile = True
    try:
        yield
    finally:
        triton.knobs.nvidia.dump_ptxas_log, triton.knobs.compilation.always_compile = old


def _spill_stores(log: str) -> int:
    """Bytes of spill stores to local memory in ptxas's report ``log`` (the most of any
    function)."""
    counts = re.findall(r"(\d+) bytes spill stores", log)
    assert counts, f"no ptxas report in {log[-300:]!r}"
    return max(int(c) for c in counts)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_gemv_configs_fit_the_device(target, capfd):
    """Each config ``pick_config`` returns over ``GEMV_SHAPES`` and three dtypes compiles within
    the target's shared memory (LDS) and without register spills (``.vgpr_spill_count`` on AMD,
    ptxas's spill stores on sm_90)."""
    arch, units, limit = DEVICES[target]
    seen, over = set(), []
    with _ptxas_reports() if target[0] == "cuda" else contextlib.nullcontext():
        for m, n, k in GEMV_SHAPES:
            for dt, dtype in DTYPES.items():
                cfg = pick_config(m, n, k, dtype, arch, units, 2, limit)
                key = (dt, max(16, 1 << (m - 1).bit_length()), cfg)
                if key in seen:
                    continue
                seen.add(key)
                capfd.readouterr()
                compiled = _gemv_compile(target, dt, m, cfg)
                spills = (_spill_stores(capfd.readouterr().out) if target[0] == "cuda"
                          else _vgpr_spills(compiled))
                shared = compiled.metadata.shared
                if shared > limit or spills:
                    over.append((dt, m, n, cfg, shared, spills))
    assert seen and not over, f"configs over {limit} bytes of shared memory or spilling on " \
                              f"{arch} (dtype, M, N, config, shared, spills): {over}"


#: narrow decode shapes (fewer 16-column blocks than SMs), where the one-shot form splits K
GEMV_NARROW = [(m, n) for m in (1, 8, 32) for n in (1024, 1536)]


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_gemv_k_split_configs_fit_the_device(target, capfd):
    """The one-shot form's K-split configs (``pick_config`` with a partial slot of 64 x N)
    compile within the target's shared memory and without register spills, as above."""
    arch, units, limit = DEVICES[target]
    seen, over = set(), []
    with _ptxas_reports() if target[0] == "cuda" else contextlib.nullcontext():
        for m, n in GEMV_NARROW:
            cfg = pick_config(m, n, 7168, torch.bfloat16, arch, units, 2, limit, 64 * n)
            key = (max(16, 1 << (m - 1).bit_length()), cfg)
            if cfg.split_k == 1 or key in seen:
                continue
            seen.add(key)
            capfd.readouterr()
            compiled = _gemv_compile(target, "bf16", m, cfg, one_shot=True)
            spills = (_spill_stores(capfd.readouterr().out) if target[0] == "cuda"
                      else _vgpr_spills(compiled))
            if compiled.metadata.shared > limit or spills:
                over.append((m, n, cfg, compiled.metadata.shared, spills))
    assert seen and not over, f"split configs over {limit} bytes or spilling on {arch}: {over}"


def test_gemv_pick_ignores_the_k_shard():
    """Ranks of one call may pass K shards of different lengths (an uneven split); the config
    sets the column blocks and the grid that the flags' tag carries, so every shard must get
    the same one, at tuned shapes (``TUNED``) as elsewhere."""
    for arch, units, limit in DEVICES.values():
        for m, n, _ in GEMV_SHAPES:
            for dtype in DTYPES.values():
                picks = {pick_config(m, n, k, dtype, arch, units, 2, limit)
                         for k in (1, 96, 4096, 7168, 14336, 26624, 53248)}
                assert len(picks) == 1, (arch, m, n, dtype, picks)
    tuned = pick_config(1, 8192, 14336, torch.bfloat16, "sm_90", 132, 2)
    assert pick_config(1, 8192, 14335, torch.bfloat16, "sm_90", 132, 2) == tuned


@pytest.mark.parametrize("target", [("hip", "gfx942", 64)], ids=["hip-gfx942"])
def test_the_lds_limit_is_what_changes_the_gemv_config(target):
    """fp32 at M = 64 on gfx942: the heuristic's 4 stages compile to 72 KiB, over the 64 KiB of
    LDS a workgroup has; under the limit the planner drops a stage (48 KiB)."""
    free = pick_config(64, 4096, 7168, torch.float32, "gfx942", 304, 2)
    fit = pick_config(64, 4096, 7168, torch.float32, "gfx942", 304, 2, 64 * 1024)
    assert fit.num_stages < free.num_stages
    assert _gemv_compile(target, "fp32", 64, free).metadata.shared > 64 * 1024
    assert _gemv_compile(target, "fp32", 64, fit).metadata.shared <= 64 * 1024


# -- the GEMM ops' tile picks -------------------------------------------------------------------
#: DeviceFacts the GEMM planners see, as the backends report them (per program: 227 KiB shared
#: on H200, 64 KiB LDS on MI300X, 160 KiB on MI355X)
FACTS = {("cuda", 90, 32): DeviceFacts(
             vendor="nvidia", name="H200", arch="sm_90", sm_count=132, warp_size=32,
             max_shared_bytes_per_sm=228 * 1024, max_regs_per_sm=65536, max_warps_per_sm=64,
             tensor_descriptors=True, register_cap=True,
             max_shared_bytes_per_program=227 * 1024),
         ("hip", "gfx942", 64): DeviceFacts(
             vendor="amd", name="MI300X", arch="gfx942", sm_count=304, warp_size=64,
             max_shared_bytes_per_sm=64 * 1024, max_regs_per_sm=512 * 64 * 4,
             max_warps_per_sm=32, max_shared_bytes_per_program=64 * 1024),
         ("hip", "gfx950", 64): DeviceFacts(
             vendor="amd", name="MI355X", arch="gfx950", sm_count=256, warp_size=64,
             max_shared_bytes_per_sm=160 * 1024, max_regs_per_sm=512 * 64 * 4,
             max_warps_per_sm=32, max_shared_bytes_per_program=160 * 1024)}
#: the GEMM kernels and the module whose specs() has their representative signature
GEMM_KERNELS = {"persistent_matmul": "portable_overlap.ops.matmul.compile_specs",
                "gemm_signal": "portable_overlap.ops.gemm_signal.compile_specs",
                "gemm_alltoall": "portable_overlap.ops.gemm_alltoall.compile_specs",
                "moe_gemm_scatter": "portable_overlap.ops.moe_combine.compile_specs",
                "expert_swiglu": "portable_overlap.ops.moe_experts.compile_specs"}
#: (M, N, K): K a multiple of every K block, and one that is not (the masked K tail)
GEMM_SHAPES = [(8192, 8192, 4096), (4096, 14336, 4000)]


def _pick(kernel: str, dtype, facts, desc: bool):
    if kernel == "expert_swiglu":
        return experts_tile(dtype, facts, desc)
    return matmul_tile(dtype, facts)


def _gemm_spec(kernel: str, dt: str, cfg, even_k: bool, desc: bool):
    """``kernel``'s representative bf16 signature (pointer loads, or descriptors with
    ``desc``) retyped to ``dt`` and retiled to ``cfg``."""
    import importlib

    base = None
    for name, fn, sig, consts, aligned in importlib.import_module(GEMM_KERNELS[kernel]).specs():
        if name.startswith(kernel + "[bf16") and ("descriptors" in name) == desc:
            base = fn, dict(sig), dict(consts), aligned
            break
    assert base, f"no bf16 spec of {kernel}"
    fn, sig, consts, aligned = base
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    for arg, ty in sig.items():
        if ty == "*bf16":
            sig[arg] = f"*{dt}"
        elif ty.startswith("tensordesc"):  # the A operand's [BM, BK] block, B's [BK, BN]
            rows, cols = (bm, bk) if arg in ("a_desc", "x_desc", "p_desc") else (bk, bn)
            sig[arg] = f"tensordesc<{dt}[{rows}, {cols}]>"
    consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
                  NUM_STAGES=cfg.num_stages, EVEN_K=even_k)
    return fn, sig, consts, aligned


def _vgpr_spills(compiled) -> int:
    """``.vgpr_spill_count`` of every kernel in the compiled gfx9 assembly (VGPRs the
    register allocator sent to scratch memory)."""
    counts = re.findall(r"\.vgpr_spill_count:\s+(\d+)", compiled.asm["amdgcn"])
    assert counts, "no .vgpr_spill_count in the assembly"
    return max(int(c) for c in counts)


@pytest.mark.parametrize("target", TARGETS[1:], ids=lambda t: f"{t[0]}-{t[1]}")
def test_gemm_tiles_fit_amd_without_spills(target):
    """The tiles the GEMM ops pick on gfx942 / gfx950 compile without VGPR spills and within
    the LDS of a workgroup, over bf16 / fp16 / fp32 and K with and without a tail. (The H200
    tile, 128 x 256 x 64 over 8 warps, spills 12-67 VGPRs there: ops/matmul/api.py.)"""
    facts = FACTS[target]
    limit = facts.shared_per_program
    seen, bad = set(), []
    for kernel in GEMM_KERNELS:
        for dt, dtype in DTYPES.items():
            cfg = _pick(kernel, dtype, facts, False)
            for M, N, K in GEMM_SHAPES:
                even = K % cfg.block_k == 0
                if (kernel, dt, cfg, even) in seen or (dt != "bf16" and not even):
                    continue  # the masked tail costs the most registers in bf16 already
                seen.add((kernel, dt, cfg, even))
                k = compile_spec(*_gemm_spec(kernel, dt, cfg, even, False), target,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                spills, shared = _vgpr_spills(k), k.metadata.shared
                if spills or shared > limit:
                    bad.append((kernel, dt, even, cfg, spills, shared))
    assert len(seen) == 20, sorted(seen)
    assert not bad, f"spilling or over {limit} bytes of LDS (kernel, dtype, even K, config, " \
                    f"VGPR spills, LDS): {bad}"


def _spec_named(module: str, name: str):
    """The spec called ``name`` in ``module``'s specs(), its signature and constexprs copied."""
    import importlib

    for n, fn, sig, consts, aligned in importlib.import_module(module).specs():
        if n == name:
            return fn, dict(sig), dict(consts), aligned
    raise AssertionError(f"no spec {name} in {module}")


def _fused_picks(facts):
    """The fused kernels that run the GEMM tiles besides ``GEMM_KERNELS``, at the bf16 tiles
    their planners pick on ``facts`` (no tensor descriptors on AMD: the pointer-load specs):
    (label, spec module, spec name, launch tiles, constexprs to set). AllGather + GEMM and
    GEMM + ReduceScatter / AllReduce (``"stores"``) take ``matmul.api.default_config``; the
    fused dispatch + gated GEMM takes the experts' ``default_config``; the one-launch MoE layer
    takes that for its gated GEMM and the combine's tiles (prefill ``default_config``, decode
    ``decode_tile``) for its down GEMM, with the gated GEMM's row height and warps
    (``moe_layer.api.down_config``). Each with the variants that cost the most registers: all
    of the AllGather kernel's parts (own-shard copy, joined senders, pulls), the epilogue's
    bias and residual, both walks of the layer, and a masked K tail."""
    from portable_overlap.ops.moe_combine.api import decode_tile
    from portable_overlap.ops.moe_layer.api import down_config

    bf16 = torch.bfloat16
    mm, gated = matmul_tile(bf16, facts), experts_tile(bf16, facts, False)

    def tiles(c):
        return dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                    NUM_STAGES=c.num_stages)

    ag = ("portable_overlap.ops.allgather_gemm.compile_specs", "allgather_gemm[bf16]")
    mr = ("portable_overlap.ops.matmul_reduce.compile_specs",
          "matmul_reduce_stores[reduce_scatter, bf16]")
    ds = ("portable_overlap.ops.moe_dispatch.compile_specs", "dispatch_swiglu[bf16]")
    ml = ("portable_overlap.ops.moe_layer.compile_specs", "moe_layer[bf16, 128x64/128]")
    picks = []
    for even in (True, False):
        picks.append(("allgather_gemm", *ag, mm,
                      dict(tiles(mm), EVEN_K=even, COPY_OWN=True, JOIN=True, PULLS=True)))
        picks.append(("dispatch_swiglu", *ds, gated, dict(tiles(gated), EVEN_K=even)))
    for ar, extra, even in ((False, False, True), (True, True, True), (True, True, False)):
        picks.append(("matmul_reduce_stores", *mr, mm,
                      dict(tiles(mm), ALL_REDUCE=ar, HAS_BIAS=extra, HAS_RES=extra,
                           EVEN_K=even)))
    downs = {down_config(gated, matmul_tile(bf16, facts)),
             down_config(gated, decode_tile(bf16, facts))}
    for down in downs:
        for major, even in ((False, True), (True, False)):
            picks.append(("moe_layer", *ml, gated, dict(
                tiles(gated), BLOCK_N2=down.block_n, BLOCK_K2=down.block_k,
                GROUP_M2=down.group_m, NUM_STAGES2=down.num_stages, EVEN_K=even, EVEN_K2=even,
                EXPERT_MAJOR=major)))
    return picks


@pytest.mark.parametrize("target", TARGETS[1:], ids=lambda t: f"{t[0]}-{t[1]}")
def test_fused_gemm_kernels_fit_amd_without_spills(target):
    """The fused kernels outside ``GEMM_KERNELS`` that run the GEMM tiles (``_fused_picks``)
    compile at their gfx942 / gfx950 bf16 picks without VGPR spills and within the LDS of a
    workgroup. Compiled (VGPRs of 512 / LDS, gfx942 and gfx950): AllGather + GEMM 336-341 /
    48 KiB and 268-292 / 64 KiB; GEMM + ReduceScatter / AllReduce 355-381 / 16 KiB and 441-500
    / 64 KiB (500 with the AllReduce's bias and residual: the closest to spilling); the MoE
    layer 401-412 / 48 KiB and 320-350 / 64 KiB; the fused dispatch + gated GEMM 367-379 /
    40 KiB and 292-316 / 64 KiB."""
    facts = FACTS[target]
    limit = facts.shared_per_program
    bad, seen = [], 0
    for label, module, name, cfg, consts in _fused_picks(facts):
        fn, sig, base, aligned = _spec_named(module, name)
        assert set(consts) <= set(base), (label, set(consts) - set(base))
        base.update(consts)
        k = compile_spec(fn, sig, base, aligned, target, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)
        seen += 1
        spills, shared = _vgpr_spills(k), k.metadata.shared
        if spills or shared > limit:
            bad.append((label, consts, spills, shared))
    assert seen == 9, seen  # the layer's decode and prefill down tiles are one on AMD
    assert not bad, f"spilling or over {limit} bytes of LDS (kernel, constexprs, VGPR spills, " \
                    f"LDS): {bad}"


@pytest.mark.parametrize("target", TARGETS[1:], ids=lambda t: f"{t[0]}-{t[1]}")
def test_embedding_kernel_fits_amd_at_its_launch_config(target):
    """The fused embedding kernel compiles at the tile and warps a gfx942 / gfx950 launch
    takes (``fused.default_block_b`` / ``default_num_warps`` for that arch: 4 warps, no
    measured entry), every dtype, D from 64 to 1024 (and 92, not a power of two), weighted
    and mean pooling, without VGPR spills and within a workgroup's LDS. (The compile matrix
    builds the kernel at sm_90's warps where sm_90 has a measured tile.)"""
    from portable_overlap.ops.embedding_alltoall.compile_specs import fused_spec
    from portable_overlap.ops.embedding_alltoall.kernel import embedding_alltoall_kernel

    arch = DEVICES[target][0]
    limit = FACTS[target].shared_per_program
    bad = []
    for i, (dt, D) in enumerate((d, D) for d in ("fp32", "fp16", "bf16")
                                for D in (64, 92, 1024)):
        weighted, mean = i % 2 == 0, i % 3 == 1
        sig, consts, aligned = fused_spec(dt, "i64", D, weighted, mean, arch=arch)
        assert consts["num_warps"] == 4, consts  # no measured entry for AMD
        k = compile_spec(embedding_alltoall_kernel, sig, consts, aligned, target)
        spills, shared = _vgpr_spills(k), k.metadata.shared
        if spills or shared > limit:
            bad.append((dt, D, weighted, mean, consts["BLOCK_B"], spills, shared))
    assert not bad, f"spilling or over {limit} bytes of LDS (dtype, D, weighted, mean, " \
                    f"BLOCK_B, VGPR spills, LDS): {bad}"


def test_gemm_tiles_on_sm90_are_the_h200_tiles():
    """32-lane warps keep the tiles measured on H200."""
    facts = FACTS[("cuda", 90, 32)]
    h200 = MatmulConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8,
                        num_stages=3)
    fp32 = MatmulConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4,
                        num_stages=3)
    for dtype in (torch.bfloat16, torch.float16):
        assert matmul_tile(dtype, facts) == h200
        assert experts_tile(dtype, facts, True) == MatmulConfig(
            block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
        assert experts_tile(dtype, facts, False) == MatmulConfig(
            block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)
    assert matmul_tile(torch.float32, facts) == fp32
    assert experts_tile(torch.float32, facts, True) == fp32


@pytest.mark.parametrize("target", TARGETS[:1], ids=lambda t: f"{t[0]}-{t[1]}")
def test_gemm_tiles_fit_sm90_without_local_memory(target, capfd):
    """The bf16 picks on H200 (tensor descriptors where the kernel has them), as ptxas reports
    them: no spill stores to local memory, shared memory within 227 KiB. With the experts'
    decode pick (64 x 256), per-source and with packed experts, and the two tilings it picks on
    the device at other decode sizes. Not the MoE grouped GEMM's
    pointer-load form (used only where its descriptors cannot be): at the H200 tile it
    compiles to 255 registers and 804 bytes of spill stores."""
    facts = FACTS[target]
    picks = [(kernel, _pick(kernel, torch.bfloat16, facts, True), True, {})
             for kernel in GEMM_KERNELS]
    for pack in (0, 1):  # 32 rows per segment: decode
        cfg = experts_tile(torch.bfloat16, facts, True, 32)
        picks.append(("expert_swiglu", cfg, True, {"PACK": pack}))
    for variant, cfg in enumerate((LIGHT_TILE, HEAVY_TILE), 1):  # the tiles picked on the device
        picks.append(("expert_swiglu", cfg, True, {"VARIANT": variant}))
    bad = []
    with _ptxas_reports():
        for kernel, cfg, desc, extra in picks:
            capfd.readouterr()
            fn, sig, consts, aligned = _gemm_spec(kernel, "bf16", cfg, True, desc)
            consts.update(extra)
            k = compile_spec(fn, sig, consts, aligned, target, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages)
            log = capfd.readouterr().out
            if _spill_stores(log) or k.metadata.shared > facts.shared_per_program:
                bad.append((kernel, cfg, extra, k.metadata.shared, log[-300:]))
    assert not bad, bad


@pytest.mark.parametrize("target", [TARGETS[0]], ids=lambda t: f"{t[0]}-{t[1]}")
def test_split_tiles_fit_sm90_without_local_memory(target, capfd):
    """GEMM + ReduceScatter / AllReduce with split tiles (64 x 128, the largest bf16 tile
    ``tile_parts`` splits, over the warps of descriptors and of pointer loads; fp32's 64 x 64)
    compiles for sm_90 with no spill stores and within the shared memory of a program."""
    from portable_overlap.ops.matmul_reduce.compile_specs import specs

    facts = FACTS[target]
    split = [s for s in specs() if "split tiles" in s[0]]
    assert len(split) == 6
    bad = []
    with _ptxas_reports():
        for name, fn, sig, consts, aligned in split:
            capfd.readouterr()
            k = compile_spec(fn, sig, consts, aligned, target)
            log = capfd.readouterr().out
            if _spill_stores(log) or k.metadata.shared > facts.shared_per_program:
                bad.append((name, k.metadata.shared, log[-300:]))
    assert not bad, bad
