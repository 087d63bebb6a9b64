"""The host side of user-written fused kernels: a symmetric heap to carve tensors and flags from,
and a launch that gives the kernel its descriptor and turns a kernel's reports into errors.

    ws = Workspace(world, nbytes=64 << 20, timeout_s=10.0, name="my_allgather")
    # or nbytes=Workspace.bytes_for(((world.world_size, n), torch.bfloat16), ((W,), torch.int64))
    inbox = ws.tensor((world.world_size, n), torch.bfloat16)     # collective: same on every rank
    ready = ws.flags((world.world_size,), "ready")
    ws.launch(my_kernel, (ws.sm_count,), x, inbox, ready, n, BLOCK=1024)
    ws.synchronize()          # or the next launch: raises what the kernel reported
    ws.close()                # collective

The device functions are in :mod:`portable_overlap.language`; ``docs/tutorials`` has runnable
kernels. A workspace is one heap and one call counter: its launches must come in the same order
on every rank, on any streams (each call runs after the last), and each is one call of the
kernel on every rank.
``Workspace(..., shmem=True)`` puts the tensors in the SHMEM library's symmetric memory
(NVSHMEM / ROC_SHMEM) for kernels that move data with ``pol.shmem_put``.
"""
from __future__ import annotations

import ast
import inspect
import math
import operator
import textwrap
from typing import Optional, Sequence

import torch
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .errors import ContextBrokenError, PortableOverlapError, RankMismatchError
from .ops.context import G_MAX, ContextBase
from .shmem.heap import SymmetricHeap, heap_bytes
from .shmem.providers import ShmemUnavailable, provider_or_reason
from .shmem.providers import device as _provider_device
from .shmem.status import STATUS_TIMEOUT, StatusBoard
from . import language as _lang
from .language.host import (CALL_SHIFT, calls_counted, descriptor_words, fill_descriptor,
                            name_offset_reports)

_ALIGN = 256  # bytes: every tensor starts 16-byte aligned for vector stores and TMA
#: launches after which :meth:`Workspace.flags` refuses a new flag array (flags compare call
#: numbers mod 2**32: a zeroed word reads as arrived for a call 2**31 or more past 0)
FLAG_CARVE_CALLS = 2 ** 31


