"""The backend interface: everything the library needs from a vendor runtime.

Only modules under ``portable_overlap/backends/`` know which vendor they talk to. Everything above
(the symmetric heap, the transports, the ops) calls the entries of :class:`Backend` and never asks
which implementation it got.

Addresses are plain Python ints. On a GPU they are device virtual addresses (unified addressing, so
a peer buffer opened through IPC is just another address the kernels can store to); on the
CPU-emulated backend they are addresses in this process's mapping of a shared-memory segment, which
the Triton interpreter dereferences the same way.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional

import torch

from ..errors import BackendEntryMissing

#: The entries every backend must implement; ``tests/test_backends.py`` checks each of them.
ENTRIES = (
    "is_usable",
    "device_facts",
    "alloc_exportable",
    "export_handle",
    "open_handle",
    "close_handle",
    "free",
    "can_access_peer",
    "enable_peer_access",
    "copy_async",
    "copy_2d_async",
    "alloc_gate_words",
    "stream_wait_value",
    "stream_write_value",
    "alloc_host_mapped",
    "current_stream",
    "synchronize",
)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the schedulers need to know about one device."""

    vendor: str  # "nvidia", "amd" or "cpu"
    name: str
    arch: str  # "sm_90", "gfx942", "cpu"
    sm_count: int  # streaming multiprocessors (NVIDIA) / compute units (AMD) / emulated slots
    warp_size: int
    max_shared_bytes_per_sm: int
    max_regs_per_sm: int
    max_warps_per_sm: int
    # bulk tensor copies (Hopper's TMA) behind Triton's tensor descriptors: the tile GEMM loads
    # through them where this is true (measured on H200: 0.705 vs 0.764 ms with pointer loads
    # at 8192x8192x4096, cuBLAS 0.696; benchmarks/probe_gemm_tma.py, rows in
    # benchmarks/results/nvidia-h200.jsonl)
    tensor_descriptors: bool = False
    # the compiler takes a per-thread register cap (Triton's ``maxnreg``), allocated in units
    # of ``register_unit`` per thread (ops/launch.py: ``fewer_registers``)
    register_cap: bool = False
    register_unit: int = 8
    # register files per SM / CU that a warp takes its registers from whole: an sm_70+ SM's 4
    # sub-partitions (CUDA's occupancy calculator), a CDNA CU's 4 SIMDs (512 VGPRs per lane
    # each); 1 where the registers are one pool (the CPU backend)
    register_files: int = 1
    # shared memory (LDS on AMD) one program may take, where the device says: NVIDIA's opt-in
    # limit per block (227 KiB on H100/H200), AMD's per workgroup (64 KiB on gfx942, 160 KiB on
    # gfx950); None: ``max_shared_bytes_per_sm``
    max_shared_bytes_per_program: Optional[int] = None
    # programs (SMs / CUs) a stream value wait keeps busy while it holds its stream: 0 where the
    # GPU's front end waits (NVIDIA's cuStreamWaitValue32), 1 where the wait is a spinning
    # kernel (ROCm's default blit-kernel wait and its capturable gate kernel). A persistent
    # grid that must stay resident beside such a wait leaves this many programs free.
    gate_programs: int = 0
    # the physical device, the same string in every process of the host that uses it (the
    # GPU's UUID; an emulated rank is its own device): ranks that name one share a GPU, which
    # their host's device indices cannot tell where each process sees its own GPU as device 0
    uid: str = ""

    @property
    def shared_per_program(self) -> int:
        """The most shared memory one program can have: what a config must fit."""
        return self.max_shared_bytes_per_program or self.max_shared_bytes_per_sm


@dataclasses.dataclass
class Allocation:
    """Device memory this process owns and may export to peers."""

    address: int
    nbytes: int
    tensor: torch.Tensor  # uint8 view of the whole allocation, on ``device``
    device: torch.device
    native: Any = None  # backend-private (the driver handle, the shm segment, ...)


@dataclasses.dataclass
class PeerMapping:
    """A peer's exported allocation, mapped into this process."""

    address: int
    nbytes: int
    native: Any = None


@dataclasses.dataclass
class HostMapped:
    """Pinned host memory that device code can store to and the host can read without a sync."""

    tensor: torch.Tensor  # a CPU tensor over the memory
    device_address: int  # the address kernels use


