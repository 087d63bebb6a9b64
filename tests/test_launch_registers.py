"""``ops.launch.fewer_registers``: the register cap that fits one more resident program per SM,
taken step by step while the compiler needs no spill for it. The compiler is stood in for by a
table of what it would allocate under each cap (the decisions are arithmetic on the device
facts; the real compile runs in the GPU checks). And the launch hooks a planned launch hands
Triton's launcher."""
import dataclasses

from portable_overlap.backends.base import DeviceFacts
from portable_overlap.backends.occupancy import compiler_occupancy
from portable_overlap.ops.launch import fewer_registers, resident_programs

H200 = DeviceFacts(vendor="nvidia", name="H200", arch="sm_90", sm_count=132, warp_size=32,
                   max_shared_bytes_per_sm=228 * 1024, max_regs_per_sm=65536,
                   max_warps_per_sm=64, register_cap=True, register_files=4)


MI300X = DeviceFacts(vendor="amd", name="MI300X", arch="gfx942", sm_count=304, warp_size=64,
                     max_shared_bytes_per_sm=64 * 1024, max_regs_per_sm=512 * 64 * 4,
                     max_warps_per_sm=32, register_files=4)


@dataclasses.dataclass
class Compiled:
    n_regs: int
    n_spills: int = 0
    cap: int = None
    asm: dict = dataclasses.field(default_factory=dict)

    def _init_handles(self):
        pass

    class metadata:
        shared = 1024


def compiler(table):
    """A stand-in for recompiling under a cap: ``table[cap] = (registers, spills)``."""
    asked = []

    def compile_capped(cap):
        asked.append(cap)
        regs, spills = table[cap]
        return Compiled(regs, spills, cap)
    return compile_capped, asked


def test_steps_down_while_no_spill_and_stops_at_the_first_spill():
    # 8 warps: 64 registers -> 4 programs per SM; 48 -> 5; 40 -> 6 (spills here)
    compile_capped, asked = compiler({48: (48, 0), 40: (40, 6)})
    k, cap = fewer_registers(compile_capped, Compiled(64), 8, H200)
    assert (k.n_regs, cap, asked) == (48, 48, [48, 40])
    assert resident_programs(k, 8, H200) == 132 * 5


def test_the_cap_is_what_fits_one_more_program_per_sub_partition():
    """With few warps per program the cap is counted per register file, as the residency is:
    2 warps of 104 registers are 8 programs per SM (4 warps per sub-partition); more need 5
    warps in a sub-partition, at most 16384 / (5 * 32) = 102 registers, 96 in units of 8,
    which hold 10 (a pooled count asked 112, which gains no program)."""
    compile_capped, asked = compiler({96: (96, 0)})
    k, cap = fewer_registers(compile_capped, Compiled(104), 2, H200, steps=1)
    assert (k.n_regs, cap, asked) == (96, 96, [96])
    assert resident_programs(k, 2, H200) == 132 * 10


def test_keeps_the_kernel_when_the_first_cap_spills():
    compile_capped, asked = compiler({168: (168, 44)})
    k, cap = fewer_registers(compile_capped, Compiled(229), 4, H200)  # 2 per SM -> 3 wants 168
    assert (k.n_regs, cap, asked) == (229, None, [168])


def test_a_compiler_that_ignores_the_cap_is_not_trusted():
    compile_capped, _ = compiler({48: (56, 0)})
    k, cap = fewer_registers(compile_capped, Compiled(64), 8, H200, steps=1)
    assert (k.n_regs, cap) == (64, None)


def test_no_cap_where_warps_bound_the_residency_or_the_backend_takes_none():
    compile_capped, asked = compiler({})
    # 16 warps per program: 4 programs fill the 64 warps of an SM whatever the registers
    assert fewer_registers(compile_capped, Compiled(32), 16, H200)[1] is None
    amd = dataclasses.replace(H200, vendor="amd", register_cap=False)
    assert fewer_registers(compile_capped, Compiled(64), 8, amd)[1] is None
    assert asked == []


def test_residency_takes_registers_in_the_hardware_s_units():
    """A register count off the allocation unit takes the next unit up: one program too many
    per SM or CU would wait for a place that waiting programs hold (the persistent ops' grids
    are what is resident). sm_90: 50 registers are allocated as 56, 4 programs of 8 warps per
    SM, not 5. gfx942: a wave of 100 VGPRs takes 104 of its SIMD's 512, 4 waves per SIMD and
    16 per CU, so 4 programs of 4 waves, not 5; and waves never span two SIMDs: at 80 VGPRs a
    SIMD holds 6, the CU 24, not the 25 of the CU's registers pooled."""
    assert resident_programs(Compiled(50), 8, H200) == 132 * 4
    assert resident_programs(Compiled(48), 8, H200) == 132 * 5
    # an SM's 4 sub-partitions hold 16384 registers each (CUDA's occupancy calculator): at
    # 104 registers 4 warps each, 16 in all, 8 programs of 2 warps (one pool: 19 warps, 9)
    assert resident_programs(Compiled(104), 2, H200) == 132 * 8
    assert resident_programs(Compiled(200), 1, H200) == 132 * 8
    assert resident_programs(Compiled(100), 4, MI300X) == 304 * 4
    assert resident_programs(Compiled(176), 4, MI300X) == 304 * 2
    assert resident_programs(Compiled(80), 1, MI300X) == 304 * 24


def test_residency_follows_the_amd_compiler_s_occupancy_where_lower():
    """On AMD the assembly says how many waves per SIMD the compiler allows (VGPRs, AGPRs,
    SGPRs, LDS): more than 100 SGPRs hold a SIMD to 7 waves whatever the VGPRs."""
    asm = {"amdgcn": "kern:\n; NumVgprs: 64\n; Occupancy: 7\n"}
    assert compiler_occupancy(Compiled(64, asm=asm)) == 7
    assert resident_programs(Compiled(64, asm=asm), 1, MI300X) == 304 * 28  # not 32
    assert resident_programs(Compiled(64, asm=asm), 4, MI300X) == 304 * 7
    assert compiler_occupancy(Compiled(64)) is None
    assert compiler_occupancy(Compiled(64, asm={"ptx": "; Occupancy: 1"})) is None


def test_the_amd_compiler_reports_its_occupancy():
    """A kernel cross-compiled for gfx942 carries the occupancy line the residency reads."""
    import triton
    import triton.language as tl

    from portable_overlap.kernel_registry import compile_spec

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    k = compile_spec(_copy, {"src": "*fp32", "dst": "*fp32", "n": "i32"}, {"BLOCK": 256}, [],
                     ("hip", "gfx942", 64), num_warps=4)
    occupancy = compiler_occupancy(k)
    assert occupancy is not None and 1 <= occupancy <= 8, k.asm["amdgcn"][-2000:]


def test_launch_hooks_skipped_only_when_none_would_run():
    """A planned launch hands Triton's launcher its launch hooks only where one would run: an
    empty ``knobs.HookChain`` (Triton's default) is dropped, a chain with a hook or a plain
    callable is kept, so a profiler's hook still sees every launch."""
    from triton import knobs

    from portable_overlap.ops.launch import _hook

    chain = knobs.HookChain()
    assert _hook(None) is None
    assert _hook(chain) is None
    seen = []
    chain.add(seen.append)
    assert _hook(chain) is chain
    _hook(chain)("meta")
    assert seen == ["meta"]

    def plain(meta):
        return meta

    assert _hook(plain) is plain
