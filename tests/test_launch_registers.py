"""``ops.launch.fewer_registers``: the register cap that fits one more resident program per SM,
taken step by step while the compiler needs no spill for it. The compiler is stood in for by a
table of what it would allocate under each cap (the decisions are arithmetic on the device
facts; the real compile runs in the GPU checks). And the launch hooks a planned launch hands
Triton's launcher."""
import dataclasses

from portable_overlap.backends.base import DeviceFacts
from portable_overlap.ops.launch import fewer_registers, resident_programs

H200 = DeviceFacts(vendor="nvidia", name="H200", arch="sm_90", sm_count=132, warp_size=32,
                   max_shared_bytes_per_sm=228 * 1024, max_regs_per_sm=65536,
                   max_warps_per_sm=64, register_cap=True)


@dataclasses.dataclass
class Compiled:
    n_regs: int
    n_spills: int = 0
    cap: int = None

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