class Workspace(ContextBase):
    """``nbytes`` of symmetric memory on every rank of ``world`` (collective to make and to
    :meth:`close`), with the state a kernel of :mod:`portable_overlap.language` needs.

    - :meth:`tensor` and :meth:`flags` carve buffers from it: the same calls on every rank give
      the same offsets, so a kernel reaches a peer's copy of a buffer through
      ``pol.remote_ptr``.
    - :attr:`ctx` is the kernel's first argument: rank, world size, every rank's heap base, the
      call counter, the deadline clock, the timeout (``timeout_s``) and the status board.
    - :meth:`launch` runs one call of a kernel; a wait that timed out, or a peer that gave up,
      is raised at the next launch, :meth:`check` or :meth:`synchronize` (at once on emulated
      ranks) as :class:`~portable_overlap.PeerTimeoutError` naming the program, the peer, the
      flag (by the name given to :meth:`flags`, and its index) and the call. After a timeout the
      workspace is broken (its ranks are out of step): close it and make a new one.

    ``name`` is the kernel's name in errors. The descriptor's call counter lives on the device,
    so launches captured in a CUDA graph replay as new calls.

    ``shmem=True`` (the same on every rank): the tensors of :meth:`tensor` come from the SHMEM
    library of the process (NVSHMEM on NVIDIA, ROC_SHMEM on AMD; ``shmem/providers``), one
    symmetric allocation of ``nbytes``, for kernels that move data with ``pol.shmem_put``; the
    descriptor and the flags stay in the heap, and :meth:`launch` links the library into the
    kernels that call it. The heap keeps its ``nbytes`` as well (the flags sit at their offsets
    of the one layout ``bytes_for`` describes), so such a workspace holds ``nbytes`` twice.
    Where the library is not usable on some rank (the CPU backend, a torch build without the
    bindings, NVSHMEM not found) every rank raises ``ShmemUnavailable`` (``shmem.providers``)
    naming the ranks and why, before anything is allocated. :attr:`shmem` says which kind it
    is: pass it to a kernel as a constexpr (``VIA_SHMEM=ws.shmem``).
    """

    OP = "workspace"
    collective_init = True  # the heap's allocation

    def __init__(self, world, nbytes: int, *, timeout_s: float = 30.0, name: str = "workspace",
                 shmem: bool = False):
        if not isinstance(name, str) or not name:
            raise ValueError(f"Workspace: name must be a non-empty string, got {name!r}")
        self.OP = name
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{name}: nbytes must be a non-negative int, got {nbytes!r}")
        if not isinstance(shmem, bool):
            raise ValueError(f"{name}: shmem must be True or False, got {shmem!r}")
        super().__init__(world, timeout_s)
        W = world.world_size
        pool = int(math.ceil(max(nbytes, 1) / _ALIGN) * _ALIGN)
        self._provider = _shmem_provider(world, name, shmem)
        #: whether the tensors are the SHMEM library's (``pol.shmem_put``) or the heap's
        self.shmem = self._provider is not None
        # The library's allocation first: if the heap fails after it, dropping it is all the
        # undoing (no collective), and nothing is left half-made.
        data = self._provider.symmetric_empty(pool) if self.shmem else None
        self.heap = SymmetricHeap(world, heap_bytes([((descriptor_words(W),), torch.int64),
                                                     ((pool,), torch.uint8)]),
                                  owner=f"{name} workspace")
        self.heap.set_up(f"{name} workspace", lambda: self._set_up_heap(pool))
        self.world_size = W
        #: programs that are resident at once for any kernel that fits one program per SM/CU
        self.sm_count = world.facts.sm_count
        self._data = data  # the tensors' pool: the library's symmetric memory, or None
        self._linked: dict = {}  # kernel -> the provider's launcher of it
        self._source_checked: set = set()  # kernels whose use of pol.end_call was checked
        self._top = 0
        self._arrays: list = []  # (heap offset, nbytes, name, shape) of every flag array
        self._calls = 0  # launches made, for the end_call check; None once one was captured
        self._sync_errors = world.backend.name == "cpu"
        self.register()

    def _set_up_heap(self, pool: int) -> None:
        """This rank's part of the set-up on the heap (``SymmetricHeap.set_up``): the
        descriptor, the pool, the status board (host memory the device writes)."""
        self.ctx = self.heap.alloc((descriptor_words(self.world.world_size),), torch.int64)
        self._pool = self.heap.alloc((pool,), torch.uint8)
        self.status = StatusBoard(self.world.backend, G_MAX)
        fill_descriptor(self.ctx, self.heap, self.world.rank, self.timeout_us,
                        self.status.address)

    # -- buffers -------------------------------------------------------------------------------
    @staticmethod
    def bytes_for(*buffers) -> int:
        """The ``nbytes`` that holds ``buffers``, each ``(shape, dtype)``, carved in that order
        (each starts 256-byte aligned)."""
        top = 0
        for shape, dtype in buffers:
            top = int(math.ceil(top / _ALIGN) * _ALIGN)
            top += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return top

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in the heap (with ``shmem=True``: in the SHMEM library's symmetric
        memory), at the same offset on every rank. Collective: every rank makes the same calls
        in the same order (checked here, a host exchange)."""
        return self._carve(shape, dtype, None)

    def flags(self, shape: Sequence[int], name: str) -> torch.Tensor:
        """A zeroed int64 array of flags (or counters) named ``name`` in errors. Collective,
        like :meth:`tensor`. Give every flag array its own use: a flag holds the number of the
        call that last set it, a counter the sum of everything added to it. Refused
        (``ValueError``) once 2**31 launches of the workspace are done: a zeroed flag would
        read as set for the next call (flags compare call numbers mod 2**32); carve flags
        first."""
        bad = None if isinstance(name, str) and name else \
            f"a flag array needs a name (for its errors), got {name!r}"
        return self._carve(shape, torch.int64, name, bad)

    def _carve(self, shape, dtype, name: Optional[str], bad: Optional[str] = None
               ) -> torch.Tensor:
        """The buffer of :meth:`tensor` / :meth:`flags`; ``bad``: why the caller refuses it."""
        self._check_open()
        try:  # whole sizes only: int() would cut 2.5 to a buffer of 2, smaller than asked
            shape = tuple(operator.index(s) for s in shape)
        except TypeError:
            bad = bad or f"shape must be a sequence of ints, got {shape!r}"
        if bad is None and (any(s < 0 for s in shape) or not isinstance(dtype, torch.dtype)):
            bad = (f"need non-negative sizes and a torch.dtype, got shape {shape} and dtype "
                   f"{dtype!r}")
        if bad is None and name is not None:
            # A flag word holds its call's number mod 2**32 and reads as arrived for any call
            # up to 2**31 before it: a zeroed word carved after 2**31 launches would read as
            # set for the next call (its wait would pass at once, over data never sent). The
            # counter is read after the queued launches ran (carving meets the peers anyway).
            self.world.backend.synchronize(self.world.device)
            done = calls_counted(self.ctx)
            if done >= FLAG_CARVE_CALLS:
                bad = (f"flag array {name!r} asked after {done} launches of the workspace: a "
                       f"zeroed flag reads as set once 2**31 calls have run; carve every flag "
                       f"array before (at the start), or make a new workspace")
        # agree first, so that every rank takes the same path below: a rank that alone refused
        # the buffer, or ran out of room, would leave its peers waiting in this collective or
        # the next one (a refused buffer is compared by what was passed)
        self.world.check_same(f"{self.OP}: buffer #{len(self._arrays)} (shape, dtype, name)",
                              (shape, str(dtype), name) if bad is None else
                              (repr(shape), str(dtype), repr(name)))
        if bad is not None:
            raise ValueError(f"{self.OP}: {bad}")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        start = int(math.ceil(self._top / _ALIGN) * _ALIGN)
        if start + size > self._pool.numel():
            raise MemoryError(f"{self.OP}: the workspace's {self._pool.numel()} bytes are full "
                              f"({start} used, asked {size} more); make it with a larger nbytes")
        # one layout (offsets, room) for both pools: flags always in the heap, where the
        # descriptor's peer bases reach them; tensors in the library's memory when there is one
        in_heap = name is not None or self._data is None
        pool = self._pool if in_heap else self._data
        t = pool[start:start + size].view(dtype).view(shape)
        # Zeroed, and the zeroing finished on every rank, before any rank goes on: a peer may
        # launch at once and signal into this buffer, and a later zeroing would erase that.
        t.zero_()
        self.world.backend.synchronize(self.world.device)
        self.world.barrier()
        self._top = start + size
        self._arrays.append((self.heap.offset_of(t) if size and in_heap else -1, size, name,
                             shape))
        return t

    # -- calls ---------------------------------------------------------------------------------
    def launch(self, kernel, grid, *args, **kwargs):
        """``kernel[grid](self.ctx, *args, **kwargs)``: one call of a kernel whose programs all
        call ``pol.begin_call`` / ``pol.end_call``. Raises what an earlier call reported first;
        on emulated ranks the call runs at once and its own errors are raised here. With
        ``shmem=True`` a kernel that calls the SHMEM library (``pol.shmem_put`` /
        ``pol.shmem_quiet``, itself or through the ``triton.jit`` functions it calls) goes
        through the provider's launcher, which links the library and sets up each compiled
        module; other kernels launch as usual (the library's module set-up fails for a module
        that does not link it)."""
        self._check_open()
        jit = self._jit_kernel(kernel)
        grid = self._check_grid(jit, grid)
        self._check_source(jit)
        self._acquire_call()
        try:
            self._check_open()  # (closed by another thread while this one took the guard)
            if self._broken is not None or self.status.failed():
                self.check()
            self._follow_stream()
            if self.capturing():
                self._calls = None  # replays add calls the host does not see
            if self.shmem:
                kernel = self._linked_kernel(kernel)
            try:
                out = kernel[grid](self.ctx, *args, **kwargs)
            except InterpreterError as e:
                # A kernel program raised under the interpreter: the launch's programs ran up
                # to the error, and peers may hold its signals while this rank's call counter
                # did not advance: its next launch would pair with their next call and return
                # the previous call's data with no error. Out of step: broken. (A refusal
                # before any program runs, such as an empty grid, is raised as itself; on a
                # GPU a compile or launch failure also comes before any program runs.)
                if self._interpreted:
                    self._broken = (f"{self.OP}: rank {self.rank}'s launch of "
                                    f"{getattr(jit, '__name__', 'a kernel')} raised "
                                    f"({type(e).__name__}: {str(e)[:300]})")
                raise
            if self._calls is not None:
                self._calls += 1
        finally:
            self._release_call()
        if self._sync_errors:
            self.check()
            self._check_call_count()
        return out

    def _jit_kernel(self, kernel):
        """The ``triton.jit`` function that ``kernel`` launches (through ``triton.heuristics``,
        which picks constants and launches once, so the checks below see its source); an
        autotuner is refused: it launches the kernel several times to time it, and each of
        those launches is a call of the workspace that the peers' calls would pair with (with
        a config each rank picks for itself, so other grids and tiles)."""
        jit = kernel
        while isinstance(jit, (Autotuner, Heuristics)):
            if isinstance(jit, Autotuner):
                raise TypeError(
                    f"{self.OP}: launch a triton.jit kernel with its config chosen, not a "
                    f"triton.autotune one: the autotuner's timing runs would each be a call of "
                    f"the workspace, on every rank, with a config each rank picks for itself")
            jit = jit.fn
        return jit

    def _check_source(self, kernel) -> None:
        """Refuse, at a kernel's first launch, a kernel that uses the value of
        ``pol.end_call`` (itself or in a jit function it calls): it returns nothing, so a
        branch on it (``if pol.end_call(...)``, the last program's work) never runs, with no
        error. ``pol.end_call_last`` returns whether the program was the last."""
        if kernel in self._source_checked:
            return
        where = _value_used(kernel, _lang.end_call)
        if where is not None:
            raise TypeError(
                f"{self.OP}: {where} uses the value of pol.end_call, which returns nothing "
                f"(no program learns whether it was the last, so none waits for the counter's "
                f"reply); use pol.end_call_last(ctx, call), which returns it")
        self._source_checked.add(kernel)

    def _check_grid(self, kernel, grid) -> None:
        """Refuse a grid (sizes; a callable is Triton's to evaluate) of ``2**CALL_SHIFT``
        programs or more for a kernel that calls ``pol.end_call``: its programs count out below
        that bit of the call counter (``shmem.device.count_out``), so with more of them the
        call number would move in the middle of the call, and programs of one launch would
        signal and wait with different numbers. Also refuse an empty grid (a size below 1,
        e.g. ``triton.cdiv(n, BLOCK)`` of an ``n`` of 0): no program would count the call out,
        and the call-count check would then break the workspace for a kernel that is right.
        Returns the grid to launch: a callable one (``lambda meta: (triton.cdiv(meta["n"],
        meta["BLOCK"]),)``) wrapped so that the sizes it gives are checked when Triton
        evaluates it, before the launch."""
        if callable(grid):
            def checked(meta, grid=grid):
                return self._check_grid(kernel, grid(meta))

            return checked
        sizes = tuple(int(s) for s in grid)
        programs = math.prod(sizes)
        if any(size < 1 for size in sizes):
            raise ValueError(f"{self.OP}: an empty grid {sizes}: a launch is one call of "
                             f"the workspace, and its programs count it out (pol.end_call); "
                             f"launch at least one program, or make no launch")
        if programs >= 1 << CALL_SHIFT and _reaches(kernel, {_lang.end_call}):
            raise ValueError(
                f"{self.OP}: a grid of {programs} programs ({sizes}) for a kernel that "
                f"calls pol.end_call: it counts a call's programs below bit {CALL_SHIFT} of the "
                f"call counter, so a launch takes fewer than 2**{CALL_SHIFT}; use fewer "
                f"programs (a persistent grid), or pol.end_call_last")
        return grid

    def _linked_kernel(self, kernel):
        """``kernel`` through the provider's launcher if it calls the library, else itself."""
        linked = self._linked.get(kernel)
        if linked is None:
            calls = _reaches(kernel, _library_functions())
            linked = self._linked[kernel] = self._provider.wrap(kernel) if calls else kernel
        return linked

    def check(self) -> None:
        """Raise if a kernel of this workspace reported a failure: a wait that timed out (the
        workspace is then broken), or a peer that gave up (the workspace stays usable)."""
        self._check_open()
        self._check_broken()
        if not self.status.failed():
            return
        self.world.backend.synchronize(self.world.device)
        # a program keeps its first report, so a wait that timed out after its program had
        # reported something else (a peer that gave up on an earlier flag) shows only in the
        # device's word (``pol.is_live``): every later wait gives up at once, and the
        # workspace must break here as for a reported timeout, not clear the board
        timed_out = self.status.has(STATUS_TIMEOUT) or \
            int(self.ctx[int(_lang.CTX_CLOCK.value) + 1]) != 0
        names = self._name_reports()
        try:
            self.status.raise_if_failed(self.OP, self.rank, names)
        except PortableOverlapError as e:
            if timed_out:
                self._broken = str(e)
            else:
                self.status.clear()
            raise

    def synchronize(self) -> None:
        """Wait for this rank's queued launches, then :meth:`check`; also checks that every
        program of every launch called ``pol.end_call`` (unless a launch was captured)."""
        self._check_open()
        self.world.backend.synchronize(self.world.device)
        self.check()
        self._check_call_count()

    def _check_call_count(self) -> None:
        if self._calls is None:
            return
        word = int(self.ctx[int(_lang.CTX_EPOCH.value)])  # one read of the device's memory
        done = word >> CALL_SHIFT
        # the programs counted out of no finished call: 0 between calls, unless a program
        # counted itself out twice (or a launch stopped part way), and then the programs of
        # every later launch read different call numbers
        part = word & ((1 << CALL_SHIFT) - 1)
        if done != self._calls or part:
            more = " and part of another (programs counted out of no finished call)" \
                if part else ""
            self._broken = (f"{self.OP}: {self._calls} launches made, {done} finished on the "
                            f"device{more}")
            raise ContextBrokenError(
                f"{self.OP} on rank {self.rank}: {self._calls} launches made but the device "
                f"counted {done} finished calls{more}: every program of a launch must call "
                f"pol.begin_call(ctx) first and pol.end_call(ctx, call) last, once (a kernel "
                f"that skips them reuses the previous call's number, and its waits would take "
                f"old flags for new ones). Close this workspace and make a new one")

    def _name_reports(self) -> dict:
        """The reports' flags named by the arrays of :meth:`flags` (the index printed is the
        flat one)."""
        regions = [(off, size, f"'{name}'" + (f" (shape {list(shape)}, flat index)"
                                              if len(shape) > 1 else ""))
                   for off, size, name, shape in self._arrays if name is not None]
        return name_offset_reports(self.status, regions)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective (every rank): free the heap once every rank's launches are done. The
        tensors :meth:`tensor` and :meth:`flags` gave are views of it: not to be used after
        (the memory is freed whatever views it; on the CPU backend a read faults)."""
        if self._closed:
            return
        super().close()
        self.heap.close()
        # the library's memory goes once no view of it is left (torch frees it); the heap's
        # close waited for every rank's launches first
        self._data = self._provider = None
        self._linked = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _library_functions() -> set:
    """The device functions that call the SHMEM library: the public ones and the provider's
    bindings (None where there is no provider)."""
    names = ("put_rows", "put_strided", "put", "get", "flush")
    return {_lang.shmem_put, _lang.shmem_get, _lang.shmem_quiet} | {
        f for f in (getattr(_provider_device, n) for n in names) if f is not None}


def _jit_bodies(fn, strict: bool = True):
    """``(function, parsed body)`` of ``fn`` and of every jit function it names, itself or
    through the jit functions those name (globals and module attributes: what Triton resolves
    when it compiles; a name in a branch the compile skips counts too), each once. A function
    whose source Python cannot find (defined in ``python -c`` under the interpreter) raises,
    or with ``strict=False`` is passed over."""
    seen, stack = set(), [fn]
    while stack:
        f = stack.pop()
        if not isinstance(f, (JITFunction, InterpretedFunction)) or f in seen:
            continue
        seen.add(f)
        try:  # a JITFunction keeps the source it compiles; the interpreter's wrapper does not
            body = ast.parse(textwrap.dedent(getattr(f, "src", None) or inspect.getsource(f.fn)))
        except (OSError, TypeError):
            if strict:
                raise
            continue
        yield f, body
        stack.extend(_resolve(node, f.fn.__globals__) for node in ast.walk(body)
                     if isinstance(node, (ast.Name, ast.Attribute)))


def _reaches(fn, targets: set) -> bool:
    """Whether the jit function ``fn`` (compiled or interpreted) is one of ``targets`` or names
    one, itself or through the jit functions it names (:func:`_jit_bodies`)."""
    return fn in targets or any(
        _resolve(node, f.fn.__globals__) in targets for f, body in _jit_bodies(fn)
        for node in ast.walk(body) if isinstance(node, (ast.Name, ast.Attribute)))


def _value_used(fn, target) -> Optional[str]:
    """The name of the jit function, ``fn`` or one it calls, in which a call of ``target`` is
    not a statement of its own (its value is assigned, tested or passed on), or None.
    Functions without a source Python can find are passed over."""
    for f, body in _jit_bodies(fn, strict=False):
        statements = {id(node.value) for node in ast.walk(body) if isinstance(node, ast.Expr)}
        if any(isinstance(node, ast.Call) and id(node) not in statements
               and _resolve(node.func, f.fn.__globals__) is target for node in ast.walk(body)):
            return f.fn.__name__
    return None


def _resolve(node, scope: dict):
    """The object a name or a dotted name (``pol.shmem_put``) of a function's body stands for
    in its module, or None."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
        base = _resolve(node.value, scope)
        return None if base is None else getattr(base, node.attr, None)
    return None


def _shmem_provider(world, op: str, shmem: bool):
    """The SHMEM provider a ``shmem=True`` workspace puts through, or None for ``shmem=False``.
    Collective, before anything is allocated: every rank tells the others what it asked for
    and, if it cannot have a provider, why (the provider layer's own reason), so a workspace
    that cannot be made raises on every rank instead of leaving the others waiting in the
    library's collective allocation."""
    provider, why = provider_or_reason(world) if shmem else (None, None)
    said = world.all_gather_object((shmem, why))
    if any(s != shmem for s, _ in said):
        raise RankMismatchError(f"{op}: ranks disagree on shmem: " + ", ".join(
            f"rank {r}: {s}" for r, (s, _) in enumerate(said)))
    failed = [f"rank {r}: {w}" for r, (_, w) in enumerate(said) if w is not None]
    if failed:
        raise ShmemUnavailable(
            f"{op}: shmem=True needs a usable SHMEM library (NVSHMEM on NVIDIA, ROC_SHMEM on "
            f"AMD) on every rank. Not usable on " + "; ".join(failed) + ". Make the workspace "
            "with shmem=False (zero-copy puts through the heap, pol.put)")
    return provider
