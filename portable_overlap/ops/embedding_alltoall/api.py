"""Fused embedding pooling + All-to-All (DLRM's model-parallel → data-parallel switch):
validation, workspace, launch, backward, and the torch.library op.

What it computes. Tables are sharded table-wise (``ShardingPlan``: global table t, of
``table_rows[t]`` rows × D, is held whole by rank ``table_ranks[t]``); the global batch of
``B = sum(batch_splits)`` samples is split over the ranks, rank d owning samples
``[boff[d], boff[d+1])`` with ``boff = [0, *cumsum(batch_splits)]``. Rank r passes its local
tables packed in one buffer ``weight_r`` ([sum of local rows, D], see ``ShardingPlan``) and the
sparse features of its tables for the WHOLE global batch in KeyedJaggedTensor layout (table-major:
``lengths_r[j * B + s]`` indices of local table j for sample s, ``indices_r`` concatenated in that
order, optional ``per_sample_weights_r`` one per index)::

    local = plan.tables_of(r); offs = [0, *cumsum(lengths_r)]
    pooled_r[j][s] = sum(w[i] * weight_r[row_offsets_r[j] + indices_r[i]]
                         for i in range(offs[j*B + s], offs[j*B + s + 1]))   # / length if mean
    # rank d receives, from every rank r, its tables for d's samples:
    out_d[s - boff[d], t*D:(t+1)*D] = pooled_{table_ranks[t]}[j_t][s]  for boff[d] <= s < boff[d+1]

i.e. ``F.embedding_bag`` per table, ``all_to_all_single``, columns put in global table order
(reference.py). ``out_d`` is ``[batch_splits[d], T * D]`` in the tables' dtype, ready for the
feature interaction. Pooling is accumulated in float32.

Transports (``EmbeddingAllToAll(..., transport=...)``): ``"stores"`` (scale-up, default) stores
each pooled tile straight into the destination's heap; ``"shmem"`` (the scale-out design) puts
each tile's rows with the SHMEM library of the process (NVSHMEM / ROC_SHMEM, shmem/providers),
completed (quiet) before the destination's ready flag.

Backward sends ``grad_out`` back through the reverse All-to-All (``all_to_all_single``) and
accumulates row gradients with ``index_add_`` into a dense gradient of the packed weight (and the
per-index weights' gradient when they require it).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...shmem.providers import agreed_put_provider
from ..context import (align_key, collective_call, G_MAX, get_context, output_tensor,
                       OverlapContext, shape_tag)
from ..launch import PlannedLaunch
from ..registry import OpSpec, check_context, define
from .kernel import FLAG_NAMES, embedding_alltoall_kernel, embedding_alltoall_put_kernel
from .plan import ShardingPlan

OP = "embedding_all_to_all"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
TRANSPORTS = ("stores", "shmem")
POOLINGS = ("sum", "mean")


#: (bags per tile, warps) measured best for the fused op on 2x H200 (sm_90) per (arch, D rounded
#: up to a power of two, bytes per weight element): benchmarks/bench_embedding_alltoall.py --sweep,
#: graph replay, with the device-side index check and the register cap (logs in
#: benchmarks/results/logs/2026-11-24-h200-embedding-moe). fp16 rows are half the bytes, and
#: twice the bags per tile measured faster at every D: (65536, 16, 64, 20) fp16 64 / 8 0.313 ms
#: uniform, 0.261 Zipf, against 0.393 / 0.304 for 128 / 4; fp32 32 / 4 0.565 / 0.433 against
#: 0.654 / 0.482. (16384, 32, 128, 32) fp16 Zipf 32 / 8 0.345 ms against 0.378 for 16 / 8;
#: (4096, 64, 256, 8) fp16 uniform 16 / 8 0.217 ms against 0.234 for 8 / 8. fp32, measured
#: before the index check: D = 128 16 / 8 1.019 ms against 32 / 4 1.110 at (16384, 32, 128, 32)
#: (the gather is latency-bound; 16 / 8 keeps 4 x 8 warps resident), D = 256 8 / 8 0.402 ms
#: against 16 / 4 0.425 at (4096, 64, 256, 8).
TUNED_TILE = {("sm_90", 64, 2): (64, 8), ("sm_90", 64, 4): (32, 4),
              ("sm_90", 128, 2): (32, 8), ("sm_90", 128, 4): (16, 8),
              ("sm_90", 256, 2): (16, 8), ("sm_90", 256, 4): (8, 8)}


def default_block_b(dim: int, arch: str, elem_bytes: int = 4) -> int:
    """Bags per tile: a measured value where there is one, else about 4096 accumulator elements
    per program (32 fp32 registers per thread with 4 warps), i.e. 32 bags of D = 128 — 32
    independent row loads in flight. The interpreter runs a tile as numpy arrays, where larger
    tiles only cost memory: same rule."""
    block_d = triton_next_pow2(dim)
    tuned = TUNED_TILE.get((arch, block_d, elem_bytes))
    return tuned[0] if tuned else max(1, min(64, 4096 // block_d))


def default_num_warps(dim: int, arch: str, elem_bytes: int = 4) -> int:
    """Warps per program: the measured value where there is one, else 4."""
    tuned = TUNED_TILE.get((arch, triton_next_pow2(dim), elem_bytes))
    return tuned[1] if tuned else 4


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class EmbeddingAllToAll(OverlapContext):
    """Workspace of the fused embedding pooling + All-to-All on one rank: the sharding plan (on the
    device too), a receive buffer ``[max_local_batch, T * D]`` in the symmetric heap (pooled
    vectors from peers land there, then the kernel copies them into the output), flags, status
    board. Collective to create and to close; the same calls in the same order on every rank, on
    one stream.

    Args:
        world: the :class:`portable_overlap.World`.
        table_rows: rows of every global table (T entries).
        dim: embedding dimension D (same for all tables).
        max_local_batch: the most samples any rank will own in one call.
        table_ranks: the rank holding each global table (default: ``ShardingPlan.make``).
        timeout_s: how long a kernel waits for a peer before it reports and gives up.
        block_b: bags per tile, a power of two (default: ``default_block_b`` for the call's
            weight dtype).
        num_warps: warps per program (default: ``default_num_warps`` for the dtype).
        max_programs: cap on the persistent grid (default: the programs resident at once).
    """

    OP = OP
    TRANSPORTS = TRANSPORTS
    FLAG_NAMES = FLAG_NAMES

    def __init__(self, world, table_rows: Sequence[int], dim: int, max_local_batch: int, *,
                 table_ranks: Optional[Sequence[int]] = None, timeout_s: float = 10.0,
                 block_b: Optional[int] = None, num_warps: Optional[int] = None,
                 transport: str = "stores",
                 max_programs: Optional[int] = None):
        W = world.world_size
        if transport not in TRANSPORTS:
            raise ValueError(f"{OP}: transport must be one of {TRANSPORTS}, got {transport!r}")
        plan = ShardingPlan.make(table_rows, dim, W, table_ranks)
        if max_local_batch < 1:
            raise ValueError(f"{OP}: max_local_batch must be >= 1, got {max_local_batch}")
        if block_b is not None and (block_b < 1 or block_b & (block_b - 1)):
            raise ValueError(f"{OP}: block_b must be a power of two, got {block_b}")
        if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{OP}: num_warps must be a power of two <= 16, got {num_warps}")
        if max_programs is not None and not 1 <= max_programs <= G_MAX:
            raise ValueError(f"{OP}: max_programs must be in [1, {G_MAX}], got {max_programs}")
        world.check_same(f"{OP} context arguments (plan, max_local_batch, block_b, num_warps, "
                         f"transport, max_programs)",
                         (plan, max_local_batch, block_b, num_warps, transport, max_programs))
        self.transport = transport
        # one rank has no peer to put to: the store kernel serves it; with peers, every rank
        # learns whether all can have the library before any allocates from it
        self._provider = (agreed_put_provider(world, OP, transport)
                          if world.world_size > 1 else None)
        T, D = plan.num_tables, plan.dim
        super().__init__(world, [
            ("_recv_raw", (max_local_batch * T * D,), torch.float32),  # viewed per dtype
            ("sent", (W, G_MAX), torch.int64), ("consumed", (W,), torch.int64),
            ("ctl", (2,), torch.int64),
        ], timeout_s)
        self.call_protocol(self.ctl, call_flags=(self.sent,), free_flags=(self.consumed,))
        # after a call this rank refused or failed, the peers' late stores of it land first
        # (the receive buffer's layout moves with the dtype: they would land in other columns)
        self.late_stores_guard(self.consumed, "recv-consumed", epoch=self.ctl)
        self.plan = plan
        self.max_local_batch = max_local_batch
        self.block_b, self.num_warps = block_b, num_warps  # None: per dtype (tile_for)
        self.max_programs = max_programs
        self.local_tables = plan.tables_of(self.rank)
        self.n_loc = len(self.local_tables)
        self.weight_rows = plan.weight_rows(self.rank)
        dev = world.device
        t_max = max(1, max(len(plan.tables_of(q)) for q in range(W)))
        gtab = torch.zeros(W, t_max, dtype=torch.int32)
        for q in range(W):
            for j, t in enumerate(plan.tables_of(q)):
                gtab[q, j] = t
        self._t_max = t_max
        self._gtab = gtab.to(dev)
        self._ntab = torch.tensor([len(plan.tables_of(q)) for q in range(W)], dtype=torch.int32,
                                  device=dev)
        self._row_off = torch.tensor(plan.row_offsets(self.rank) or [0], dtype=torch.int64,
                                     device=dev)
        self._rows = torch.tensor(plan.local_rows(self.rank) or [1], dtype=torch.int64,
                                  device=dev)
        self._recv = {dt: self._recv_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._stage = self._recv  # the zero-copy transport stages nothing
        self._sym = self._put_kernel = None
        if self._provider is not None:
            # the library's symmetric memory: the receive buffer, then one staging tile per
            # program (one program per SM: the put kernel is not compiled here, so its resident
            # count is unknown, and one per SM is always resident)
            n = max_local_batch * T * D
            tile = max(self.tile_for(dt)[0] * triton_next_pow2(D) * dt.itemsize for dt in DTYPES)
            sym = self._provider.symmetric_empty(4 * n + 256 + world.facts.sm_count * tile)
            self._sym = sym
            self._recv = {dt: sym[:4 * n].view(dt) for dt in DTYPES}
            self._stage = {dt: sym[4 * n + 256:].view(dt) for dt in DTYPES}
            self._put_kernel = self._provider.wrap(embedding_alltoall_put_kernel)
        # stand-ins for absent or empty tensors (the kernel never reads them: masks, constexprs)
        self._stubs = {dt: torch.zeros(16, dtype=dt, device=dev)
                       for dt in (*DTYPES, *INDEX_DTYPES)}
        self.validate = True
        self._offsets = torch.zeros(1, dtype=torch.int64, device=dev)
        self._lengths = torch.zeros(0, dtype=torch.int64, device=dev)  # unchecked, clamped
        # the global table ids of each rank's tables, for the backward's column gather
        self._cols = [torch.tensor(plan.tables_of(q), dtype=torch.int64, device=dev)
                      for q in range(W)]

    def close(self) -> None:
        """Collective: also lets the library's symmetric memory go."""
        super().close()
        self._recv = self._stage = self._sym = self._put_kernel = None

    @property
    def num_tables(self) -> int:
        return self.plan.num_tables

    @property
    def dim(self) -> int:
        return self.plan.dim

    def tile_for(self, dtype: torch.dtype) -> tuple:
        """(bags per tile, warps) of calls with ``dtype`` weights: the context's arguments, else
        the measured defaults for this device (``TUNED_TILE``)."""
        D, arch, nbytes = self.plan.dim, self.world.facts.arch, dtype.itemsize
        return (self.block_b or default_block_b(D, arch, nbytes),
                self.num_warps or default_num_warps(D, arch, nbytes))

    def output_shape(self, batch_splits: Sequence[int]) -> tuple:
        return (int(batch_splits[self.rank]), self.plan.num_tables * self.plan.dim)

    def resolve_splits(self, lengths: torch.Tensor,
                       batch_splits: Optional[Sequence[int]]) -> tuple:
        """``batch_splits`` as a tuple; by default the global batch ``lengths.numel() / n_loc``
        split evenly over the ranks."""
        W = self.world.world_size
        if batch_splits is None:
            if self.n_loc == 0:
                raise ValueError(f"{OP}: rank {self.rank} holds no tables, so the global batch "
                                 f"cannot be read off lengths: pass batch_splits")
            B, rem = divmod(lengths.numel(), self.n_loc)
            if rem or B % W:
                raise ValueError(f"{OP}: lengths has {lengths.numel()} entries: not "
                                 f"{self.n_loc} local tables × a batch that splits evenly over "
                                 f"{W} ranks; pass batch_splits")
            return (B // W,) * W
        splits = tuple(int(n) for n in batch_splits)
        if len(splits) != W or any(n < 0 for n in splits):
            raise ValueError(f"{OP}: batch_splits must be {W} non-negative ints, got "
                             f"{list(batch_splits)}")
        return splits

    # -- the call ------------------------------------------------------------------------------
    @collective_call
    def __call__(self, weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                 per_sample_weights: Optional[torch.Tensor] = None, *,
                 batch_splits: Optional[Sequence[int]] = None, pooling: str = "sum",
                 out: Optional[torch.Tensor] = None,
                 validate: Optional[bool] = None) -> torch.Tensor:
        """Run the op (module docstring). ``validate`` (default: the context's ``validate``
        attribute, True) also checks the data (index ranges, lengths against indices): one host
        sync per call; skipped during CUDA-graph capture. Without it an index outside its
        table is still found by the kernel (it reads nothing outside the table) and raised as
        ``InvalidInputError`` at the context's next check; lengths that do not sum to the
        number of indices are not reported then, but nothing past ``indices`` is read: a
        negative length counts as 0 and the bags end at the last index."""
        splits = self.resolve_splits(lengths, batch_splits)
        self._validate(weight, lengths, indices, per_sample_weights, splits, pooling)
        checked = (self.validate if validate is None else validate) and not _capturing(weight)
        if checked:
            self._validate_data(lengths, indices)
        shape = self.output_shape(splits)
        out = output_tensor(OP, out, shape, weight,
                            dict(weight=weight, per_sample_weights=per_sample_weights))
        # bag offsets: exclusive prefix sum of lengths (no host sync: graph-capturable), in a
        # buffer that grows only when a larger batch first arrives (offsets[0] stays 0)
        if self._offsets.numel() < lengths.numel() + 1:
            self._offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64,
                                        device=lengths.device)
            self._lengths = torch.empty(lengths.numel(), dtype=torch.int64,
                                        device=lengths.device)
        offsets = self._offsets[:lengths.numel() + 1]
        if not checked:
            # Unchecked lengths may be negative or not add up to the number of indices: the
            # kernel would read indices (and per-index weights) past their end, and a bag whose
            # range leaves its tile's checked range (offsets not monotone) would gather rows
            # whose indices nobody checked. A negative length counts as 0 and the offsets stop
            # at len(indices): every bag lies inside indices and inside its tile's index
            # check. Three small device ops, no host sync (graph capture takes this path).
            lengths = torch.clamp(lengths, min=0, out=self._lengths[:lengths.numel()])
        torch.cumsum(lengths, 0, out=offsets[1:])
        if not checked:
            offsets.clamp_(max=indices.numel())
        psw = per_sample_weights
        # everything the JIT specialized the compiled kernel on (dtypes, 16-byte alignment)
        key = (splits, weight.dtype, indices.dtype, None if psw is None else psw.dtype, pooling,
               align_key(weight, out, indices, *(() if psw is None else (psw,))))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(weight, indices, psw, offsets, out, splits,
                                                 pooling)
        args = self._args(weight, indices, psw, offsets, out, plan)
        if self._provider is None:
            plan(args)
        else:  # through the library's launcher (it sets up each compiled module)
            self._put_kernel[(plan.programs,)](*args, **plan.consts)
        return out

    def _stub(self, dtype: torch.dtype) -> torch.Tensor:
        """A small aligned tensor standing in for an absent or empty one (never read: masks and
        constexprs keep the kernel off it)."""
        t = self._stubs.get(dtype)
        if t is None:
            t = self._stubs[dtype] = torch.zeros(16, dtype=dtype, device=self.world.device)
        return t

    def _args(self, weight, indices, psw, offsets, out, plan, tag=None, programs=None):
        W = self.world.world_size
        if weight.numel() == 0:
            weight = self._stub(weight.dtype)
        if indices.numel() == 0:
            indices = self._stub(indices.dtype)
        if psw is None or psw.numel() == 0:
            psw = self._stub(torch.float32 if psw is None else psw.dtype)
        if out.numel() == 0:  # a rank that owns no samples (nothing is stored there)
            out = self._stub(out.dtype)
        B = sum(plan.splits)
        return (weight, indices, psw, offsets, out, self._row_off, self._rows, self._gtab,
                self._ntab,
                plan.boff, self._recv[out.dtype], self._stage[out.dtype], self.sent,
                self.consumed, self.ctl, self.call_clock,
                self.heap.bases, self.status.address, B, self.plan.dim, self.n_loc,
                self.plan.num_tables * self.plan.dim, self._t_max,
                plan.iters_of(programs or plan.programs),
                programs or plan.programs, self.rank, W, plan.tag if tag is None else tag,
                self.timeout_us)

    def _plan(self, weight, indices, psw, offsets, out, splits, pooling):
        W = self.world.world_size
        D = self.plan.dim
        bb, num_warps = self.tile_for(weight.dtype)
        boff = [0]
        for n in splits:
            boff.append(boff[-1] + n)
        most_blocks = max(-(-n // bb) for n in splits)
        most_tables = max(len(self.plan.tables_of(q)) for q in range(W))
        max_tasks = max(1, most_blocks * most_tables)
        consts = dict(BLOCK_B=bb, BLOCK_D=triton_next_pow2(D), HAS_WEIGHTS=psw is not None,
                      MEAN=pooling == "mean", G_MAX=G_MAX, num_warps=num_warps,
                      num_stages=1)
        # On GPUs the grid is capped at the programs resident at once (``_compile``): every
        # program waits for its counterparts on the peers. The interpreter runs programs one
        # after another, each paying for its flag waits: one per emulated SM there.
        sms = self.world.facts.sm_count
        per_sm = 1 if self.world.facts.vendor == "cpu" or self._provider is not None else 64
        # As many programs as are resident: the gather is latency-bound. (Capping the grid at
        # one table's slices, so that the rows in flight come from one table and meet in L2,
        # was measured: the lookup did not get faster, 0.970 vs 0.975 ms, and the fused op got
        # slower with fewer programs, 1.18 vs 1.11 ms, at (16384, 32, 128, 32) fp32 uniform.)
        programs = min(max_tasks, G_MAX, sms * per_sm, self.max_programs or G_MAX)

        class _Info:  # what _args needs before the launch is compiled
            pass

        info = _Info()
        info.splits = splits
        info.boff = torch.tensor(boff, dtype=torch.int32, device=self.world.device)
        info.iters_of = lambda g: -(-max_tasks // g)  # noqa: E731

        # batch split, dtype, pooling, tiling and grid: a rank that differs is caught
        def tag_of(g):
            return shape_tag(batch_splits=splits, dtype=str(weight.dtype), pooling=pooling,
                             bags_per_block=bb, dim=D, programs=g, num_warps=num_warps,
                             table_ranks=tuple(self.plan.table_ranks))

        info.programs, info.tag = programs, tag_of(programs)
        if self._provider is None:
            # the gather is bound by memory latency: more resident programs, more rows in
            # flight (fp16 D = 128: 64 registers by default, 48 under a cap without a spill)
            launch = self._compile(embedding_alltoall_kernel, programs, consts,
                                   lambda g: self._args(weight, indices, psw, offsets, out, info,
                                                        tag_of(g), g), more_resident=True)
        else:  # compiled by the library's launcher on first use (one program per SM)
            launch = PlannedLaunch(embedding_alltoall_put_kernel, None, programs, consts, None)
        launch.splits, launch.boff, launch.iters_of = info.splits, info.boff, info.iters_of
        launch.tag = tag_of(launch.programs)
        return launch

    # -- validation ----------------------------------------------------------------------------
    def _validate(self, weight, lengths, indices, psw, splits, pooling) -> None:
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

    def _validate_data(self, lengths, indices) -> None:
        """Data checks (one host sync): a bad index would read another table's rows or fault."""
        n = int(lengths.sum()) if lengths.numel() else 0
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"{OP}: lengths must be >= 0")
        if n != indices.numel():
            raise ValueError(f"{OP}: lengths sum to {n} but there are {indices.numel()} indices")
        if n == 0:
            return
        B = lengths.numel() // self.n_loc
        per_table = lengths.reshape(self.n_loc, B).sum(1)
        rows = torch.repeat_interleave(self._rows, per_table, output_size=n)
        bad = (indices < 0) | (indices.to(torch.int64) >= rows)
        if bool(bad.any()):
            p = int(bad.nonzero()[0, 0])
            j = int(torch.searchsorted(per_table.cumsum(0), p, right=True))
            raise ValueError(f"{OP}: index {int(indices[p])} at position {p} is out of range for "
                             f"global table {self.local_tables[j]} "
                             f"({self.plan.table_rows[self.local_tables[j]]} rows)")

    # -- backward ------------------------------------------------------------------------------
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
            send = torch.cat([g.index_select(1, self._cols[q]).reshape(-1) for q in range(W)])
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
        n = indices.numel()
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device),
                                      lengths, output_size=n)
        rows = self._row_off[bag // B] + indices.to(torch.int64)
        contrib = g_bag[bag]
        grad_psw = None
        if psw is not None:
            if need_psw_grad:
                grad_psw = (weight[rows].float() * contrib).sum(1).to(psw.dtype)
            contrib = contrib * psw.float()[:, None]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_w.index_add_(0, rows, contrib)
        return grad_w.to(weight.dtype), grad_psw


def _capturing(t: torch.Tensor) -> bool:
    """Whether the current stream of ``t``'s device is being captured into a graph (then no
    host sync is allowed). Asked through the device type's torch module: no vendor named here."""
    fn = getattr(getattr(torch, t.device.type, None), "is_current_stream_capturing", None)
    return bool(fn()) if fn is not None else False


def _setup_context(ctx, inputs, output):
    weight, lengths, indices, psw, splits, pooling, handle = inputs
    ctx.save_for_backward(weight, lengths, indices, psw)
    ctx.splits, ctx.pooling, ctx.handle = list(splits), pooling, handle


def _backward(ctx, grad):
    weight, lengths, indices, psw = ctx.saved_tensors
    need_psw = psw is not None and ctx.needs_input_grad[3]
    grad_w, grad_psw = get_context(ctx.handle).backward(grad, weight, lengths, indices, psw,
                                                        ctx.splits, ctx.pooling, need_psw)
    return grad_w, None, None, grad_psw, None, None, None


EMBEDDING_ALL_TO_ALL = define(OpSpec(
    OP, "(Tensor weight, Tensor lengths, Tensor indices, Tensor? per_sample_weights, "
        "int[] batch_splits, str pooling, int handle) -> Tensor",
    context=EmbeddingAllToAll, transports=TRANSPORTS,
    compile_specs=("portable_overlap.ops.embedding_alltoall.compile_specs",),
    fake=lambda ctx, weight, lengths, indices, psw, batch_splits, pooling: weight.new_empty(
        ctx.output_shape(batch_splits)),
    eager=lambda ctx, weight, lengths, indices, psw, batch_splits, pooling: ctx(
        weight, lengths, indices, psw, batch_splits=batch_splits, pooling=pooling),
    backward=_backward, setup_context=_setup_context))


def embedding_all_to_all(weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                         ctx: EmbeddingAllToAll,
                         per_sample_weights: Optional[torch.Tensor] = None, *,
                         batch_splits: Optional[Sequence[int]] = None,
                         pooling: str = "sum") -> torch.Tensor:
    """Pooled lookups of this rank's tables for every rank's samples, exchanged so that rank r
    gets every table's pooled rows for its own samples; see the module docstring.
    Differentiable (through ``torch.ops.portable_overlap.embedding_all_to_all``) when
    ``weight`` or ``per_sample_weights`` require grad, and one opaque op under
    ``torch.compile``; else the kernel is launched directly (less overhead)."""
    check_context(EMBEDDING_ALL_TO_ALL, ctx)
    splits = list(ctx.resolve_splits(lengths, batch_splits))
    grad = torch.is_grad_enabled() and (
        weight.requires_grad or (per_sample_weights is not None
                                 and per_sample_weights.requires_grad))
    return EMBEDDING_ALL_TO_ALL(ctx, (weight, lengths, indices, per_sample_weights, splits,
                                      pooling), grad=grad)
