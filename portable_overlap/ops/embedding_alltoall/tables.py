"""What one rank holds of the table-wise sharded tables, and what every transport of embedding
pooling + All-to-All checks and computes with it: the call's batch split, its input checks (the
same errors whatever the transport), the data checks, and the backward (the reverse All-to-All
and the rows' gradients), which no transport changes."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...kept import GrowingBuffer
from ..context import exact_int
from .plan import ShardingPlan

OP = "embedding_all_to_all"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
POOLINGS = ("sum", "mean")


def even_splits(name: str, lengths, n_loc: int, world_size: int, rank: int) -> tuple:
    """The default batch split: the global batch ``lengths.numel() / n_loc`` (``n_loc`` local
    tables) split evenly over the ranks. Refuses (``name`` is the caller) a rank without tables
    (its global batch cannot be read off its lengths) and a batch that does not split evenly
    (cutting it would drop or mix samples)."""
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name}: lengths must be a tensor, got {type(lengths).__name__}")
    if n_loc == 0:
        raise ValueError(f"{name}: rank {rank} holds no tables, so the global batch cannot be "
                         f"read off lengths: pass batch_splits")
    # (// and %, not divmod: traced by torch.compile the count is a SymInt, which divmod
    # does not take; these keep the batch symbolic, so one graph serves every batch size)
    B, rem = lengths.numel() // n_loc, lengths.numel() % n_loc
    if rem or B % world_size:
        raise ValueError(f"{name}: lengths has {lengths.numel()} entries: not {n_loc} local "
                         f"tables × a batch that splits evenly over {world_size} ranks; pass "
                         f"batch_splits")
    return (B // world_size,) * world_size


class RankTables:
    """Rank ``world.rank``'s share of ``plan``: its tables (``local_tables``, ``n_loc`` of them,
    packed in a weight of ``weight_rows`` rows), each table's first row in that weight
    (``row_off``) and row count (``rows``) on the device, and the largest batch a rank may own
    in one call (``max_local_batch``)."""

    def __init__(self, world, plan: ShardingPlan, max_local_batch: int):
        self.world, self.rank, self.plan = world, world.rank, plan
        self.max_local_batch = max_local_batch
        self.local_tables = plan.tables_of(self.rank)
        self.n_loc = len(self.local_tables)
        self.weight_rows = plan.weight_rows(self.rank)
        dev = world.device
        self.row_off = torch.tensor(plan.row_offsets(self.rank) or [0], dtype=torch.int64,
                                    device=dev)
        self.rows = torch.tensor(plan.local_rows(self.rank) or [1], dtype=torch.int64,
                                 device=dev)
        # the global table ids of each rank's tables, for the backward's column gather
        self.cols = [torch.tensor(plan.tables_of(q), dtype=torch.int64, device=dev)
                     for q in range(world.world_size)]

    def output_shape(self, batch_splits: Sequence[int]) -> tuple:
        n = batch_splits[self.rank]
        return (n if isinstance(n, torch.SymInt) else int(n), self.plan.num_tables * self.plan.dim)

    def resolve_splits(self, lengths: torch.Tensor,
                       batch_splits: Optional[Sequence[int]]) -> tuple:
        """``batch_splits`` as a tuple; by default the global batch ``lengths.numel() / n_loc``
        split evenly over the ranks, refused on every rank where a rank holds no tables."""
        W = self.world.world_size
        if batch_splits is None:
            # refused from the plan, so on every rank: were only the rank without tables to
            # refuse, the sequential transport's peers would wait in its all-to-all
            empty = [q for q in range(W) if not self.plan.tables_of(q)]
            if empty:
                raise ValueError(f"{OP}: rank {empty[0]} holds no tables, so the global batch "
                                 f"cannot be read off its lengths: pass batch_splits")
            return even_splits(OP, lengths, self.n_loc, W, self.rank)
        try:
            # integers only (ints, NumPy ints, integer tensors): int() would round 2.5 down
            # and take True as 1, running the call on another batch than the caller's
            splits = tuple(exact_int(n) for n in batch_splits)
        except TypeError:
            splits = None
        if splits is None or len(splits) != W or any(n is None or n < 0 for n in splits):
            raise ValueError(f"{OP}: batch_splits must be {W} non-negative ints, got "
                             f"{batch_splits!r}")
        return splits

    # -- checks ----------------------------------------------------------------------------------
    def check(self, weight, lengths, indices, psw, batch_splits, pooling,
              validate: bool) -> tuple:
        """Every transport's checks of a call: ``(splits, checked)``, the batch split and
        whether the data were checked (``validate``, never under graph capture: a host sync)."""
        splits = self.resolve_splits(lengths, batch_splits)
        self.check_call(weight, lengths, indices, psw, splits, pooling)
        checked = validate and not capturing(weight)
        if checked:
            self.check_data(lengths, indices)
        return splits, checked

    def check_call(self, weight, lengths, indices, psw, splits, pooling) -> None:
        """The input checks of a call (types, shapes, devices, layout), no data read."""
        dev = self.world.device
        for name, t in (("weight", weight), ("lengths", lengths), ("indices", indices)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{OP}: {name} must be a tensor, got {type(t).__name__}")
        if psw is not None and not isinstance(psw, torch.Tensor):
            raise TypeError(f"{OP}: per_sample_weights must be a tensor or None")
        if weight.dtype not in DTYPES:
            raise TypeError(f"{OP}: weight dtype must be one of {DTYPES}, got {weight.dtype}")
        D = self.plan.dim
        if weight.dim() != 2 or tuple(weight.shape) != (self.weight_rows, D):
            raise ValueError(f"{OP}: weight must be rank {self.rank}'s tables packed as "
                             f"[{self.weight_rows}, {D}] (local tables {self.local_tables}), "
                             f"got {list(weight.shape)}")
        if not weight.is_contiguous():
            raise ValueError(f"{OP}: weight must be contiguous")
        if lengths.dtype not in INDEX_DTYPES or indices.dtype not in INDEX_DTYPES:
            raise TypeError(f"{OP}: lengths and indices must be int32 or int64, got "
                            f"{lengths.dtype}, {indices.dtype}")
        if lengths.dim() != 1 or indices.dim() != 1:
            raise ValueError(f"{OP}: lengths and indices must be 1-D (jagged layout), got "
                             f"{list(lengths.shape)}, {list(indices.shape)}")
        B = sum(splits)
        if lengths.numel() != self.n_loc * B:
            raise ValueError(f"{OP}: lengths has {lengths.numel()} entries, expected local tables "
                             f"{self.n_loc} × global batch {B} = {self.n_loc * B} (table-major)")
        if max(splits) > self.max_local_batch:
            raise ValueError(f"{OP}: batch_splits {list(splits)} exceed this context's "
                             f"max_local_batch={self.max_local_batch}")
        if pooling not in POOLINGS:
            raise ValueError(f"{OP}: pooling must be one of {POOLINGS}, got {pooling!r}")
        if psw is not None:
            if pooling != "sum":
                raise ValueError(f"{OP}: per_sample_weights need pooling='sum' (as in "
                                 f"torch.nn.functional.embedding_bag)")
            if not psw.is_floating_point() or psw.dim() != 1 \
                    or psw.numel() != indices.numel():
                raise ValueError(f"{OP}: per_sample_weights must be a 1-D float tensor with one "
                                 f"weight per index ({indices.numel()}), got {psw.dtype} "
                                 f"{list(psw.shape)}")
        for name, t in (("weight", weight), ("lengths", lengths), ("indices", indices),
                        ("per_sample_weights", psw)):
            if t is not None and t.device != dev:
                raise ValueError(f"{OP}: {name} must be on this rank's device {dev}, got "
                                 f"{t.device}")
        for name, t in (("indices", indices), ("per_sample_weights", psw)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{OP}: {name} must be contiguous")
        if indices.numel() >= 2 ** 31 or lengths.numel() >= 2 ** 31:
            raise ValueError(f"{OP}: at most 2**31 - 1 indices and bags per call")

    def check_data(self, lengths, indices) -> None:
        """Data checks (one host sync): a bad index would read another table's rows or fault."""
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"{OP}: lengths must be >= 0")
        # a bag longer than all the indices is refused before the sum: int64 lengths such as
        # four of 2**62 wrap their sum to 0, which matched the indices' count and sent the
        # kernels reading 2**62 indices past the end (a segfault on emulated ranks)
        if lengths.numel() and int(lengths.max()) > indices.numel():
            raise ValueError(f"{OP}: a length of {int(lengths.max())} exceeds the "
                             f"{indices.numel()} indices")
        n = int(lengths.sum()) if lengths.numel() else 0
        if n != indices.numel():
            raise ValueError(f"{OP}: lengths sum to {n} but there are {indices.numel()} indices")
        if n == 0:
            return
        B = lengths.numel() // self.n_loc
        ends = lengths.reshape(self.n_loc, B).sum(1).cumsum(0)  # each table's last index + 1
        # each index's table by a search over the tables' ends: repeat_interleave would write
        # each table's run from one GPU thread
        table = torch.searchsorted(ends, torch.arange(n, device=indices.device), right=True)
        bad = (indices < 0) | (indices.to(torch.int64) >= self.rows[table])
        if bool(bad.any()):
            p = int(bad.nonzero()[0, 0])
            j = int(table[p])
            raise ValueError(f"{OP}: index {int(indices[p])} at position {p} is out of range for "
                             f"global table {self.local_tables[j]} "
                             f"({self.plan.table_rows[self.local_tables[j]]} rows)")

    # -- backward --------------------------------------------------------------------------------
    def backward(self, grad_out: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor,
                 indices: torch.Tensor, psw: Optional[torch.Tensor], splits: Sequence[int],
                 pooling: str, need_psw_grad: bool = False):
        """Gradients of the packed weight (dense, weight's dtype) and of the per-index weights.

        The reverse All-to-All: rank r sends each rank q the columns of q's tables for r's
        samples; q stacks what it gets into ``[B, n_loc, D]`` (global batch order), then each
        index adds its bag's gradient (× its weight, / length for mean) to its row."""
        W, r, D = self.world.world_size, self.rank, self.plan.dim
        B = sum(splits)
        B_r = splits[r]
        g = grad_out.contiguous().view(B_r, self.plan.num_tables, D)
        if W > 1:
            n_of = [len(self.plan.tables_of(q)) for q in range(W)]
            send = torch.cat([g.index_select(1, self.cols[q]).reshape(-1) for q in range(W)])
            recv = g.new_empty(B * self.n_loc * D)
            dist.all_to_all_single(recv, send,
                                   output_split_sizes=[splits[q] * self.n_loc * D
                                                       for q in range(W)],
                                   input_split_sizes=[B_r * n_of[q] * D for q in range(W)],
                                   group=self.world.group)
            g_loc = recv.view(B, self.n_loc, D)
        else:
            g_loc = g
        g_bag = g_loc.transpose(0, 1).reshape(self.n_loc * B, D).float()  # bag j*B + s
        if pooling == "mean":
            g_bag = g_bag / lengths.clamp_min(1).to(g_bag.dtype)[:, None]
        n, n_bags = indices.numel(), lengths.numel()
        # Each index's bag from the offsets the forward used (``BagOffsets``: lengths clamped
        # to [0, n], ends clamped to n), not by ``repeat_interleave``: in a call made without
        # the data check (``validate=False``, graph capture) lengths that do not add up to the
        # indices' count raised there on the CPU and fault the device on a GPU. An index that
        # no bag holds, or one outside its table (the forward reported it), adds nothing:
        # never to another table's row.
        ends = torch.cumsum(lengths.to(torch.int64).clamp(0, n), 0).clamp_(max=n)
        bag = torch.searchsorted(ends, torch.arange(n, device=lengths.device), right=True)
        held = bag < n_bags
        bag = bag.clamp_(max=max(n_bags - 1, 0))
        table = bag // B
        idx = indices.to(torch.int64)
        held &= (idx >= 0) & (idx < self.rows[table])
        rows = torch.where(held, self.row_off[table] + idx, 0)
        contrib = g_bag[bag] * held[:, None]
        grad_psw = None
        if psw is not None:
            if need_psw_grad:
                grad_psw = (weight[rows].float() * contrib).sum(1).to(psw.dtype)
            contrib = contrib * psw.float()[:, None]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_w.index_add_(0, rows, contrib)
        return grad_w.to(weight.dtype), grad_psw


