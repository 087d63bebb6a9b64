"""torch's own fused ops as a transport of the patterns torch has them for
(``transport="torch_fused"``): ``torch.ops.symm_mem.fused_all_gather_matmul`` for AllGather +
GEMM, ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` for GEMM + ReduceScatter, and the BLAS
product written into a torch symmetric-memory buffer followed by
``torch.ops.symm_mem.one_shot_all_reduce_out`` for GEMV + AllReduce. They compute what the
other transports compute, with the same input checks and errors, so ``transport="auto"`` can
weigh them against ours: the library's aim is never to be slower than torch's fused ops or the
vendor library's collectives.

How torch runs them: the shard (AllGather) or each peer's partial rows (ReduceScatter) go through
one symmetric-memory workspace per process group, which torch allocates at a call that needs
more room than it has; peers pull or push whole shards over that workspace on a second stream
while the BLAS multiplies what has arrived, with torch's barriers between the steps. The input
itself need not be a symmetric tensor: torch copies it into the workspace. torch's op allocates
its result and its receive buffer per call from torch's caching allocator (under graph capture,
from the graph's pool); the transports of this library allocate nothing per call. The GEMV
transport needs no torch workspace: it allocates one symmetric buffer of its own at creation
(``TorchFusedGemv``).

Where they run (:func:`unavailable_reason`, the one place that decides it): GPU worlds (torch
registers no CPU kernel for them), of one host and one GPU per rank, with a torch that has
the op's torch ops (``TORCH_OPS``), in a process
whose torch symmetric memory has not been bound to NVSHMEM (by a ``transport="shmem"``
context); a world of one rank too. Elsewhere making this transport raises
:class:`~portable_overlap.errors.BackendUnavailable`, and ``transport="auto"`` leaves it out.

Calls are matched by torch's barriers, which wait without a deadline: named as the transport,
a rank that skips a call, refuses one (bad input) or calls with other shapes leaves its peers
waiting inside torch's op (``timeout_s`` is checked and kept, but torch's waits do not use it).
Under ``transport="auto"`` every call of it first agrees with the peers with a deadline
(``planner.TransportPlanner._agree``), its input checked before (``planner.UNBOUNDED``,
``ContextBase.checking_only``): a
refused or skipped call raises on every rank instead, and so does a key's first call whose
sizes the collective moves differ across ranks (``PatternContext._matched``)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import BackendUnavailable
from ..shmem.providers import torch_shmem_backend_bound
from .allgather_gemm.api import check_input as check_all_gather_input, refuse_schedule
from .context import ContextBase, collective_call, output_tensor
from .gemv_allreduce.api import MAX_M as GEMV_MAX_M
from .matmul.api import add_epilogue, check_operands, vector_checks
from .sequential import check_gemv_call, gemv_then_all_reduce

TRANSPORT = "torch_fused"
#: public op -> the torch ops its transport calls (``torch.ops.symm_mem.<name>``)
TORCH_OPS = {"all_gather_matmul": ("fused_all_gather_matmul",),
             "matmul_reduce_scatter": ("fused_matmul_reduce_scatter",),
             "gemv_all_reduce": ("one_shot_all_reduce_out",)}
#: bytes per element of the widest dtype the ops take (fp32): the workspace fits any of them
_WIDEST = 4
#: the dtypes torch's one-shot all-reduce kernel takes (its CUDA kernel dispatches fp32 and bf16
#: only); a GEMV call in another dtype (fp16) reduces with the process group's all_reduce
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)
#: torch's one-shot kernel moves 16-byte vectors where the input's size allows (its sizes must
#: be multiples of 4 bytes): the GEMV transport reduces a whole number of them
_VECTOR_BYTES = 16


def unavailable_reason(world, op: Optional[str] = None) -> Optional[str]:
    """Why torch's ops for ``op`` (a key of ``TORCH_OPS``; None: every op's) cannot run on
    ``world``, or None where they can. The same on every rank (it reads the backend, the
    world's sizes, where its ranks run and torch's build), so ranks agree on it. The first
    question of a world meets its ranks in a host collective (``World.placement``)."""
    if world.backend.name == "cpu":
        return ("the CPU-emulated backend: torch registers its symm_mem fused ops for GPU "
                "tensors only")
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines torch.ops.symm_mem)
    except Exception as e:  # a torch built without distributed or symmetric memory
        return f"this torch has no symmetric memory ({type(e).__name__}: {e})"
    names = TORCH_OPS[op] if op is not None else sum(TORCH_OPS.values(), ())
    for name in names:
        if not hasattr(torch.ops.symm_mem, name):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.{name}"
    # the job's ranks, of which the world's are all (a world of the default group) or some (a
    # world made on a subgroup: World.local_world_size counts the job's ranks on this host)
    job = dist.get_world_size() if dist.is_initialized() else world.world_size
    if world.local_world_size != job:
        # torch's default symmetric-memory allocator maps the peers' workspaces by IPC handles,
        # which reach the GPUs of one host. A subgroup of a job that spans hosts is taken to
        # span them as well: one rank alone cannot tell on which hosts its peers run
        return (f"ranks on more than one host ({job} ranks in the job, "
                f"{world.local_world_size} on this one"
                + (f"; this world is {world.world_size} of them" if job != world.world_size
                   else "")
                + "): torch's symmetric-memory workspace joins the GPUs of one host")
    if world.world_size > 1 and world.shares_devices():
        # seen on one H100 with two ranks: torch's allocator raises "rendezvous: detected
        # allocations from overlapping devices from different ranks"
        return ("ranks share a GPU: torch's symmetric-memory workspace takes one GPU per "
                "rank")
    if torch_shmem_backend_bound(getattr(world, "device", None)):
        # seen on 4 H200s: the workspace allocation raised "NVSHMEMSymmetricMemoryAllocator::
        # alloc must not be called with a group_name" after a transport='shmem' context
        return ("torch's symmetric memory in this process allocates from its NVSHMEM backend "
                "(torch keeps the backend of the process's first symmetric tensor; a "
                "transport='shmem' context selects NVSHMEM), and torch's fused ops allocate "
                "their workspace per process group, which that backend refuses: the two "
                "cannot share a process")
    return None


def _no_options(op: str, options: dict) -> None:
    """This transport has no options: name the ones given (another transport's, say)."""
    # an option given as None is not given (as ``"auto"`` takes it: ``config=None`` from a
    # caller with no configuration to pass)
    options = {k: v for k, v in options.items() if v is not None} if options else options
    if options:
        raise ValueError(f"{op}: the {TRANSPORT!r} transport takes no options; got "
                         f"{sorted(options)}")


class _TorchFused(ContextBase):
    """What the workspaces share: the availability check, the process group's name (torch's
    ops name their group by it) and the collective allocation for the largest call
    (:meth:`_allocate`: torch's workspace of ``workspace_bytes`` unless a subclass says
    otherwise)."""

    collective_init = True  # the sizes' agreement, torch's allocation

    def __init__(self, world, op: str, sizes: tuple, workspace_bytes: int, *,
                 timeout_s: float = 60.0, **options):
        self.OP = op
        _no_options(op, options)
        why = unavailable_reason(world, op)
        if why is not None:
            raise BackendUnavailable(f"{op}: transport {TRANSPORT!r} cannot run here: {why}")
        super().__init__(world, timeout_s)
        world.check_same(f"{op} context sizes", sizes)  # before the collective allocation
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = (world.group or dist.group.WORLD).group_name
        enable_group(symm_mem, self.group_name)
        self.workspace_bytes = workspace_bytes
        with _current(world.device):  # torch allocates on the current device
            self._allocate(symm_mem)
        self.register()

    def _allocate(self, symm_mem) -> None:
        # torch allocates its workspace (collectively) at the first call that needs more room
        # than it has, and refuses to under graph capture: sized here for the largest call, no
        # call allocates it, and calls can be captured. The workspace is torch's, one per
        # process group and shared with every other user of torch's fused ops on it: close()
        # leaves it to torch.
        symm_mem.get_symm_mem_workspace(self.group_name, min_size=self.workspace_bytes)


def _current(device: torch.device):
    """``device`` made the current one of its kind while the block runs (nothing for the CPU,
    which has no current device)."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.get_device_module(device).device(device)


def enable_group(symm_mem, group_name: str) -> None:
    """Register the group with torch's symmetric memory where this torch still needs it (it
    marks the call deprecated once groups register themselves)."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group_name)


