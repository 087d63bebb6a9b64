"""Tensor-parallel linear layers whose collective is fused with the GEMM / GEMV: row-parallel
(all-reduce or reduce-scatter after the GEMM) and column-parallel (all-gather before it)."""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from .. import collectives
from ..errors import PortableOverlapError
from ..ops.context import check_sizes
from ..ops.gemv_allreduce import GemvAllReduce, gemv_all_reduce
from ..ops.gemv_allreduce.api import MAX_M
from ..ops.matmul.api import DTYPES as FUSED_DTYPES
from ..ops.matmul_reduce import (MatmulAllReduce, MatmulReduceScatter, matmul_all_reduce,
                                 matmul_reduce_scatter)
from ..world import collective_setup
from .agreement import kind, same_arguments
from .copying import FusedLayerState

REDUCES = ("all_reduce", "reduce_scatter")


def _factory(name: str, world, dtype, device, fused: bool) -> tuple:
    """``(dtype, device)`` of a layer's parameters, as ``nn.Linear``'s factory arguments:
    ``dtype=None`` is torch's default dtype, ``device=None`` the world's device (the only one
    the layer can run on)."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: dtype must be a torch.dtype, got {dtype!r}")
    if fused and dtype not in FUSED_DTYPES:
        raise TypeError(f"{name}: the fused kernels take {[str(d) for d in FUSED_DTYPES]}, not "
                        f"{dtype}; pass one of them as dtype, or fused=False")
    if device is not None:
        want, got = world.device, torch.device(device)
        if got.type != want.type or got.index not in (None, want.index):
            raise ValueError(f"{name}: device={device!r} is not this rank's device {want} (the "
                             f"world's, where its collectives run); leave device=None")
    return dtype, world.device


def _check_context(name: str, arg: str, given, want: type, world, why: str = "") -> None:
    """A context argument of a layer (``ctx``, ``reduce_ctx``) is ``want`` or None: one of
    another op was taken when the layer was made and failed only at the first call of the
    path that uses it (a prefill after any number of decode steps). And it is made on the
    layer's process group: one made on another world of the same size (the data-parallel
    group's, beside the layer's tensor-parallel one) reduced or gathered over other ranks than
    the layer's, a wrong result with no error."""
    if given is None:
        return
    if not isinstance(given, want):
        article = "an" if want.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{name}: {arg} must be {article} {want.__name__}{why} or None, got "
                        f"{type(given).__name__}")
    theirs = getattr(given, "world", world)
    if _group_of(theirs) is not _group_of(world) or theirs.world_size != world.world_size:
        raise ValueError(f"{name}: {arg} was made on another world than the layer's "
                         f"({theirs.world_size} ranks of another process group): its op would "
                         f"combine other ranks' shards than the layer's; make it on the "
                         f"layer's world")


def _check_room(name: str, arg: str, given, **need) -> None:
    """A context argument of a layer is sized for the layer's largest call (each ``attr=need``:
    ``given.attr >= need``). A smaller one was taken when the layer was made and refused only
    the first call of the path that uses it, a prefill after any number of decode steps."""
    if given is None:
        return
    for attr, least in need.items():
        if least is not None and getattr(given, attr) < least:
            raise ValueError(f"{name}: {arg} has {attr}={getattr(given, attr)}, less than the "
                             f"layer's largest call needs ({least}); make it with "
                             f"{attr}={least} or more")


def _group_of(world):
    """The process group of ``world``, None (the default group) as the default group."""
    if world.group is not None:
        return world.group
    return dist.group.WORLD if dist.is_initialized() else None


def _describe(x) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"


