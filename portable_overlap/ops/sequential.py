"""The plain path as a transport of the GEMM patterns (``transport="sequential"``): the vendor
BLAS (``torch.matmul``) on this rank's operands, then the collective of the world's process
group (NCCL / RCCL on GPUs, gloo on emulated ranks) on the whole product, then bias and
residual: each op's reference with the product in the input dtype
(``gemm_signal/reference.py``); for AllGather + GEMM the gather first, then the product.
Nothing overlaps. It is the baseline every fused transport is
measured against, the choice where a fused transport measured slower (the copy-engine
transports on 4 and 8 GPUs: ``docs/scaling.md``), and always a candidate of
``transport="auto"`` unless the user's ``candidates=`` leaves it out (``ops/planner.py``).

The collective library matches calls by byte count alone: a rank that skips a call is not told
apart from a late one (its peers wait until the process group's own timeout; ``timeout_s`` is
checked but the group's timeout applies), and operands of other shapes with as many bytes move
without an error. So every call of the GEMM patterns' contexts, named ``"sequential"`` or
picked by ``transport="auto"``, first agrees with the peers' with a deadline on the call
board, the sizes the collective moves compared at each new size (``pattern.GEMM_AGREED``,
``ops/planner.py``): a call refused or sized otherwise on one rank raises on every rank before
any collective runs. Input is checked exactly as the fused transports check it, with the same
errors."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import collectives
from .allgather_gemm.api import check_call as check_all_gather_call
from .allgather_gemm.api import check_input as check_all_gather_input, refuse_schedule
from .context import ContextBase, collective_call, output_tensor
from .gemm_signal.reference import epilogue
from .matmul.api import check_operands, vector_checks

#: the rows of rank r's result for an [M, N] product, per pattern
_ROWS = {"all_reduce": lambda M, W: M, "reduce_scatter": lambda M, W: M // W,
         "all_to_all": lambda M, W: M}


def _no_options(op: str, options: dict) -> None:
    """The sequential transport has no options: name the ones given (a fused transport's, say)."""
    # an option given as None is not given (as ``"auto"`` takes it: ``config=None`` from a
    # caller with no configuration to pass)
    options = {k: v for k, v in options.items() if v is not None} if options else options
    if options:
        raise ValueError(f"{op}: the 'sequential' transport takes no options; got "
                         f"{sorted(options)}")


class SequentialMatmul(ContextBase):
    """The ``"sequential"`` transport's workspace for the public op ``op`` (errors name it):
    none but the sizes, ``max_m`` x ``max_n``, that the pattern's context was made for."""

    def __init__(self, world, op: str, max_m: int, max_n: int, *, timeout_s: float = 60.0,
                 **options):
        self.OP = op
        _no_options(op, options)
        super().__init__(world, timeout_s)
        self.max_m, self.max_n = max_m, max_n
        self.register()

    def all_reduce(self, a, b, out=None, *, bias=None, residual=None, **options) -> torch.Tensor:
        """``sum_q a_q @ b_q (+ bias + residual)`` [M, N] on every rank."""
        _no_options(self.OP, options)
        return self._call("all_reduce", a, b, out, bias, residual)

    def reduce_scatter(self, a, b, out=None, *, bias=None, residual=None,
                       **options) -> torch.Tensor:
        """Rows ``[r*M/W, (r+1)*M/W)`` of ``sum_q a_q @ b_q`` (+ bias + residual) on rank r."""
        _no_options(self.OP, options)
        return self._call("reduce_scatter", a, b, out, bias, residual)

    def all_to_all(self, a, b, out=None, *, bias=None, residual=None, **options) -> torch.Tensor:
        """``all_to_all_single(a @ b)`` with equal splits (+ bias + residual) on every rank."""
        _no_options(self.OP, options)
        return self._call("all_to_all", a, b, out, bias, residual)

    @collective_call
    def _call(self, kind: str, a, b, out: Optional[torch.Tensor], bias, residual):
        check_operands(self.OP, a, b, self.world.device)
        W = self.world.world_size
        M, N = a.shape[0], b.shape[1]
        if kind != "all_reduce" and M % W:
            raise ValueError(f"{self.OP}: M={M} rows must split evenly over {W} ranks")
        if M > self.max_m or N > self.max_n:
            raise ValueError(f"{self.OP}: an [{M}, {N}] result exceeds this context's "
                             f"max_m x max_n = {self.max_m} x {self.max_n}")
        rows = _ROWS[kind](M, W)
        if out is not None or not self.checking_only:  # (a check makes no output)
            out = output_tensor(self.OP, out, (rows, N), a,
                                dict(a=a, b=b, bias=bias, residual=residual))
        vector_checks(self.OP, a, N, rows, bias=bias, residual=residual)
        if self.checking_only:
            return out
        return _into(kind, a, b, out, self.world.group, W, bias, residual)  # (out contiguous)


def _into(kind: str, a, b, out: torch.Tensor, group, W: int, bias, residual) -> torch.Tensor:
    """The pattern's reference computation (``gemm_signal/reference.py``: the product in the
    input dtype, the collective, then bias and residual) with ``out`` as the product's or the
    collective's own output. The reference's result copied into ``out`` moved the [M, N]
    rows' bytes twice more, and ``"auto"`` timed the plain path with that copy: on one H100
    at 4096 x 4096 x 4096 bf16 it measured this transport at 0.194 ms where torch.matmul and
    the all-reduce alone took 0.173, and picked a fused transport 8 % slower than the latter
    (``benchmarks/bench_matmul_reduce.py``, a world of one)."""
    if kind == "all_reduce":
        torch.matmul(a, b, out=out)
        if W > 1:
            dist.all_reduce(out, group=group)
    else:
        c = a @ b
        if W == 1:
            out.copy_(c)
        elif kind == "reduce_scatter":
            collectives.reduce_scatter(out, c, group=group)
        else:
            dist.all_to_all_single(out, c, group=group)
    if bias is not None or residual is not None:
        out.copy_(epilogue(out, bias, residual))
    return out


class SequentialAllGatherMatmul(ContextBase):
    """The ``"sequential"`` transport of AllGather + GEMM (public op ``op``): a gather buffer of
    ``world_size * max_shard_elems`` elements, made once; each call gathers the shards into it
    with the vendor library's ``all_gather_into_tensor`` and multiplies: ``out = cat(a_0, ...,
    a_{W-1}) @ b``. Its input checks and errors are the copy-engine transport's
    (``allgather_gemm.api.check_call``)."""

    def __init__(self, world, op: str, max_shard_elems: int, *, timeout_s: float = 60.0,
                 **options):
        self.OP = op
        _no_options(op, options)
        super().__init__(world, timeout_s)
        self.max_shard_elems = max_shard_elems
        # 4 bytes per element: room for a shard of any dtype the op takes (made once, so a
        # call allocates nothing and can be captured in a graph)
        self._gather = torch.empty(world.world_size * max_shard_elems * 4, dtype=torch.uint8,
                                   device=world.device)
        self.register()

    @collective_call
    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 schedule: Optional[str] = None) -> torch.Tensor:
        refuse_schedule("sequential", schedule)
        if self.checking_only and out is None:  # (a check makes no output)
            check_all_gather_input(a, b, self.world, self.max_shard_elems)
            return None
        out = check_all_gather_call(a, b, out, self.world, self.max_shard_elems)
        if self.checking_only:
            return out
        W = self.world.world_size
        m, K = a.shape
        full = self._gather[:W * m * K * a.element_size()].view(a.dtype).view(W * m, K)
        if W > 1:
            collectives.all_gather(full, a, group=self.world.group)
        else:
            full.copy_(a)
        return torch.matmul(full, b, out=out)


