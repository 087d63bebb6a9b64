"""The fused transports of embedding pooling + All-to-All (``"stores"``, ``"shmem"``): one
persistent kernel pools this rank's tables for every rank's samples and sends each pooled tile to
the rank that owns its samples as soon as it is finished (what the op computes: ``api.py``).

- ``"stores"`` (scale-up) stores each pooled tile straight into the destination's heap;
- ``"shmem"`` (the scale-out design) puts each tile's rows with the SHMEM library of the process
  (NVSHMEM / ROC_SHMEM, shmem/providers), completed (quiet) before the destination's ready flag.

Pooling is accumulated in float32. The destination's kernel copies what its peers sent from its
receive buffer into the output's columns in global table order.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...shmem.providers import agreed_put_provider
from ...kept import kept_tensor, kept_zeros
from ..context import align_key, collective_call, G_MAX, output_tensor, OverlapContext, shape_tag
from ..launch import PlannedLaunch
from .kernel import FLAG_NAMES, embedding_alltoall_kernel, embedding_alltoall_put_kernel
from .tables import BagOffsets, DTYPES, INDEX_DTYPES, OP, RankTables

TRANSPORTS = ("stores", "shmem")


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


def check_tiling(block_b: Optional[int], num_warps: Optional[int],
                 max_programs: Optional[int]) -> None:
    """The fused kernel's tiling arguments (None: the defaults for the call)."""
    if block_b is not None and (not isinstance(block_b, int) or block_b < 1
                                or block_b & (block_b - 1)):
        raise ValueError(f"{OP}: block_b must be a power of two, got {block_b!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{OP}: num_warps must be a power of two <= 16, got {num_warps!r}")
    if max_programs is not None and (not isinstance(max_programs, int)
                                     or not 1 <= max_programs <= G_MAX):
        raise ValueError(f"{OP}: max_programs must be in [1, {G_MAX}], got {max_programs!r}")


class FusedEmbeddingAllToAll(OverlapContext):
    """Workspace of the fused transports on one rank: the sharding plan (on the
    device too), a receive buffer ``[max_local_batch, T * D]`` in the symmetric heap (pooled
    vectors from peers land there, then the kernel copies them into the output), flags, status
    board. Collective to create and to close; the same calls in the same order on every rank, on
    one stream.

    Args:
        world: the :class:`portable_overlap.World`.
        tables: this rank's share of the tables (``RankTables``), checked by the op's context.
        transport: ``"stores"`` or ``"shmem"``.
        timeout_s: how long a kernel waits for a peer before it reports and gives up.
        block_b: bags per tile, a power of two (default: ``default_block_b`` for the call's
            weight dtype).
        num_warps: warps per program (default: ``default_num_warps`` for the dtype).
        max_programs: cap on the persistent grid (default: the programs resident at once).
    """

    OP = OP
    TRANSPORTS = TRANSPORTS
    FLAG_NAMES = FLAG_NAMES

    def __init__(self, world, tables: RankTables, *, transport: str = "stores",
                 timeout_s: float = 10.0, block_b: Optional[int] = None,
                 num_warps: Optional[int] = None, max_programs: Optional[int] = None):
        W = world.world_size
        if transport not in TRANSPORTS:
            raise ValueError(f"{OP}: transport must be one of {TRANSPORTS}, got {transport!r}")
        check_tiling(block_b, num_warps, max_programs)
        world.check_same(f"{OP} tiling (block_b, num_warps, max_programs) and transport",
                         (block_b, num_warps, max_programs, transport))
        plan, max_local_batch = tables.plan, tables.max_local_batch
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
        self.tables, self.plan = tables, plan
        self.max_local_batch = max_local_batch
        self.block_b, self.num_warps = block_b, num_warps  # None: per dtype (tile_for)
        self.max_programs = max_programs
        self.local_tables, self.n_loc = tables.local_tables, tables.n_loc
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
        self._row_off, self._rows = tables.row_off, tables.rows
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
        self._bag_offsets = BagOffsets(dev)

    def close(self) -> None:
        """Collective: also lets the library's symmetric memory go."""
        super().close()
        self._recv = self._stage = self._sym = self._put_kernel = None

    def tile_for(self, dtype: torch.dtype) -> tuple:
        """(bags per tile, warps) of calls with ``dtype`` weights: the context's arguments, else
        the measured defaults for this device (``TUNED_TILE``)."""
        D, arch, nbytes = self.plan.dim, self.world.facts.arch, dtype.itemsize
        return (self.block_b or default_block_b(D, arch, nbytes),
                self.num_warps or default_num_warps(D, arch, nbytes))

    # -- the call ------------------------------------------------------------------------------
    @collective_call
    def __call__(self, weight: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor,
                 per_sample_weights: Optional[torch.Tensor] = None, *,
                 batch_splits: Optional[Sequence[int]] = None, pooling: str = "sum",
                 out: Optional[torch.Tensor] = None,
                 validate: Optional[bool] = None) -> torch.Tensor:
        """Run the op (``api.py``); the flags' tag carries ``records_grad`` (``call_tag``: the
        backward's exchange runs only on the ranks that record the call). ``validate``
        (default: this workspace's ``validate`` attribute, True) also checks the data (index
        ranges, lengths against indices): one host sync per call; skipped during CUDA-graph
        capture. Without it an index outside its table is still found by the kernel (it
        reads nothing outside the table) and raised as ``InvalidInputError`` at the context's
        next check; lengths that do not sum to the number of indices are not reported then,
        but nothing past ``indices`` is read: a negative length counts as 0 and the bags end
        at the last index."""
        splits, checked = self.tables.check(weight, lengths, indices, per_sample_weights,
                                            batch_splits, pooling,
                                            self.validate if validate is None else validate)
        shape = self.tables.output_shape(splits)
        out = output_tensor(OP, out, shape, weight,
                            dict(weight=weight, per_sample_weights=per_sample_weights))
        offsets = self._bag_offsets(lengths, indices.numel(), checked)
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
            t = self._stubs[dtype] = kept_zeros(16, dtype, self.world.device)
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
                programs or plan.programs, self.rank, W,
                self.call_tag(plan.tag if tag is None else tag), self.timeout_us)

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
        info.boff = kept_tensor(boff, torch.int32, self.world.device)
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