class BagOffsets:
    """The bags' offsets of a call: the exclusive prefix sum of ``lengths`` (no host sync, so
    graph-capturable), in buffers kept between calls that grow only when a larger batch first
    comes (``kept.GrowingBuffer``: at least doubled, the outgrown ones kept for CUDA graphs
    captured over a smaller batch, whose prefix sum replays into them and whose kernel reads
    the offsets from there). The offsets' buffers are zero-filled when made, so
    ``offsets[0]`` is 0."""

    def __init__(self, device):
        self._offsets = GrowingBuffer(device, torch.int64, zero=True)
        self._lengths = GrowingBuffer(device, torch.int64)  # unchecked lengths, clamped

    @property
    def outgrown(self) -> list:
        return self._offsets.outgrown + self._lengths.outgrown

    def __call__(self, lengths: torch.Tensor, n_indices: int, checked: bool) -> torch.Tensor:
        """``lengths.numel() + 1`` offsets. Unchecked lengths may be negative or not add up to
        the number of indices: a kernel would read indices (and per-index weights) past their
        end, and a bag whose range leaves its tile's checked range (offsets not monotone) would
        gather rows whose indices nobody checked. A negative length counts as 0 and the offsets
        stop at ``n_indices``: every bag lies inside the indices and inside its tile's index
        check. A length above ``n_indices`` counts as ``n_indices``: int64 lengths whose sum
        wraps (four of 2**62 sum to 0) would otherwise give negative offsets. Three small
        device ops, no host sync (graph capture takes this path)."""
        n = lengths.numel()
        offsets = self._offsets.get(n + 1)
        if not checked:
            # copy_ casts int32 lengths to the int64 buffer (clamp's out= must match its input's
            # dtype); the prefix sum then runs in int64 whatever the input's dtype
            lengths = self._lengths.get(n).copy_(lengths).clamp_(min=0, max=n_indices)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if not checked:
            offsets.clamp_(max=n_indices)
        return offsets


def capturing(t: torch.Tensor) -> bool:
    """Whether the current stream of ``t``'s device is being captured into a graph (then no
    host sync is allowed). Asked through the device type's torch module: no vendor named here."""
    fn = getattr(getattr(torch, t.device.type, None), "is_current_stream_capturing", None)
    return bool(fn()) if fn is not None else False
