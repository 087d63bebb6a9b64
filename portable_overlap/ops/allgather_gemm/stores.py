"""The ``"stores"`` transport of AllGather + GEMM: one persistent Triton kernel whose first
programs store this rank's shard straight into every peer's heap, all peers at once, while the
other programs multiply the rows that have arrived (kernel.py has the protocol).

Where the copy engines of one GPU serve its peers one copy at a time (docs/scaling.md: about
220 GB/s on 4 and 8 H200s), SM stores go to every peer's link at once; the price is the
programs that send instead of computing (``senders``).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from ...tiles.gemv import dot_precision, dot_upcast
from ...transports.copy_engine import KIND_CONSUMED, KIND_READY, CopyEngineLinks
from ..context import align_key, collective_call, G_MAX, OverlapContext, shape_tag
from ...kept import kept_tensor
from ..matmul.api import (DTYPES, MatmulConfig, check_k_steps, default_config,
                          operand_descriptors)
from .kernel import FLAG_LABELS, allgather_gemm_kernel

OP = "all_gather_matmul"
#: the most row chunks one shard is cut into (flag slots per source rank)
C_MAX = 1024
#: elements a sender moves per step of its copy loop (16 KiB of bf16) unless told otherwise.
#: Steps of 32768 and 65536 were no faster on 4 H200s: the link, not the loads a sender has in
#: flight, bounds it there (docs/scaling.md)
COPY_BLOCK = 8192


def default_senders(world_size: int, sm_count: int) -> int:
    """How many programs send when the caller does not say, at least 8 so that the link, not
    the number of stores in flight, bounds the transfer (on 2x H200, 8 programs stored 123 GB/s
    into a peer, 32 programs 273: ../shared/DESIGN.md).

    - Up to 4 ranks: an eighth of the device's processors (16 of 132). On 4 H200s, 16 beat 24
      (a quarter of the processors times the peers' share of the rows) at four of five shapes
      by 4-17% and lost by 2-3% at 8192^3, and 40 lost at every shape (graph replay, two runs:
      ``docs/scaling.md``). There the GEMM takes as long as the transfer, so processors given
      to the stores slow the GEMM more than they speed the transfer.
    - More ranks: a quarter of the processors times the peers' share of the gathered rows (28
      of 132 on 8 ranks). The transfer takes twice the GEMM there (each rank's GEMM shrinks
      with the world, its bytes out do not), so more senders should pay; not yet measured on
      8 GPUs: pass ``senders`` to try others."""
    if world_size == 1:
        return 0
    if world_size <= 4:
        return max(8, sm_count // 8)
    return max(8, sm_count * (world_size - 1) // (4 * world_size))


def chunk_rows_for(m: int, block_m: int) -> int:
    """Rows per ready flag: one tile row (BLOCK_M) where the shard has at most ``C_MAX`` of
    them, else the smallest multiple of BLOCK_M that keeps the count within ``C_MAX``."""
    tiles = -(-m // block_m)
    return block_m * -(-tiles // C_MAX)


def tile_order(rank: int, world: int, m: int, block_m: int, chunk_rows: int) -> list:
    """The M tiles of the gathered [W*m, K] in the order the compute programs take them: tiles
    inside this rank's rows first (they wait for nothing), then the others by when the last
    chunk they need arrives. Rank q sends chunk-major, peer q+1 first, so chunk c of rank q
    lands here about ``c * W + (rank - q) % W`` units into the call; this rank's own chunks
    (copied into its buffer where tiles straddle two shards) are the first units (-1)."""
    rows_all = world * m
    own_lo, own_hi = rank * m, (rank + 1) * m
    keys = []
    for tm in range(-(-rows_all // block_m)):
        lo, hi = tm * block_m, min(tm * block_m + block_m, rows_all)
        if lo >= own_lo and hi <= own_hi:
            keys.append((-2, tm))
            continue
        last = -1
        for q in range(lo // m, (hi - 1) // m + 1):
            c_hi = (min(hi - q * m, m) - 1) // chunk_rows
            last = max(last, -1 if q == rank else c_hi * world + (rank - q) % world)
        keys.append((last, tm))
    return [tm for _, tm in sorted(keys)]


class AllGatherMatmulStores(OverlapContext):
    """The ``"stores"`` transport's workspace: a gather buffer for ``max_shard_elems`` (m x K
    of the largest call) from every rank, ready flags, the tile counter, the status board.
    Options: ``config`` (the GEMM tiling; default: the device's), ``senders`` (programs that
    send; default: ``default_senders``), ``copy_block`` (elements a sender moves per step, a
    power of two in [1024, 65536]; default ``COPY_BLOCK``), ``join`` (senders compute once
    their units are sent; default True; GPUs only, kernel.py says why), ``pull_share`` (the
    share of every shard's chunks, from its first rows, that the copy engines move instead of
    the senders; default 0), ``pull_pieces`` (copies per peer for that share; default 2) and
    ``bulk_copies`` (senders move boxes of rows through tensor descriptors, the Tensor Memory
    Accelerator writing them into the peer's memory, instead of vector stores, where the
    shard's rows are whole 16-byte units; default False). Alone, 12 to 18 programs of bulk
    copies pushed 264-277 GB/s into 3 peers on 4 H200s, where vector stores needed 24 for
    269-281 (16: 195); inside this kernel, at 16 senders, they measured 0.457 against 0.479 ms
    at 8192x256x8192 (transfer only) but 0.493 against 0.473 at 8192^3, and 12 bulk senders
    were slower at every shape (docs/scaling.md), hence off by default.

    With ``pull_share`` > 0 each rank copies the first ``n_pull`` chunks of its shard into a
    staging buffer of its heap (a copy-engine copy) and tells its peers; every rank pulls
    them from every peer's staging buffer into that peer's rows of its gather buffer (one side
    stream per peer, the
    receiver's copy engine reading over the link), and marks each piece's chunk flags when it
    lands. The kernel's tiles wait for those flags as for the senders', and the senders move
    only the chunks from ``n_pull`` on. The copy engines take no processor, so the aim is to
    add their rate to the senders'; on 4 H200s the sum was slower than the senders alone at
    every shape (docs/scaling.md), hence off by default. A rank restages only after every peer
    pulled the previous call's rows (``pulled``); every wait is bounded
    (transports/copy_engine.py)."""

    OP = OP
    FLAG_LABELS = FLAG_LABELS
    #: the copy-engine side's waits (pull_share > 0) report a kind, not a heap offset
    FLAG_NAMES = {KIND_READY: "rows-staged", KIND_CONSUMED: "rows-pulled"}

    def __init__(self, world, max_shard_elems: int, *, config: Optional[MatmulConfig] = None,
                 senders: Optional[int] = None, copy_block: int = COPY_BLOCK,
                 join: bool = True, pull_share: float = 0.0, pull_pieces: int = 2,
                 bulk_copies: bool = False, timeout_s: float = 10.0):
        W = world.world_size
        if max_shard_elems < 1:
            raise ValueError(f"{OP}: max_shard_elems must be >= 1, got {max_shard_elems}")
        if config is not None and not isinstance(config, MatmulConfig):
            raise TypeError(f"{OP}: config must be a MatmulConfig, got {type(config).__name__}")
        if senders is not None and (not isinstance(senders, int) or not 1 <= senders <= 512):
            raise ValueError(f"{OP}: senders must be an int in [1, 512], got {senders!r}")
        if (not isinstance(copy_block, int) or copy_block & (copy_block - 1)
                or not 1024 <= copy_block <= 65536):
            raise ValueError(f"{OP}: copy_block must be a power of two in [1024, 65536], got "
                             f"{copy_block!r}")
        if not isinstance(join, bool):
            raise TypeError(f"{OP}: join must be a bool, got {type(join).__name__}")
        if (isinstance(pull_share, bool) or not isinstance(pull_share, (int, float))
                or not 0.0 <= pull_share <= 1.0):
            raise ValueError(f"{OP}: pull_share must be a number in [0, 1], got "
                             f"{pull_share!r}")
        if (isinstance(pull_pieces, bool) or not isinstance(pull_pieces, int)
                or not 1 <= pull_pieces <= 64):
            raise ValueError(f"{OP}: pull_pieces must be an int in [1, 64], got "
                             f"{pull_pieces!r}")
        if not isinstance(bulk_copies, bool):
            raise TypeError(f"{OP}: bulk_copies must be a bool, got {type(bulk_copies).__name__}")
        if W > 64:  # the senders keep one bit per peer ("its buffer is free") in an int64
            raise ValueError(f"{OP}: at most 64 ranks, got {W}")
        # the tiling, not the warps and stages: each rank compiles with its own
        world.check_same(f"{OP} context arguments (max_shard_elems, config's tiling, senders, "
                         f"copy_block, join, pull_share, pull_pieces, bulk_copies)",
                         (max_shard_elems, getattr(config, "tiling", None), senders, copy_block,
                          join, float(pull_share), pull_pieces, bulk_copies))
        pulls = float(pull_share) > 0 and W > 1
        super().__init__(world, [
            ("_gather_raw", (W * max_shard_elems,), torch.float32),  # viewed per dtype
            ("ready", (W, C_MAX), torch.int64), ("consumed", (W,), torch.int64),
            ("tile_next", (1,), torch.int64),
            # the copy engines' share: "my rows are staged" (one word per source rank) and "I
            # pulled your staged rows" (one per puller)
            ("avail", (W, 1), torch.int64), ("pulled", (W,), torch.int64),
            # where this rank stages the rows its peers pull, apart from the gather buffer: the
            # gather buffer's rows move with the call's shape, and the senders' stores, this
            # rank's pulls and its own-row copy of the next call wait for nothing of the peers'
            # pulls, so staged rows there could be overwritten while a slower peer still pulls
            # them (it would multiply the next call's bytes)
            ("_stage_raw", (max_shard_elems if pulls else 1,), torch.float32),
        ], timeout_s)
        self.pull_share, self.pull_pieces = float(pull_share), pull_pieces
        self.pulls = pulls
        if self.pulls:
            # the links count the calls in the descriptor's call word (the kernel reads it:
            # begin_call(COUNTED)); one lane stages, one per peer pulls, so a wait for one
            # peer holds back no other's copies
            self._links = CopyEngineLinks(self, self.avail, self.pulled, self.ctx[0:1], lanes=W)
            self.call_protocol(self.ctx, call_flags=(self.ready, self.avail),
                               free_flags=(self.consumed, self.pulled))
        else:
            self.call_protocol(self.ctx, call_flags=(self.ready,), free_flags=(self.consumed,))
        self.max_shard_elems, self.config, self.senders = max_shard_elems, config, senders
        self.copy_block = copy_block
        # on any device: where there is no Tensor Memory Accelerator (AMD, the interpreter)
        # the descriptors' loads and stores are plain ones, which is how CI runs this path
        self.bulk_copies = bulk_copies
        # the interpreter runs programs one after another: a joined sender would wait there
        # for a peer program that has not run (kernel.py)
        self.join = join and world.facts.vendor != "cpu"
        self._gather = {dt: self._gather_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        self._stage = {dt: self._stage_raw.view(torch.uint8).view(dt) for dt in DTYPES}
        # after a call this rank refused or failed, the peers' late stores of it land first
        self.late_stores_guard(self.consumed, "gather-consumed")

    @collective_call
    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 schedule: Optional[str] = None) -> torch.Tensor:
        from .api import check_call, refuse_schedule

        refuse_schedule("stores", schedule)
        out = check_call(a, b, out, self.world, self.max_shard_elems)
        m, K = a.shape
        if m == 0:
            # its flags are per chunk of rows: with no rows none would carry the call's shape
            # tag, and a peer called with rows would wait for this rank until its timeout.
            # Refused before any launch, so every rank raises in this call
            raise ValueError(f"{OP}: the 'stores' transport takes no empty shard (a has 0 "
                             f"rows); the 'copy_engine' and 'sequential' transports return "
                             f"the empty [0, N] result")
        # (a.stride(): whether the shard takes a descriptor, fixed in the plan, depends on it)
        key = (m, K, b.shape[1], a.dtype, a.stride(), b.stride(), align_key(a, b, out))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(a, b, out)
        if not self.pulls:
            plan(self._args(a, b, out, plan))
            return out
        links = self._links
        links.begin()
        self._pull(a, plan)
        plan(self._args(a, b, out, plan))
        links.rejoin()
        return out

    def _pull(self, a: torch.Tensor, plan) -> None:
        """Stage this rank's first ``n_pull`` chunks, pull every peer's (class docstring)."""
        W, r = self.world.world_size, self.rank
        m, K = a.shape
        cr, n_pull, tag = plan.chunk_rows, plan.n_pull, self.call_tag(plan.tag)
        g = self._gathered(m, K, a.dtype)
        links = self._links
        peers = [(r + i) % W for i in range(1, W)]
        rows = min(n_pull * cr, m)
        staged = self._stage[a.dtype][:rows * K].view(rows, K)  # the same place on every rank
        links.follow(0)
        with links.on_side(0):
            for d in peers:  # every peer pulled what the stage held in the previous call
                links.wait_consumed(d)
            links.copy_local(staged, a[:rows])
            for d in peers:
                links.notify(d, 0, tag)
            if plan.copy_own:  # tiles across two shards read this rank's rows from the buffer
                links.copy_local(g[r * m:r * m + rows], a[:rows])
                links.landed(self.ready[r, :n_pull], tag)
        bounds = [n_pull * p // plan.pull_pieces for p in range(plan.pull_pieces + 1)]
        for i, q in enumerate(peers, start=1):  # rank r pulls from r+1 first, r+1 from r+2...
            links.follow(i)
            with links.on_side(i):
                links.wait_ready(q, 0, tag)
                for c0, c1 in zip(bounds, bounds[1:]):
                    if c1 > c0:
                        lo, hi = c0 * cr, min(c1 * cr, m)
                        links.pull(q, g[q * m + lo:q * m + hi], staged[lo:hi])
                        links.landed(self.ready[q, c0:c1], tag)
                links.release(q)

    def _gathered(self, m: int, K: int, dtype) -> torch.Tensor:
        W = self.world.world_size
        return self._gather[dtype][: W * m * K].view(W * m, K)

    def _args(self, a, b, out, plan, tag: Optional[int] = None):
        m, K = a.shape
        a_desc = b_desc = None
        if plan.use_desc:  # per call: they hold a's and b's addresses
            a_desc, b_desc, _ = operand_descriptors(a, b, plan.cfg, self.world.facts)
        return (a, b, out, self._gather[a.dtype], self.ready, self.consumed, self.tile_next,
                self.ctx, plan.order, m, b.shape[1], K, b.stride(0), b.stride(1),
                plan.chunk_rows, plan.n_chunks, plan.n_pull, plan.senders,
                self.call_tag(plan.tag) if tag is None else tag,
                a_desc, plan.g_desc, b_desc)

    def _plan(self, a, b, out):
        m, K = a.shape
        N = b.shape[1]
        W, facts = self.world.world_size, self.world.facts
        # tiles by the gathered product's shape, the same on every rank (``tile_config``); over
        # 8 warps at any tile, since the senders are programs of this launch and move their
        # chunks over its warps
        cfg = self.config or default_config(a.dtype, a.device, W * m, N)
        check_k_steps(self.OP, a, b, cfg)
        chunk_rows = chunk_rows_for(m, cfg.block_m)
        n_chunks = -(-m // chunk_rows)
        copy_own = W > 1 and m % cfg.block_m != 0
        # at least one chunk: every call of a context with pulls stages, pulls and releases,
        # so the "pulled" flags a restaging waits for hold the previous call's number
        n_pull = max(1, round(self.pull_share * n_chunks)) if self.pulls else 0
        n_sent = n_chunks - n_pull
        units = (n_sent if copy_own else 0) + n_sent * (W - 1)
        senders = min(units, self.senders or default_senders(W, facts.sm_count))
        n_tiles = -(-W * m // cfg.block_m) * -(-N // cfg.block_n)
        # with pulls, the links' one-program flag kernels must find a processor while this
        # kernel runs (its tiles wait for their flags), and a program of this kernel can hold a
        # whole processor's registers: one processor per lane stays free. (On 4 H200s a grid
        # of every processor waited for the deadline, call after call, under graph replay.)
        room = facts.sm_count - (W if self.pulls else 0)
        programs = min(senders + n_tiles, max(room, senders + 1), G_MAX)
        es = a.element_size()
        vec = 16 // es if (K * es) % 16 == 0 else 1
        # bulk copies need 16-byte rows and a 16-byte aligned a (the key holds its alignment);
        # boxes of 512-byte rows (the most a box row may hold is 256 elements) and up to 128
        # rows that divide a chunk (a box never holds rows of the next chunk): alone, 64 KiB
        # boxes reached the link's rate with 12 programs on 4 H200s, where 16 KiB boxes needed
        # twice as many (benchmarks/probe_peer_stores.py)
        copy_tma = (self.bulk_copies and W > 1 and vec > 1 and a.data_ptr() % 16 == 0
                    and (K * es) % 16 == 0)
        box_k = min(256, 512 // es)
        box_r = min(128, chunk_rows & -chunk_rows)  # a power of two that divides a chunk
        # descriptors where the device and operands allow, b's transpose where b is one (a
        # column-parallel weight, weight.t()); the plan's key (strides, alignment) fixes them
        a_desc, _, b_trans = operand_descriptors(a, b, cfg, facts)
        # the gather buffer's view of this key has a fixed address: its descriptor is made once
        g_desc = operand_descriptors(self._gathered(m, K, a.dtype), b, cfg, facts)[0]
        use_desc = a_desc is not None and g_desc is not None

        # what _args needs, before the launch is planned and on it afterwards
        p = SimpleNamespace(cfg=cfg, chunk_rows=chunk_rows, n_chunks=n_chunks, n_pull=n_pull,
                            copy_own=copy_own, pull_pieces=min(self.pull_pieces, max(n_pull, 1)),
                            senders=senders, use_desc=use_desc, g_desc=g_desc if use_desc else None,
                            order=kept_tensor(
                                tile_order(self.rank, W, m, cfg.block_m, chunk_rows),
                                torch.int32, a.device))

        def tag_of(g):  # shapes, tiling, grid, senders: a rank planned otherwise is caught
            return shape_tag(m=m, N=N, K=K, dtype=str(a.dtype), tiling=cfg.tiling, programs=g,
                             senders=senders, chunk_rows=chunk_rows, n_pull=n_pull)

        consts = dict(USE_DESC=use_desc, B_TRANS=b_trans, COPY_OWN=copy_own, JOIN=self.join,
                      PULLS=self.pulls, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      NUM_STAGES=cfg.num_stages, EVEN_K=K % cfg.block_k == 0,
                      PRECISION=dot_precision(a.dtype), UPCAST=dot_upcast(a.dtype),
                      COPY_BLOCK=self.copy_block, VEC=vec, C_MAX=C_MAX, COPY_TMA=copy_tma,
                      BOX_R=box_r, BOX_K=box_k, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        plan = self._compile(allgather_gemm_kernel, programs, consts,
                             lambda g: self._args(a, b, out, p, tag_of(g)))
        if plan.programs <= senders:
            raise RuntimeError(f"{OP}: only {plan.programs} programs of this kernel fit on the "
                               f"device at once, not more than senders={senders}: pass fewer "
                               f"senders")
        vars(plan).update(vars(p))
        plan.tag = tag_of(plan.programs)
        return plan
