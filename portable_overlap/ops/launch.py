"""Launching planned Triton kernels: compile once per shape with the launch's own arguments, cap
the grid at what is resident, and call the compiled launcher directly on every call."""
from __future__ import annotations

from typing import Callable, Optional

from ..backends.occupancy import compiler_occupancy


def warps_by_registers(n_regs: int, facts) -> int:
    """Warps (waves) of ``n_regs`` registers per lane that one SM / CU holds by its registers.
    The hardware allocates them per warp in units of ``register_unit`` per lane (8 on sm_90 and
    on CDNA), and a warp's registers come from one of the SM's ``register_files`` (the 4
    sub-partitions of an sm_90 SM, 16384 registers each, as CUDA's occupancy calculator counts
    them; a CU's 4 SIMDs, 512 VGPRs per lane each): a count off the unit, as compilers report
    it (117 VGPRs on gfx942), takes the next unit up, and a warp never spans two files."""
    unit = max(1, facts.register_unit)
    regs = -(-max(1, n_regs) // unit) * unit
    files = max(1, facts.register_files)
    return files * ((facts.max_regs_per_sm // files) // (regs * facts.warp_size))


def resident_programs(compiled, num_warps: int, facts) -> int:
    """How many programs of ``compiled`` fit on the device at once. Ops whose programs wait on
    their counterparts on peers never launch more, so no waiting program holds an SM that a
    program it depends on needs: an estimate one program too high per SM leaves programs
    waiting for a place that waiting programs hold, until the call times out."""
    compiled._init_handles()
    by_warps = facts.max_warps_per_sm // num_warps
    by_regs = warps_by_registers(compiled.n_regs, facts) // num_warps
    occupancy = compiler_occupancy(compiled)
    if occupancy is not None:  # waves per SIMD, the compiler's own count
        by_regs = min(by_regs, max(1, facts.register_files) * occupancy // num_warps)
    by_smem = facts.max_shared_bytes_per_sm // max(1, compiled.metadata.shared)
    return facts.sm_count * max(1, min(by_warps, by_regs, by_smem))


def fewer_registers(compile_capped: Callable[[int], object], compiled, num_warps: int, facts,
                    steps: int = 2):
    """``(kernel, cap)``: ``compiled`` recompiled (``compile_capped(cap)``) under the register
    cap that fits one more program per SM, step by step while the compiler needs no spill for
    it (at most ``steps`` steps); ``(compiled, None)`` where no cap does, or the backend takes
    none. For persistent kernels bound by memory latency, where each resident program is more
    loads in flight: ptxas left the embedding kernel (fp16, D = 128, 8 warps) at 64 registers,
    4 programs per SM, where 48 compile without a spill, 5 per SM."""
    if not facts.register_cap:
        return compiled, None
    best, cap = compiled, None
    unit = facts.register_unit
    for _ in range(steps):
        best._init_handles()
        per_sm = warps_by_registers(best.n_regs, facts) // num_warps
        if per_sm + 1 > facts.max_warps_per_sm // num_warps:
            break  # warps, not registers, bound the residency
        # the most registers (in units) at which one more program fits, counted as the
        # residency counts them
        want = best.n_regs // unit * unit
        while want >= 2 * unit and warps_by_registers(want, facts) // num_warps <= per_sm:
            want -= unit
        if want < 2 * unit:
            break
        k = compile_capped(want)
        k._init_handles()
        if k.n_spills or k.n_regs > want:
            break
        best, cap = k, want
    return best, cap


class PlannedLaunch:
    """One planned launch of ``kernel``: ``compiled`` is the kernel compiled for these arguments
    (None under the interpreter, which goes through the JIT), ``consts`` its constexprs and
    launch options, ``programs`` the grid.

    Calling it with the kernel's positional (non-constexpr) arguments launches on the current
    stream, skipping the JIT's per-call argument binding (tens of microseconds in Python)."""

    def __init__(self, kernel, compiled, programs: int, consts: dict,
                 stream_fn: Optional[Callable[[], int]], owner=None, **info):
        self.kernel, self.compiled, self.programs, self.consts = kernel, compiled, programs, consts
        self.stream_fn = stream_fn
        self.owner = owner  # the context whose call this launch belongs to (ops.context)
        self.__dict__.update(info)
        self.const_args = tuple(consts[n] for n in kernel.arg_names if n in consts)
        self._scratch = None
        if compiled is not None:
            compiled._init_handles()
            self._scratch = _global_scratch(compiled, programs)

    def __call__(self, args) -> None:
        if self.owner is not None:  # from here on the call is under way on the device
            self.owner._launched = True
        self.run_untracked(args)

    def run_untracked(self, args) -> None:
        """Launch without marking the owner's call as launched."""
        k = self.compiled
        if k is None:
            self.kernel[(self.programs,)](*args, **self.consts)
            return
        stream = self.stream_fn()
        runtime = _triton_runtime()
        enter, leave = _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)
        meta = (None if enter is None and leave is None
                else k.launch_metadata((self.programs, 1, 1), stream, *args))
        if self._scratch is None:
            k.run(self.programs, 1, 1, stream, k.function, k.packed_metadata, meta, enter, leave,
                  *args, *self.const_args)
            return
        from triton.runtime import _allocation

        # the launcher asks Triton's allocator (a context variable) for the scratch: this
        # launch's own buffer, made with the plan, so a call allocates nothing and a user's
        # allocator (triton.set_allocator) is left as it was
        token = _allocation._allocator.set(self._scratch)
        try:
            k.run(self.programs, 1, 1, stream, k.function, k.packed_metadata, meta, enter, leave,
                  *args, *self.const_args)
        finally:
            _allocation._allocator.reset(token)


_RUNTIME = None


def _triton_runtime():
    """``triton.knobs.runtime`` (imported on the first launch, not with this module)."""
    global _RUNTIME
    if _RUNTIME is None:
        from triton import knobs

        _RUNTIME = knobs.runtime
    return _RUNTIME


def _hook(hook):
    """``hook``, or None where calling it would run nothing: Triton keeps the launch hooks as
    chains (``knobs.HookChain``) that are never None, and for a chain the launcher calls back
    into Python twice per launch and the kernel builds its launch metadata, about 3 µs of
    a decode step's host time, for no hook at all."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


class _Scratch:
    """A kernel's global scratch, allocated once for a planned launch: kernels that build tensor
    descriptors on the device (``tl.make_tensor_descriptor``) write them there, 128 bytes each
    per program. Called by Triton's launcher as its allocator."""

    def __init__(self, nbytes: int, align: int, device):
        import torch

        from ..kept import kept_empty

        self.nbytes, self.align = nbytes, align
        self._raw = kept_empty(nbytes + align, torch.uint8, device)
        skip = -self._raw.data_ptr() % align
        self.buffer = self._raw[skip:skip + nbytes]

    def __call__(self, size: int, align: int, stream):
        if size > self.nbytes or align > self.align:
            raise RuntimeError(f"a planned launch asked for {size} bytes of scratch aligned to "
                               f"{align}; its plan made {self.nbytes} aligned to {self.align}")
        return self.buffer


def _global_scratch(compiled, programs: int) -> Optional[_Scratch]:
    """The scratch ``compiled`` needs for ``programs`` programs, or None if it needs none."""
    size = getattr(compiled.metadata, "global_scratch_size", 0) or 0
    if size <= 0:
        return None
    import torch

    align = max(int(getattr(compiled.metadata, "global_scratch_align", 1) or 1), 1)
    ctas = getattr(compiled.metadata, "num_ctas", 1) or 1
    device = torch.device(torch.accelerator.current_accelerator().type,
                          torch.accelerator.current_device_index())
    return _Scratch(programs * ctas * size, align, device)