class GateWords:
    """``n`` int32 words, all 0, that kernels count into and :meth:`Backend.stream_wait_value`
    waits on (made by :meth:`Backend.alloc_gate_words`). Two layouts, one interface:

    - contiguous: ``words`` is an int32 tensor of ``n``, word g at ``words.data_ptr() + 4 * g``,
      and kernels take ``words`` itself;
    - separate: each word is its own allocation (``views``: one int32 tensor of 1 per word),
      where the runtime's zero-SM wait needs memory it hands out one word per allocation (ROCm's
      signal memory, 8 bytes per ``hipExtMallocWithFlags``). Kernels then take ``table``, the
      words' addresses as an int64 tensor on the device, and reach word g through it.

    A kernel takes ``kernel_arg`` and ``indirect`` as a constexpr (``transports.gate.gate_word``
    resolves word g either way); the host names word g by :meth:`address`. :meth:`close` hands
    back what the backend allocated (``release``); the words must not be used after it."""

    def __init__(self, words: Optional[torch.Tensor] = None, *, views: Optional[list] = None,
                 table: Optional[torch.Tensor] = None, release=None):
        if (words is None) == (views is None) or (views is not None and table is None):
            raise ValueError("GateWords: give words, or views with their table")
        self.words, self.views, self.table = words, views, table
        self.n = words.numel() if words is not None else len(views)
        self._release = release

    @property
    def indirect(self) -> bool:
        """Whether kernels reach the words through ``table`` (separate allocations)."""
        return self.table is not None

    @property
    def kernel_arg(self) -> torch.Tensor:
        """What a kernel takes: the words (contiguous) or their address table (separate)."""
        return self.table if self.indirect else self.words

    def address(self, g: int) -> int:
        """The address of word ``g`` (for the stream waits and writes)."""
        if not 0 <= g < self.n:
            raise IndexError(f"gate word {g} of {self.n}")
        if self.indirect:
            return self.views[g].data_ptr()
        return self.words.data_ptr() + 4 * g

    def zero_(self, n: Optional[int] = None) -> "GateWords":
        """Set words ``[0, n)`` (all by default) to 0 with one kernel on the current stream, so a
        graph capture records it (stream value writes may not be recorded: the ROCm backend)."""
        n = self.n if n is None else n
        if not self.indirect:
            self.words[:n].zero_()
        elif n:
            from . import gate_kernels

            gate_kernels.launch_zero(self.table, n)
        return self

    def values(self) -> torch.Tensor:
        """A copy of the words as one int32 tensor on their device (to inspect them)."""
        if not self.indirect:
            return self.words.clone()
        return torch.cat([v.reshape(1) for v in self.views])

    def close(self) -> None:
        """Hand back the backend's allocations (once; a second call does nothing)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __repr__(self) -> str:
        return f"<GateWords n={self.n} {'separate' if self.indirect else 'contiguous'}>"


class Backend(abc.ABC):
    """One vendor runtime. Each entry documents its contract; the CUDA, ROCm and CPU-emulated
    backends implement all of them (see ``ENTRIES``)."""

    name: str = "abstract"
    #: the torch.distributed backend for host collectives on this backend's devices
    process_group_backend: str = "gloo"

    # -- discovery -------------------------------------------------------------------------
    @classmethod
    def is_usable(cls) -> tuple[bool, str]:
        """(usable, reason). ``reason`` says what is missing when not usable."""
        return False, "abstract backend"

    def device_facts(self, device: torch.device) -> DeviceFacts:
        """SM/CU count, architecture and per-SM limits of ``device``."""
        raise self._missing("device_facts")

    # -- memory that peers can open --------------------------------------------------------
    def alloc_exportable(self, nbytes: int, device: torch.device) -> Allocation:
        """Allocate ``nbytes`` that can be exported to other processes (IPC)."""
        raise self._missing("alloc_exportable")

    def export_handle(self, alloc: Allocation) -> Any:
        """A picklable handle (bytes or a tuple) another process of the same node opens with
        :meth:`open_handle`."""
        raise self._missing("export_handle")

    def open_handle(self, handle: Any, nbytes: int, device: torch.device) -> PeerMapping:
        """Map a peer's exported allocation; the result's address is usable by this process's
        kernels (peer access enabled as needed)."""
        raise self._missing("open_handle")

    def close_handle(self, mapping: PeerMapping) -> None:
        """Unmap what :meth:`open_handle` mapped."""
        raise self._missing("close_handle")

    def free(self, alloc: Allocation) -> None:
        """Release an allocation made by :meth:`alloc_exportable`."""
        raise self._missing("free")

    def exported_everywhere(self, alloc: Allocation) -> None:
        """Called once every peer has opened ``alloc``: a backend may drop what only exporting
        needed. A backend must not rely on it for clean-up: a set-up that fails before every peer
        opened ``alloc`` calls :meth:`free` without it."""
        return None

    # -- peer access -----------------------------------------------------------------------
    def can_access_peer(self, device: torch.device, peer: torch.device) -> bool:
        """Whether kernels on ``device`` can load/store ``peer``'s memory directly."""
        raise self._missing("can_access_peer")

    def enable_peer_access(self, device: torch.device, peer: torch.device) -> None:
        """Enable direct access from ``device`` to ``peer`` (idempotent)."""
        raise self._missing("enable_peer_access")

    # -- copy engine and stream-ordered flags ----------------------------------------------
    def alloc_gate_words(self, n: int, device: torch.device) -> GateWords:
        """``n`` int32 words on ``device``, all 0, that kernels count into and
        :meth:`stream_wait_value` waits on: contiguous, or each its own allocation where the
        backend's wait needs special memory that comes one word at a time (:class:`GateWords`).
        Called once per workspace, outside any op call and any graph capture: a backend may
        allocate the words from special memory and load the kernels its waits (and the words'
        ``zero_``) need here. The workspace calls the result's ``close`` when it is closed."""
        raise self._missing("alloc_gate_words")

    def copy_async(self, dst: int, src: int, nbytes: int, stream: Optional[int]) -> None:
        """Copy ``nbytes`` from address ``src`` to ``dst`` (either may be a peer's) on the DMA
        copy engine, ordered on ``stream``; uses no SMs."""
        raise self._missing("copy_async")

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int,
                      width_bytes: int, height: int, stream: Optional[int]) -> None:
        """Copy ``height`` rows of ``width_bytes`` each from ``src`` to ``dst`` on the DMA copy
        engine, ordered on ``stream``: row i starts at ``src + i * src_pitch`` and lands at
        ``dst + i * dst_pitch`` (all in bytes; both pitches >= ``width_bytes``; either address may
        be a peer's). One call moves a column block of a row-major matrix, which a 1-D copy could
        only do row by row."""
        raise self._missing("copy_2d_async")

    def stream_wait_value(self, stream: Optional[int], address: int, value: int) -> None:
        """Make ``stream`` wait until the int32 at ``address`` (``GateWords.address`` of a word of
        :meth:`alloc_gate_words`) is >= ``value``; without a spinning kernel where the device
        can (``DeviceFacts.gate_programs`` says what the wait costs), and in a form that a
        graph capture of ``stream`` records.

        Every kernel launched (on any stream) while the wait holds must already be loaded: with
        lazy module loading (CUDA's default) a first launch waits for the device, which the held
        stream never releases — a deadlock seen on H200."""
        raise self._missing("stream_wait_value")

    def stream_write_value(self, stream: Optional[int], address: int, value: int) -> None:
        """Write the int32 ``value`` to ``address`` in ``stream`` order."""
        raise self._missing("stream_write_value")

    def alloc_host_mapped(self, nbytes: int) -> HostMapped:
        """Host memory kernels can store into and the host can read at any time."""
        raise self._missing("alloc_host_mapped")

    def current_stream(self, device: torch.device) -> Optional[int]:
        """The raw handle of the current stream of ``device`` (None where streams don't exist)."""
        raise self._missing("current_stream")

    def synchronize(self, device: torch.device) -> None:
        """Wait for all work queued on ``device``."""
        raise self._missing("synchronize")

    def extra_facts(self) -> dict:
        """Vendor-specific facts for ``python -m portable_overlap env`` (device-initiated
        communication libraries and the like)."""
        return {}

    # -- helpers ---------------------------------------------------------------------------
    def _missing(self, entry: str) -> BackendEntryMissing:
        return BackendEntryMissing(self.name, entry)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