class SequentialGemv(ContextBase):
    """The ``"sequential"`` transport of GEMV + AllReduce (public op ``op``): ``torch.mm(x,
    w.T)`` in the input dtype, then the vendor library's ``all_reduce`` of the [M, N] product,
    into ``out`` (or a new tensor). Input is checked as the fused transports check it
    (``gemv_allreduce.api.validate``), N against the ``max_n`` the context was made for."""

    def __init__(self, world, op: str, max_n: int, *, timeout_s: float = 60.0, **options):
        self.OP = op
        _no_options(op, options)
        super().__init__(world, timeout_s)
        self.max_n = max_n
        self.register()

    @collective_call
    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None,
                 **options) -> torch.Tensor:
        _no_options(self.OP, options)
        check_gemv_call(x, w, out, self.world.device, self.max_n)
        if self.checking_only:
            return out
        return gemv_then_all_reduce(x, w, out, self.world)


def check_gemv_call(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor], device,
                    max_n: int) -> None:
    """The input checks every GEMV + AllReduce transport makes, with the fused ones' errors
    (``gemv_allreduce.api.validate``, ``check_out``)."""
    from .gemv_allreduce.api import check_out, validate

    validate(x, w, device, max_n)
    if out is not None:
        check_out(out, x.shape[0], w.shape[0], x, w)


def gemv_then_all_reduce(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor],
                         world) -> torch.Tensor:
    """``torch.mm(x, w.T)`` in the input dtype into ``out`` (made if None), then the process
    group's ``all_reduce`` of it (none on a world of one rank)."""
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    torch.mm(x, w.t(), out=out)
    if world.world_size > 1:
        dist.all_reduce(out, group=world.group)
    return out