def _autocast(x, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """``(x, weight, bias)`` as a call computes with them: under ``torch.autocast`` for the
    input's device type, cast to the autocast dtype, as ``nn.Linear``'s product is there (the
    parameters keep their dtype; autograd takes the gradients back through the casts), else as
    they are."""
    dtype = autocast_dtype(x)
    if dtype is not None:
        return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    return x, weight, bias


def autocast_dtype(x) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` computes a floating-point tensor ``x`` in, or None where
    it is off for ``x``'s device type (or ``x`` is no floating-point tensor). A device type
    autocast does not know (``meta``) counts as off: torch raises a bare ``RuntimeError``
    there, before the layer's own check of the input's device, whose refusal tells the peers
    (they would otherwise pair the call with this rank's next one)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    try:
        on = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(x.device.type) if on else None


def _check_input(name: str, x, weight: torch.Tensor) -> None:
    """The input's dtype and device are the layer's (what ``nn.Linear`` would refuse too,
    outside ``torch.autocast``)."""
    if x.dtype != weight.dtype:
        raise TypeError(f"{name}: input {_describe(x)} must have the layer's dtype "
                        f"{weight.dtype} (convert it, or build the layer with dtype={x.dtype})")
    if x.device != weight.device:
        raise ValueError(f"{name}: input {_describe(x)} is on {x.device}, the layer on "
                         f"{weight.device}")


def _op_call(name: str, x, fn, *args):
    """``fn(*args)``, an op called for a module: an error it raises about the call (bad input,
    a context too small, a peer that disagreed) is raised again with the module's name and the
    input the user passed in front of the op's own message."""
    try:
        return fn(*args)
    except (PortableOverlapError, ValueError, TypeError) as e:
        try:
            renamed = type(e)(f"{name}: input {_describe(x)}: {e}")
            renamed.__dict__.update(e.__dict__)
        except Exception:  # an error class that is not built from one message: keep it as is
            raise e from None
        raise renamed from e


def _refuse_with_peers(call, error: BaseException) -> None:
    """A module's own check of a call failed on this rank, before the fused op it would call:
    ``call`` is ``(context, args)``, the op's context (the one the peers are calling now) and
    the arguments the module would give it, or None where the module cannot tell or runs no
    fused op. The op's call is refused (``PatternContext.refuse``), so that the peers fail it
    at once ("rank r gave up") and stay in step, instead of waiting for this rank until their
    timeout, which breaks the context. The caller raises ``error`` then."""
    if call is None:
        return
    ctx, args = call
    try:
        ctx.refuse(error, *args)
    except Exception:  # noqa: BLE001  (an interrupt still propagates)
        # the refusal raises ``error``, or the context's own error where it is closed or
        # broken: the caller raises ``error`` either way
        pass


def _stand_in(rows: int, cols: int, weight: torch.Tensor) -> torch.Tensor:
    """What a peer with a good input passes the op for a call of ``rows`` rows (a contiguous
    [rows, cols] of the layer's dtype; on the meta device, nothing allocated): the refusal of a
    rank whose input failed the module's check carries it, so that ``"auto"`` finds the call
    key its peers run and refuses that transport's call (``TransportPlanner.refuse``)."""
    return torch.empty((rows, cols), dtype=weight.dtype, device="meta")


# The backwards of the Functions below that run collectives are once_differentiable: the
# collectives write into fresh buffers, which autograd cannot differentiate, so a second
# derivative through them (create_graph=True, as a gradient penalty takes) must raise, and on
# every rank alike, rather than give a wrong gradient or leave one rank in a collective.
def _scatter_rows(full, group, W):
    out = full.new_empty((full.shape[0] // W, full.shape[1]))
    collectives.reduce_scatter(out, full.contiguous(), group=group)
    return out


def _gather_rows(x, group, W):
    full = x.new_empty((W * x.shape[0], x.shape[1]))
    collectives.all_gather(full, x.contiguous(), group=group)
    return full


class _ScatterRows(torch.autograd.Function):
    """``reduce_scatter`` of ``[S, N]`` into rank r's ``[S/W, N]`` row block; its gradient is the
    all-gather of the row blocks' gradients (sequence parallelism's pair of collectives)."""

    @staticmethod
    def forward(ctx, full, group, W):
        ctx.group, ctx.W = group, W
        return _scatter_rows(full, group, W)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, ctx.W), None, None


class _SumOverRanks(torch.autograd.Function):
    """``all_reduce`` (sum) of every rank's ``[S, N]`` partial, in place; its gradient is the
    identity (the output is replicated: each rank's loss term reads it, and the partial of
    rank r enters every rank's output). A Function rather than the bare collective under
    autograd, which torch warns is recorded without a gradient formula (deprecated)."""

    @staticmethod
    def forward(ctx, y, group):
        dist.all_reduce(y, group=group)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherRows(torch.autograd.Function):
    """All-gather of every rank's ``[m, K]`` rows into ``[W * m, K]`` (rank order); its gradient
    is the reduce-scatter of the gathered rows' gradient."""

    @staticmethod
    def forward(ctx, x, group, W):
        ctx.group, ctx.W = group, W
        return _gather_rows(x, group, W)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _scatter_rows(grad, ctx.group, ctx.W), None, None


class _AddReplicatedBias(torch.autograd.Function):
    """``y + bias`` where ``y`` is this rank's row block of a sequence-parallel output and
    ``bias`` is replicated: the loss is the sum of every rank's rows, so the bias gradient is
    the sum of ``dy`` over all ranks' rows (an all-reduce of the local sums, as Megatron does
    for sequence-parallel parameters). The weight's gradient is taken against that same global
    loss (its backward all-gathers ``dy``); with only the local sum, the bias replicas would
    get different gradients and drift apart after an optimizer step."""

    @staticmethod
    def forward(ctx, y, bias, group, W):
        ctx.group, ctx.W = group, W
        return y + bias

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        db = None
        if ctx.needs_input_grad[1]:
            db = dy.sum(0)
            if ctx.W > 1:
                dist.all_reduce(db, group=ctx.group)
        return dy if ctx.needs_input_grad[0] else None, db, None, None


class _RowFused(torch.autograd.Function):
    """A fused row-parallel product ``run(x, weight)`` (``x [rows, in/W]``, ``weight
    [out, in/W]``) with the row-parallel backward. All-reduce (``scattered`` False): every rank
    holds the same output gradient ``dy`` (the all-reduce's gradient is the identity, as in
    Megatron): ``dx = dy @ weight``, ``dweight = dyᵀ @ x``. Reduce-scatter (``scattered``):
    ``dy`` is this rank's row block, and the full ``[S, out]`` gradient is all-gathered first."""

    @staticmethod
    def forward(ctx, x, weight, run, scattered, group, W):
        ctx.save_for_backward(x, weight)
        ctx.scattered, ctx.group, ctx.W = scattered, group, W
        return run(x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if ctx.scattered and ctx.W > 1:
            dy = _gather_rows(dy, ctx.group, ctx.W)
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.T @ x if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


class _ColumnFused(torch.autograd.Function):
    """A fused all-gather + GEMM ``run(x, weight)`` (``x [S/W, in]`` this rank's rows,
    ``weight [out/W, in]``, output ``[S, out/W]``) with its backward: ``dx`` is the
    reduce-scatter of ``dy @ weight`` (every rank's columns feed every row), ``dweight =
    dyᵀ @ all_gather(x)``. The gathered input is gathered again in the backward rather than
    kept from the forward (it lives in the op's workspace, which the next call overwrites; a
    copy would hold ``W`` times the input per layer until the backward, as Megatron avoids)."""

    @staticmethod
    def forward(ctx, x, weight, run, group, W):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.W = group, W
        return run(x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight
            dx = _scatter_rows(dx, ctx.group, ctx.W) if ctx.W > 1 else dx
        if ctx.needs_input_grad[1]:
            full = _gather_rows(x, ctx.group, ctx.W) if ctx.W > 1 else x
            dw = dy.T @ full
        return dx, dw, None, None, None


def _recording(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether autograd records this call (then the fused op runs inside its Function)."""
    return torch.is_grad_enabled() and (module.weight.requires_grad or x.requires_grad)


class _ShardLayout:
    """Mixin of the layers: a state dict carries which shard its weight is (``_extra_state``:
    the layer kind, this rank, the world size and the layer's features, int64), checked before
    anything is copied. Two shards have one shape (rank 0's state dict on rank 1, or a
    row-parallel shard in a column-parallel layer of square features), so the weight would load
    as another rank's columns or rows, with no error. A state dict without it (made by hand
    from a dense checkpoint's slices) is taken as this rank's shard, as a plain module takes
    it."""

    KIND = {"RowParallelLinear": 0, "ColumnParallelLinear": 1}

    def _layout(self) -> torch.Tensor:
        return torch.tensor([self.KIND[self.NAME], self.world.rank, self.world.world_size,
                             self.in_features, self.out_features], dtype=torch.int64)

    def get_extra_state(self) -> torch.Tensor:
        return self._layout()

    def set_extra_state(self, state) -> None:
        """Nothing to set: the layout is checked before any tensor is copied
        (``_load_from_state_dict``)."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "_extra_state"
        if key in state_dict:
            theirs, mine = state_dict[key], self._layout()
            same = (isinstance(theirs, torch.Tensor) and theirs.shape == mine.shape
                    and torch.equal(theirs.detach().to("cpu", torch.int64), mine))
            if not same:
                names = ("layer", "rank", "world size", "in_features", "out_features")
                kinds = {v: k for k, v in self.KIND.items()}

                def words(t):
                    if not isinstance(t, torch.Tensor) or t.shape != mine.shape:
                        return {"layout": t}
                    v = [int(x) for x in t.tolist()]
                    return dict(zip(names, [kinds.get(v[0], v[0]), *v[1:]]))
                there, here = words(theirs), words(mine)
                diff = [k for k in here if there.get(k) != here[k]] or list(there)
                raise ValueError(
                    f"{self.NAME}: the state dict holds another shard ("
                    + ", ".join(f"{k} {there.get(k)!r} there, {here.get(k)!r} here"
                                for k in diff)
                    + "): each rank loads the state dict its own rank saved, into a layer of "
                      "the same kind, features and world size")
        elif prefix + "weight" in state_dict:
            state_dict[key] = self._layout()  # (a hand-made state dict: taken as this shard)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class RowParallelLinear(_ShardLayout, FusedLayerState, nn.Module):
    """Row-parallel linear (Megatron tensor parallelism): rank r holds columns
    ``[r * in_features / W, (r + 1) * in_features / W)`` of the full ``[out, in]`` weight (its
    K-slice, ``self.weight``) and receives the matching slice ``x_r`` of the input activations.
    With ``s = sum over ranks q of x_q @ W_qᵀ`` (the full product)::

        reduce="all_reduce":      y = s + bias                          # [..., out] on every rank
        reduce="reduce_scatter":  y = s[r*S/W:(r+1)*S/W] + bias         # [S/W, out] on rank r

    ``reduce_scatter`` is Megatron's sequence parallelism: ``x_r`` is ``[S, in/W]`` (all ``S``
    rows, this rank's columns), ``S`` a multiple of ``W``, and rank r keeps its row block of the
    summed output. The bias (replicated) is added after the reduction.

    Paths, with ``fused=True`` (the default):

    - ``all_reduce``, up to 64 rows (a decode step): ``gemv_all_reduce``;
    - ``all_reduce``, more rows (prefill): ``matmul_all_reduce`` when the module has a
      ``MatmulAllReduce`` context (``max_rows`` given, or ``reduce_ctx``), else the reference;
    - ``reduce_scatter``, any row count: ``matmul_reduce_scatter``.

    The contexts the module makes take their default transport: ``"auto"`` on a GPU world (the
    fastest of the fused transports and the plain path, timed at each shape's first eager
    call), the first transport on CPU-emulated ranks. Pass ``ctx`` / ``reduce_ctx`` to name one.

    The reference path is ``x_r @ W_rᵀ`` then ``torch.distributed.all_reduce`` /
    ``reduce_scatter_tensor``; it is taken with ``fused=False``.

    Under ``torch.autocast`` (the input's device type) the product runs in the autocast dtype
    on cast copies of the input, weight and bias, as ``nn.Linear``'s does there: an fp32 layer
    takes the bfloat16 output of the layer before it and returns bfloat16.

    Gradients: every path is differentiable in ``x`` and the parameters, with the row-parallel
    backward. With ``all_reduce`` the output gradient is taken to be the same on every rank (each
    rank holds the whole loss, as in Megatron): ``dx_r = dy @ W_r``, ``dW_r = dyᵀ @ x_r``, no
    collective. With ``reduce_scatter`` the loss is the sum of every rank's rows: the row
    blocks' gradients are all-gathered for the weight and input gradients, and the replicated
    bias gets the sum of ``dy`` over all ranks' rows (an all-reduce), the same on every rank.

    ``dtype`` and ``device`` follow ``nn.Linear``: ``None`` means torch's default dtype
    (``torch.get_default_dtype()``) and the world's device. The fused kernels take bfloat16,
    float16 and float32. Inputs must have the layer's dtype and device (outside
    ``torch.autocast``, below); errors raised by a call name the module and the input it was
    given.

    Collective to construct and to :meth:`close` (every rank, same arguments: the ranks compare
    them, and raise ``RankMismatchError`` on every rank where they differ; an argument refused
    on one rank raises ``PeerSetupError`` on the others). ``ctx`` (a ``GemvAllReduce``)
    and ``reduce_ctx`` (a ``MatmulAllReduce`` or, with ``reduce="reduce_scatter"``, a
    ``MatmulReduceScatter``) let layers share workspaces: they are used as given and stay the
    caller's to close; one smaller than the layer's calls (``max_n`` below ``out_features``, a
    ``reduce_ctx``'s ``max_m`` below ``max_rows``) is refused when the layer is made. A
    weight that is not contiguous (a slice of a full matrix) is copied at each call of the
    GEMV path. ``max_rows`` sizes the context the module
    makes itself (results of up to ``max_rows`` x ``out_features``); more rows on a fused GEMM
    path raise ``ValueError``.
    """

    NAME = "RowParallelLinear"

    @collective_setup
    def __init__(self, in_features: int, out_features: int, world, *, bias: bool = False,
                 dtype: Optional[torch.dtype] = None, device=None, fused: bool = True,
                 ctx: Optional[GemvAllReduce] = None, reduce: str = "all_reduce",
                 max_rows: Optional[int] = None, reduce_ctx=None):
        super().__init__()
        # 0 features failed in the weights' initialisation (0 ** -0.5) with a ZeroDivisionError
        check_sizes("RowParallelLinear", in_features=in_features, out_features=out_features)
        W = world.world_size
        if in_features % W:
            raise ValueError(f"RowParallelLinear: in_features={in_features} must divide by the "
                             f"world size {W}")
        if reduce not in REDUCES:
            raise ValueError(f"RowParallelLinear: reduce must be one of {REDUCES}, got {reduce!r}")
        if max_rows is not None:
            check_sizes("RowParallelLinear", max_rows=max_rows)
        if fused and reduce == "reduce_scatter" and max_rows is None and reduce_ctx is None:
            raise ValueError("RowParallelLinear: reduce='reduce_scatter' with fused=True needs "
                             "max_rows (to size its MatmulReduceScatter context) or reduce_ctx")
        _check_context(self.NAME, "ctx", ctx, GemvAllReduce, world)
        _check_context(self.NAME, "reduce_ctx", reduce_ctx,
                       MatmulReduceScatter if reduce == "reduce_scatter" else MatmulAllReduce,
                       world, f" (reduce={reduce!r})")
        _check_room(self.NAME, "ctx", ctx, max_n=out_features)
        _check_room(self.NAME, "reduce_ctx", reduce_ctx, max_n=out_features, max_m=max_rows)
        dtype, device = _factory(self.NAME, world, dtype, device, fused)
        same_arguments(world, self.NAME, in_features=in_features, out_features=out_features,
                       bias=bool(bias), dtype=dtype, fused=bool(fused), reduce=reduce,
                       max_rows=max_rows, ctx=kind(ctx), reduce_ctx=kind(reduce_ctx))
        self.world = world
        self.in_features, self.out_features = in_features, out_features
        self.reduce, self.max_rows = reduce, max_rows
        self.weight = nn.Parameter(torch.empty(out_features, in_features // W, dtype=dtype,
                                               device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) \
            if bias else None
        self.fused = fused
        # the contexts this module made (and frees in close()); given ones stay the caller's
        self._owned = []
        self.ctx = ctx
        if ctx is None and fused and reduce == "all_reduce":
            self.ctx = GemvAllReduce(world, max_n=out_features)
            self._owned.append(self.ctx)
        self.reduce_ctx = reduce_ctx
        # the op the last call ran (by its rows) and how often that changed (_count_op_change)
        self._path, self._op_changes = None, 0
        if reduce_ctx is None and fused and max_rows is not None:
            make = MatmulReduceScatter if reduce == "reduce_scatter" else MatmulAllReduce
            self.reduce_ctx = make(world, max_rows, out_features)
            self._owned.append(self.reduce_ctx)
        with torch.no_grad():
            self.weight.normal_(0.0, (in_features ** -0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = _autocast(x, self.weight, self.bias)
        self._count_op_change(x)
        try:
            self._check(x, weight)
        except (TypeError, ValueError) as e:
            _refuse_with_peers(self._op_call_of(x, weight), e)
            raise
        if self.reduce == "reduce_scatter":
            return self._reduce_scatter(x, weight, bias)
        k = weight.shape[1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        rows = x2.shape[0]
        if self.fused and rows <= MAX_M:
            self._salt(self.ctx)
            # (a weight view that is not contiguous, a slice of a full matrix, is copied at
            # each call: the GEMV kernel streams rows of K; the GEMM paths take any strides)
            y = self._fused(x, x2, weight, lambda a, w: gemv_all_reduce(
                a.contiguous(), w.contiguous(), self.ctx))
        elif self.fused and self.reduce_ctx is not None:
            self._salt(self.reduce_ctx)
            y = self._fused(x, x2, weight, lambda a, w: matmul_all_reduce(a.contiguous(), w.T,
                                                                          self.reduce_ctx))
        else:
            y = x2 @ weight.T
            if self.world.world_size > 1:
                y = _SumOverRanks.apply(y, self.world.group)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features)

    def _count_op_change(self, x) -> None:
        """Count a call whose rows take another op than the call before (GEMV + AllReduce up
        to 64 rows, the GEMM op or the collective library past them), before any check, as
        every peer with these rows counts it. The fused ops' flags carry the count
        (``PatternContext.call_salt``): ranks whose rows fell on both sides of 64 in some call
        wait in different ops, and where one of them gives up and its next call goes to the
        op its peer still waits in, the two calls belong to different steps, and their counts
        differ, so both raise ``RankMismatchError``, where the peer summed this rank's next
        step into its own. Under ``torch.compile`` the traced graph keeps its op and nothing
        is counted (an attribute that changes would retrace it)."""
        if not self.fused or self.reduce != "all_reduce" or not isinstance(x, torch.Tensor) \
                or x.dim() < 1 or torch.compiler.is_compiling():
            return
        rows = math.prod(x.shape[:-1])
        path = 0 if rows <= MAX_M else 1 if self.reduce_ctx is not None else 2
        if path != self._path:
            self._path = path
            self._op_changes += 1

    def _salt(self, ctx) -> None:
        """The context's calls carry this layer's count of op changes (``_count_op_change``);
        set where it differs (a context shared by layers with the same history keeps it)."""
        if not torch.compiler.is_compiling() and ctx.call_salt != self._op_changes:
            ctx.call_salt = self._op_changes

    def _check(self, x, weight: torch.Tensor) -> None:
        """The module's own checks of an input, before any op runs (``weight``: the weight the
        call computes with)."""
        k = weight.shape[1]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"RowParallelLinear: input must be a tensor, got {_describe(x)}")
        if x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"RowParallelLinear: input must be [..., {k}] (this rank's slice of "
                             f"in_features={self.in_features}), got {_describe(x)}")
        _check_input(self.NAME, x, weight)
        if self.reduce == "reduce_scatter":
            W = self.world.world_size
            if x.dim() != 2 or x.shape[0] % W:
                raise ValueError(f"RowParallelLinear(reduce='reduce_scatter'): input must be "
                                 f"[S, {k}] with S a multiple of the world size {W} (rank r "
                                 f"keeps rows [r*S/W, (r+1)*S/W)), got {_describe(x)}")
            if self.fused:
                self._check_rows(x, x.shape[0])
        elif self.fused and self.reduce_ctx is not None and x.numel() // k > MAX_M:
            self._check_rows(x, x.numel() // k)

    def _op_call_of(self, x, weight: torch.Tensor):
        """``(context, args)`` of the fused op a call with input ``x`` and ``weight`` runs, as
        the peers make it where their inputs have ``x``'s rows (``_stand_in``), or None: the
        reference path, or no rows to tell by."""
        if not self.fused or not isinstance(x, torch.Tensor) or x.dim() < 1:
            return None
        rows = math.prod(x.shape[:-1])
        a = _stand_in(rows, weight.shape[1], weight)
        if self.reduce == "reduce_scatter":
            return self.reduce_ctx, (a, weight.T)
        if rows <= MAX_M:
            return self.ctx, (a, weight)
        return None if self.reduce_ctx is None else (self.reduce_ctx, (a, weight.T))

    def _fused(self, x, x2, weight, run, scattered=False):
        """``run(x2, weight)`` (a fused op), inside :class:`_RowFused` when autograd records
        (the reduce-scatter's backward all-gathers the output gradient: its calls carry
        ``records_grad``: ``PatternContext.recording``)."""
        if _recording(self, x):
            # (the all-reduce's backward holds no collective)
            with self.reduce_ctx.recording() if scattered else contextlib.nullcontext():
                return _op_call(self.NAME, x, _RowFused.apply, x2, weight, run, scattered,
                                self.world.group, self.world.world_size)
        return _op_call(self.NAME, x, run, x2, weight)

    def _reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
        W = self.world.world_size
        if self.fused:
            y = self._fused(x, x, weight, lambda a, w: matmul_reduce_scatter(
                a.contiguous(), w.T, self.reduce_ctx), scattered=True)
        else:
            y = x @ weight.T
            if W > 1:
                y = _ScatterRows.apply(y, self.world.group, W)
        if bias is None:
            return y
        if torch.is_grad_enabled() and bias.requires_grad:
            return _AddReplicatedBias.apply(y, bias, self.world.group, W)
        return y + bias

    def _check_rows(self, x: torch.Tensor, rows: int) -> None:
        if self.max_rows is not None and rows > self.max_rows:
            raise ValueError(f"RowParallelLinear: input {_describe(x)} has {rows} rows, more "
                             f"than max_rows={self.max_rows} (the size of its "
                             f"{type(self.reduce_ctx).__name__} context)")

    def close(self) -> None:
        """Collective: free the contexts this module made (not the ones it was given)."""
        while self._owned:
            self._owned.pop().close()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world={self.world.world_size}, reduce={self.reduce}, fused={self.fused}")


class ColumnParallelLinear(_ShardLayout, FusedLayerState, nn.Module):
    """Sequence-parallel column-parallel linear: rank r holds its ``[r * S/W, (r+1) * S/W)``
    rows of the input and rows ``[r * out/W, (r+1) * out/W)`` of the weight, and gets
    ``all_gather(x)[...] @ W_rᵀ + bias_r``, i.e. all ``S`` rows of its ``out_features / world``
    output columns (Megatron's sequence parallelism before a column-parallel layer).

    The gather overlaps the GEMM (``all_gather_matmul`` on the context's transport; the context
    the module makes takes the default, ``"auto"`` on a GPU world and the copy engines on
    CPU-emulated ranks); with ``fused=False``, the reference path (``all_gather_into_tensor``
    then the GEMM). Both are differentiable: ``dx_r`` is rank r's rows of the reduce-scatter of
    ``dy @ W_r`` and ``dW_r = dyᵀ @ all_gather(x)`` (the fused path gathers the input again in
    the backward instead of keeping it; both paths run one reduce-scatter per backward).
    ``dtype`` and ``device`` follow ``nn.Linear`` (``None``: torch's default dtype, the world's
    device); inputs must have the layer's dtype and device (under ``torch.autocast``, the
    product runs in its dtype, as ``RowParallelLinear``'s does), and errors raised by a call
    name the module and the input it was given.
    Collective to construct and to :meth:`close` (every rank, same arguments, compared as
    ``RowParallelLinear`` does); inputs are ``[rows, in_features]`` with the same row count on
    every rank. A ``ctx`` given (an ``AllGatherMatmul`` shared by layers with
    the same ``in_features``) stays the caller's to close; one whose ``max_shard_elems`` is
    below ``max_rows * in_features`` is refused when the layer is made. Measured on GPUs inside
    ``examples/transformer/prefill.py`` (docs/scaling.md); the op alone in
    docs/allgather_gemm.md.
    """

    NAME = "ColumnParallelLinear"

    @collective_setup
    def __init__(self, in_features: int, out_features: int, world, *, max_rows: int,
                 bias: bool = False, dtype: Optional[torch.dtype] = None, device=None,
                 fused: bool = True, ctx=None):
        super().__init__()
        from ..ops.allgather_gemm import AllGatherMatmul

        check_sizes("ColumnParallelLinear", in_features=in_features, out_features=out_features)
        W = world.world_size
        if out_features % W:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} must divide by "
                             f"the world size {W}")
        check_sizes("ColumnParallelLinear", max_rows=max_rows)  # True would size it for a row
        _check_context(self.NAME, "ctx", ctx, AllGatherMatmul, world)
        _check_room(self.NAME, "ctx", ctx, max_shard_elems=max_rows * in_features)
        dtype, device = _factory(self.NAME, world, dtype, device, fused)
        same_arguments(world, self.NAME, in_features=in_features, out_features=out_features,
                       max_rows=max_rows, bias=bool(bias), dtype=dtype, fused=bool(fused),
                       ctx=kind(ctx))
        self.world = world
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // W, in_features, dtype=dtype,
                                               device=device))
        self.bias = nn.Parameter(torch.zeros(out_features // W, dtype=dtype,
                                             device=device)) if bias else None
        self.fused = fused
        self.ctx = ctx if ctx is not None or not fused else \
            AllGatherMatmul(world, max_shard_elems=max_rows * in_features)
        self._owns_ctx = ctx is None and self.ctx is not None
        with torch.no_grad():
            self.weight.normal_(0.0, in_features ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..ops.allgather_gemm import all_gather_matmul

        x, weight, bias = _autocast(x, self.weight, self.bias)
        try:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"ColumnParallelLinear: input must be a tensor, got "
                                f"{_describe(x)}")
            if x.dim() != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"ColumnParallelLinear: input must be [rows, "
                                 f"{self.in_features}], got {_describe(x)}")
            _check_input(self.NAME, x, weight)
        except (TypeError, ValueError) as e:
            call = None
            if self.fused and isinstance(x, torch.Tensor) and x.dim() >= 1:
                call = self.ctx, (_stand_in(math.prod(x.shape[:-1]), self.in_features,
                                            weight), weight.T)
            _refuse_with_peers(call, e)
            raise
        W = self.world.world_size
        if self.fused:
            run = lambda a, w: all_gather_matmul(a.contiguous(), w.T, self.ctx)  # noqa: E731
            if _recording(self, x):
                with self.ctx.recording():  # (the backward reduce-scatters dx)
                    y = _op_call(self.NAME, x, _ColumnFused.apply, x, weight, run,
                                 self.world.group, W)
            else:
                y = _op_call(self.NAME, x, run, x, weight)
        else:
            full = _GatherRows.apply(x, self.world.group, W) if W > 1 else x
            y = full @ weight.T
        return y + bias if bias is not None else y

    def close(self) -> None:
        """Collective: free the context this module made (not one it was given)."""
        if self._owns_ctx:
            self._owns_ctx = False
            self.ctx.close()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"world={self.world.world_size}, fused={self.fused}")