class TorchFusedMatmul(_TorchFused):
    """The ``"torch_fused"`` transport of GEMM + ReduceScatter (public op ``op``), for results
    of at most ``max_m`` x ``max_n``: each call is ::

        y = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)
          # rows [r*M/W, (r+1)*M/W) of sum_q a_q @ b_q on rank r (torch chunks dim 0 by rank)
        y += bias; y += residual                                   # where given

    torch rounds each peer's partial to the input dtype and sums them (as NCCL's reduction
    does), so the result matches ``"sequential"`` to within a rounding of the partials."""

    def __init__(self, world, op: str, max_m: int, max_n: int, *, timeout_s: float = 60.0,
                 **options):
        W = world.world_size
        # torch stages two peer-sized chunks of the result ([M/W, N] each) in the workspace
        super().__init__(world, op, (max_m, max_n), 2 * -(-max_m // W) * max_n * _WIDEST,
                         timeout_s=timeout_s, **options)
        self.max_m, self.max_n = max_m, max_n

    def reduce_scatter(self, a, b, out=None, *, bias=None, residual=None,
                       **options) -> torch.Tensor:
        """Rows ``[r*M/W, (r+1)*M/W)`` of ``sum_q a_q @ b_q`` (+ bias + residual) on rank r."""
        _no_options(self.OP, options)
        return self._call(a, b, out, bias, residual)

    @collective_call
    def _call(self, a, b, out: Optional[torch.Tensor], bias, residual):
        # the checks and errors of the other transports (ops/sequential.py), before torch's op
        check_operands(self.OP, a, b, self.world.device)
        W = self.world.world_size
        M, N = a.shape[0], b.shape[1]
        if M % W:
            raise ValueError(f"{self.OP}: M={M} rows must split evenly over {W} ranks")
        if M > self.max_m or N > self.max_n:
            raise ValueError(f"{self.OP}: an [{M}, {N}] result exceeds this context's "
                             f"max_m x max_n = {self.max_m} x {self.max_n}")
        if out is not None:
            out = output_tensor(self.OP, out, (M // W, N), a,
                                dict(a=a, b=b, bias=bias, residual=residual))
        vector_checks(self.OP, a, N, M // W, bias=bias, residual=residual)
        if self.checking_only:
            return out
        if M == 0:  # (torch's op cannot reshape no rows: nothing to reduce, no exchange)
            return _no_rows(out, (0, N), a)
        y = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, self.group_name)
        if out is not None:  # torch's op has no out=: one copy of this rank's rows
            y = out.copy_(y)
        add_epilogue(y, bias, residual)
        return y


def _no_rows(out: Optional[torch.Tensor], shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """The result of a call with no rows on every rank: ``out`` (nothing to write), or an
    empty tensor of ``shape``. torch's fused ops fail on no rows (``fused_matmul_reduce_scatter``
    cannot reshape an empty result); a call with no rows has nothing to exchange, so no
    collective runs. This transport makes no agreement when named: a peer called with rows
    meanwhile waits in torch's op (``docs/reliability.md``); ``"auto"`` agrees first."""
    return out if out is not None else like.new_empty(shape)


class TorchFusedAllGatherMatmul(_TorchFused):
    """The ``"torch_fused"`` transport of AllGather + GEMM (public op ``op``), for shards of at
    most ``max_shard_elems`` elements: each call is ::

        _, [y] = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group, return_A=False)
          # cat([a_0, ..., a_{W-1}]) @ b on every rank, [W*m, N], rank q's rows at q*m
        out.copy_(y)                                               # where out is given

    The input checks and errors are the copy-engine transport's
    (``allgather_gemm.api.check_input``)."""

    def __init__(self, world, op: str, max_shard_elems: int, *, timeout_s: float = 60.0,
                 **options):
        # a shard of the widest dtype, W of them: torch's small-M path gathers every shard into
        # the workspace (where the GPUs have multicast), its other paths only this rank's
        super().__init__(world, op, (max_shard_elems,),
                         world.world_size * max_shard_elems * _WIDEST, timeout_s=timeout_s,
                         **options)
        self.max_shard_elems = max_shard_elems

    @collective_call
    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 schedule: Optional[str] = None) -> torch.Tensor:
        refuse_schedule(TRANSPORT, schedule)
        check_all_gather_input(a, b, self.world, self.max_shard_elems)
        W = self.world.world_size
        if out is not None:
            out = output_tensor(self.OP, out, (W * a.shape[0], b.shape[1]), a, dict(a=a, b=b))
        if self.checking_only:
            return out
        if a.shape[0] == 0:  # (no rows: nothing to gather, as torch's op cannot take them)
            return _no_rows(out, (0, b.shape[1]), a)
        # return_A=False: the gathered a is not kept (one [W*m, K] result less)
        _, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, self.group_name,
                                                             return_A=False)
        return y if out is None else out.copy_(y)  # torch's op has no out=


class TorchFusedGemv(_TorchFused):
    """The ``"torch_fused"`` transport of GEMV + AllReduce (public op ``op``), for outputs of at
    most ``max_n`` columns (and ``gemv_allreduce.api.MAX_M`` rows): each call is ::

        y = symm[:M * N].view(M, N)                 # this context's symmetric buffer, x's dtype
        torch.mm(x, w.T, out=y)                     # x_r [M, K_r] @ w_r[N, K_r].T, input dtype
        torch.ops.symm_mem.one_shot_all_reduce_out(y, "sum", group, out)
          # out = sum_q y_q [M, N] on every rank: each rank reads every peer's buffer

    the BLAS product and the sum in the input dtype, as ``"sequential"`` (cuBLAS then NCCL),
    and torch's one-shot kernel sums the ranks in the same order on every rank. torch's kernel
    takes fp32 and bf16 (``ONE_SHOT_DTYPES``): an fp16 call reduces with the process group's
    ``all_reduce`` instead, as ``"sequential"`` does; a world of one rank multiplies only. The
    input checks and errors are the other transports' (``gemv_allreduce.api.validate``,
    ``check_out``); there are no options.

    The buffer: ``MAX_M * max_n`` fp32 elements from ``symm_mem.empty``, rendezvoused with the
    peers at creation (so no call allocates or exchanges anything, and calls can be captured
    in CUDA graphs), plus a local buffer of the same size for the cases below. torch's kernel
    needs its input and output sizes to be multiples of 4 bytes and stores 16-byte vectors into
    its output, so a call reduces ``M * N`` rounded up to a multiple of 16 bytes (the same
    length on every rank: torch's barriers count the same blocks), straight into ``out`` where
    that is ``M * N`` and ``out`` is 16-byte aligned, else into the local buffer and then one
    copy into ``out``; without ``out``, into a new tensor of the rounded length, ``[:M * N]``
    returned."""

    def __init__(self, world, op: str, max_n: int, *, timeout_s: float = 60.0, **options):
        self.max_n = max_n
        super().__init__(world, op, (max_n,), GEMV_MAX_M * max_n * _WIDEST,
                         timeout_s=timeout_s, **options)

    def _allocate(self, symm_mem) -> None:
        self._symm, self._scratch = {}, {}
        if self.world.world_size == 1:  # nothing to reduce: no buffer
            return
        # MAX_M * max_n fp32 elements: any call's rounded length fits (64 * max_n is a
        # multiple of 4 fp32 and of 8 bf16 elements, so rounding never passes it)
        buf = symm_mem.empty(self.workspace_bytes, dtype=torch.uint8, device=self.world.device)
        symm_mem.rendezvous(buf, self.group_name)
        scratch = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.world.device)
        # Each call hands torch's op a view of ``buf`` at offset 0, in the call's dtype and
        # length. torch finds the symmetric allocation by the storage that holds the tensor
        # and the peers' addresses as the allocation's bases plus the view's storage offset
        # (0 here), so the view reaches the allocation rendezvoused above.
        for dt in ONE_SHOT_DTYPES:
            self._symm[dt] = buf.view(dt)
            self._scratch[dt] = scratch.view(dt)

    @collective_call
    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                 **options) -> torch.Tensor:
        _no_options(self.OP, options)
        # the checks and errors of the other transports (ops/sequential.py), before torch's op
        check_gemv_call(x, w, out, self.world.device, self.max_n)
        if self.checking_only:
            return out
        if self.world.world_size == 1 or x.dtype not in ONE_SHOT_DTYPES:
            return gemv_then_all_reduce(x, w, out, self.world)  # as "sequential" does
        M, N = x.shape[0], w.shape[0]
        if M == 0:  # (no rows: nothing to reduce)
            return _no_rows(out, (0, N), x)
        n = M * N
        per_vector = _VECTOR_BYTES // x.element_size()
        length = -(-n // per_vector) * per_vector
        symm = self._symm[x.dtype]
        torch.mm(x, w.t(), out=symm[:n].view(M, N))
        # past M * N the rounded length holds what an earlier call left there (or nothing
        # written yet): reduced with the rest, never read
        if out is None:
            y = torch.empty(length, dtype=x.dtype, device=x.device)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm[:length], "sum", self.group_name, y)
            return y[:n].view(M, N)
        if length == n and out.data_ptr() % _VECTOR_BYTES == 0:
            torch.ops.symm_mem.one_shot_all_reduce_out(symm[:length], "sum", self.group_name,
                                                       out.view(length))
            return out
        staged = self._scratch[x.dtype][:length]
        torch.ops.symm_mem.one_shot_all_reduce_out(symm[:length], "sum", self.group_name, staged)
        return out.copy_(staged[:n].view(M, N))

    def close(self) -> None:
        """Collective (every rank): the buffers go back to torch's allocators."""
        if self._closed:
            return
        super().close()
        self._symm, self._scratch = {}, {}
