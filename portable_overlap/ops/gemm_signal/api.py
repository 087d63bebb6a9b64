"""GEMM with tile-group signals: the output of one persistent GEMM travels through ORDINARY
collectives (torch.distributed: the vendor's collective library, or gloo), one per wave group,
each started by a stream wait on the group's counter as soon as the GEMM has finished the
group's tiles.

What the ops compute, with ``a_r [M, K_r]``, ``b_r [K_r, N]`` the tensors rank r passes
(W ranks, the K dimension split over them)::

    c = sum_r a_r @ b_r                                  # [M, N]
    gemm_all_reduce:       out = c (+ bias + residual)                   # [M, N] on every rank
    gemm_reduce_scatter:   out = c[r*M/W:(r+1)*M/W] (+ bias + residual)  # [M/W, N] on rank r
    gemm_all_to_all_signal (no sum; c_q = a_q @ b_q on rank q, each [M, N]):
        out[q*M/W:(q+1)*M/W] = c_q[r*M/W:(r+1)*M/W]       # [M, N] on rank r, for every source q
        i.e. torch.distributed.all_to_all_single(out, a @ b)

``bias`` [N] and ``residual`` (the shape of ``out``) are optional and fused into the reorder.
With ``rms_weight`` [N] the reorder also normalizes whole rows and the op returns
``(out, normed)``::

    out = collective(...) (+ bias + residual)          # h, rounded once from fp32
    normed = h * rsqrt(mean(h**2, -1) + eps) * rms_weight   # from h in fp32

One call, on rank r (see docs/gemm_signal.md):

1. the comm stream forks from the caller's stream (so it sees every earlier write);
2. the GEMM is launched on the caller's stream with a grid that leaves ``reserve_sms`` SMs free
   for the collectives' kernels (none by default); each finished tile goes to its staging slot
   and bumps its group's counter;
3. per group g, on the comm stream: ``stream_wait_value(count[g] >= size_g)`` (no CPU polling),
   ``stream_write_value(count[g], 0)`` (the waiter resets its own counter: see below), then the
   collective on the group's contiguous staging chunk;
4. the caller's stream waits for the comm stream, and the reorder kernel writes ``out``.

Counters are reset by the waiter instead of compared with an epoch because a CUDA graph replays
the captured wait *values*: with epochs, every replay would wait for the captured call's epoch,
which earlier replays already passed, and read unfinished tiles. The reset is stream-ordered:
it follows the wait (all ``size_g`` bumps of this call have landed, there are no more), and the
next call's GEMM runs after the caller's stream joined the comm stream.

The first call of each shape runs unguarded (the comm stream waits for the whole GEMM through an
event) and synchronizes: it loads every kernel involved (GEMM, reorder, the collectives' own
kernels) before any stream is ever held by a value wait — with lazy module loading, a first
launch while a stream is held deadlocks (docs/lessons.md) — and it checks that every rank planned
the same partition and tiling (a host collective, so never inside a CUDA-graph capture).

Status: correct on CPU-emulated ranks (2, 4 and 8) and on 2 and 4 H200s
(``tests/gpu/check_gemm_signal.py``), compiled for sm_90 and gfx942; slower than cuBLAS + NCCL
in sequence there (0.91-1.00x), because NCCL's kernels barely progress beside the persistent
GEMM; the copy-engine variant (copy_engine.py) overlaps (docs/gemm_signal.md gives the numbers).
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Optional

import torch
import torch.distributed as dist

from ... import collectives
from ...errors import PeerTimeoutError, RankMismatchError
from ...schedule import WaveGroups, default_partition, grouped_tile, tile_layout
from ...tiles.gemv import dot_precision, dot_upcast
from ...transports.gate import wait_counter
from ..context import ContextBase, align_key, collective_call, output_tensor, shape_tag
from ...kept import GrowingBuffer, kept_tensor
from ..launch import PlannedLaunch, resident_programs
from ..matmul.api import (check_2d, check_k_steps, check_operands, default_config,
                          tile_descriptors, vector_checks)
from .config import KINDS, MAX_GROUPS, OP, RESERVE_PER_132, SignalConfig  # noqa: F401
from .kernel import gemm_signal_kernel, signal_reorder_kernel, signal_reorder_norm_kernel
from . import tune as tuning


#: the staging or receive bytes of a context that has planned nothing yet
_NO_BYTES = torch.empty(0, dtype=torch.uint8)


class _Plan:
    """Everything one (kind, shape, dtype, tiling, partition) needs, agreed by every rank."""


class GemmSignal(ContextBase):
    """Workspace of the tile-group-signal ops on one rank: the group counters (device int32), the
    staging and receive buffers (grown when a new shape is planned, never inside a call), the
    comm stream and the plans. Collective to create; the same calls in the same order on every
    rank. ``config`` is the default of every call (a call may pass its own).

    The collectives run in a process group of the context's own, whose timeout is
    ``timeout_s``: a rank that skips a call, or calls with other shapes, makes the others'
    collectives give up after ``timeout_s`` instead of the default group's (10 to 30 minutes).
    A group's collective waits for the slowest rank's GEMM, hence a longer default than the
    other contexts' (the CPU interpreter's GEMMs take seconds). Under gloo
    (the CPU-emulated backend) the call then raises :class:`PeerTimeoutError` and the context is
    broken; under NCCL the communicator's watchdog enforces the timeout (torch's
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` decides what it does then: by default it ends the
    process with the collective named). ``collectives=False`` makes no group (a context that
    only borrows the GEMM, as the copy-engine transport does).

    Its calls (``all_reduce``, ``reduce_scatter``, ``all_to_all``) have the guards of every
    context (``ContextBase``): closed, broken, a second thread. Nothing runs on the device
    before a call's checks pass, so a refused call leaves no collective for the peers to wait
    on: they time out in that call's collective instead (``timeout_s``) and raise
    :class:`PeerTimeoutError`."""

    OP = OP
    collective_init = True  # the config's agreement

    def __init__(self, world, *, config: Optional[SignalConfig] = None, timeout_s: float = 60.0,
                 collectives: bool = True):
        super().__init__(world, timeout_s)
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        world.check_same(f"{OP} context config", (config, self.timeout_s))
        self.size = world.world_size
        self.config = config or SignalConfig()
        self.device = world.device
        self.backend = world.backend
        # the backend's gate words (GateWords): its stream waits may need them from special
        # memory, each word its own allocation; word g counts group g's tiles
        self.counters = self.backend.alloc_gate_words(MAX_GROUPS, self.device)
        # staging and receive bytes, grown at a plan that needs more (kept.GrowingBuffer)
        self._stage_buf = GrowingBuffer(self.device)
        self._recv_buf = GrowingBuffer(self.device)
        self._plans: dict = {}
        self._launches: dict = {}
        self._tuned: dict = {}  # (kind, shape, dtype, config) -> the tuned config
        if self.device.type == "cpu":  # the interpreter and gloo run synchronously: no streams
            self._mod, self.comm_stream, self._comm_handle = None, None, None
        else:
            self._mod = torch.get_device_module(self.device)
            self.comm_stream = self._mod.Stream(device=self.device)
            with self._mod.stream(self.comm_stream):
                self._comm_handle = self.backend.current_stream(self.device)
        self._collectives = collectives
        # made or agreed now, by every rank (collective), never inside a call
        self._sig_group = _bounded_group(world) if collectives else None
        self.register()

    def close(self) -> None:
        """Collective (every rank): also hands the group counters back to the backend, which
        may have made each its own allocation (``GateWords.close``)."""
        if self._closed:
            return
        super().close()
        self.counters.close()

    # -- the ops -----------------------------------------------------------------------------
    @collective_call
    def all_reduce(self, a, b, out=None, *, bias=None, residual=None, config=None,
                   rms_weight=None, eps=1e-6, normed=None):
        return self.run("all_reduce", a, b, out, bias, residual, config, rms_weight, eps,
                        normed)

    @collective_call
    def reduce_scatter(self, a, b, out=None, *, bias=None, residual=None, config=None,
                       rms_weight=None, eps=1e-6, normed=None):
        return self.run("reduce_scatter", a, b, out, bias, residual, config, rms_weight, eps,
                        normed)

    @collective_call
    def all_to_all(self, a, b, out=None, *, bias=None, residual=None, config=None,
                   rms_weight=None, eps=1e-6, normed=None):
        return self.run("all_to_all", a, b, out, bias, residual, config, rms_weight, eps,
                        normed)

    def phases(self, kind: str, a, b, out, *, config: Optional[SignalConfig] = None) -> dict:
        """Collective (plans the call, as the op's first call does): the two kernels of one
        ``kind`` call on these tensors without the collectives between them, to time them apart
        (the wave-group predictor's calibration). Returns::

            gemm()     # the signal GEMM on the current stream: a, b -> staging,
                       # counters += 1 per tile
            reorder()  # the reorder: whatever the receive buffer holds -> out (no bias/residual)
            reset()    # counters = 0: call it after the last gemm() and before the next op call
            programs   # the GEMM's grid: resident programs, the tiles of one wave
            n_tiles, dests, tile_bytes  # staged tiles, destinations, bytes of one staged tile
            groups     # the partition the op plans for this config (WaveGroups)

        gemm() bumps the same counters the op's stream waits read, so an op call after gemm()
        without reset() would pass its waits early."""
        op, cfg, M, N, K, out_rows = self.check_call(kind, a, b, config)
        check_2d(op, "out", out, (out_rows, N), a)
        plan = self.plan_call(kind, op, M, N, K, a.dtype, cfg)
        gemm, reorder = self.launch_plan(plan, a, b, out, None, None, None, None)
        stage = self.stage_raw[:plan.stage_bytes].view(a.dtype)
        recv = self._recv_raw[:plan.recv_bytes].view(a.dtype) if plan.recv_bytes else stage
        gemm_args = signal_gemm_args(plan, a, b, stage, self.counters, gemm.programs,
                                     self.world.facts)
        reorder_args = _reorder_args(plan, recv, out, None, None)
        return {"gemm": lambda: gemm(gemm_args), "reorder": lambda: reorder(reorder_args),
                "reset": lambda: self.counters.zero_(), "programs": gemm.programs,
                "n_tiles": plan.groups.n_tiles, "dests": plan.dests,
                "tile_bytes": plan.tile_elems * a.element_size(), "groups": plan.groups}

    def tune(self, kind: str, a, b, *, config: Optional[SignalConfig] = None, top_k: int = 4,
             iters: int = 20, graph: Optional[bool] = None, cache=None) -> SignalConfig:
        """Collective: a config whose wave-group partition measured fastest for ``kind`` on
        tensors shaped like ``a`` and ``b`` among the predictor's ``top_k``, one group and the
        default; cached per shape and device, the same on every rank (``tune.py``). Pass it to
        the op: ``matmul_all_reduce(a, b, ctx, config=ctx.impl.tune("all_reduce", a, b))``
        with ``ctx = MatmulAllReduce(world, M, N, transport="signal_collective")``."""
        return tuning.tune_partition(self, kind, a, b, config=config, top_k=top_k,
                                     iters=iters, graph=graph, cache=cache)

    # -- one call ------------------------------------------------------------------------------
    def check_call(self, kind, a, b, config):
        """What every call of ``kind`` checks first: (op name, config, M, N, K, rows of out)."""
        self.check()
        op = KINDS[kind]
        check_operands(op, a, b, self.device)
        M, K = a.shape
        N = b.shape[1]
        if kind != "all_reduce" and M % self.size:
            raise ValueError(f"{op}: M={M} rows must split evenly over {self.size} ranks")
        cfg = config or self.config
        if not self.checking_only:  # (a check runs no tuner: its calls are collective)
            cfg = self._resolve(kind, a, b, cfg)
        check_k_steps(op, a, b, cfg.matmul or default_config(a.dtype, self.device))
        return op, cfg, M, N, K, M // self.size if kind == "reduce_scatter" else M

    def _resolve(self, kind, a, b, cfg: SignalConfig) -> SignalConfig:
        """``cfg`` with a ``"tune"`` partition replaced by the tuner's pick for this shape (tuned
        at the shape's first call, then remembered: no collective in later calls). Keyed as the
        plans are, not by K (``plan_call``): a reduction's K shard may change on one rank
        while its peers' stays, and a key holding it would tune (collective) on that rank
        alone, its collectives paired with its peers' call."""
        if cfg.partition != "tune":
            return cfg
        key = (kind, a.shape[0], b.shape[1], a.dtype, cfg)
        got = self._tuned.get(key)
        if got is None:
            if self.capturing():
                raise RuntimeError(f"{KINDS[kind]}: call it once with these shapes outside graph "
                                   f"capture first (partition='tune' tunes at the first call)")
            got = self._tuned[key] = self.tune(kind, a, b, config=cfg)
        return got

    def run(self, kind, a, b, out, bias, residual, config, rms_weight=None, eps=1e-6,
            normed=None):
        """One call of ``kind`` (``all_reduce``, ``reduce_scatter``, ``all_to_all``): checks,
        plans, launches the GEMM and its groups' collectives and the reorder; returns ``out``.
        The public methods below it (``check_call``, ``plan_call``, ``grid_programs``,
        ``capturing``, ``launch_plan``, ``compile_launch``, ``stage_raw``) are this transport's
        pieces that its tuner (tune.py) and its copy-engine variant (copy_engine.py) reuse."""
        op, cfg, M, N, K, out_rows = self.check_call(kind, a, b, config)
        # the caller's stream: the comm stream forks from it and it joins the comm stream
        self._caller = self._mod.current_stream(self.device) if self._mod else None
        # out and normed as every transport's out= (output_tensor): contiguous, so no two rows
        # of the reorder's writes land in the same memory
        inputs = dict(a=a, b=b, bias=bias, residual=residual, rms_weight=rms_weight)
        checking = self.checking_only  # (a check makes no output: the call that follows does)
        if out is not None or not checking:
            out = output_tensor(op, out, (out_rows, N), a, inputs)
        vector_checks(op, a, N, out_rows, bias=bias, residual=residual, rms_weight=rms_weight)
        if rms_weight is not None:
            if not eps > 0:
                raise ValueError(f"{op}: eps must be > 0, got {eps}")
            if normed is not None or not checking:
                normed = output_tensor(op, normed, (out_rows, N), a, dict(inputs, out=out),
                                       name="normed")
        elif normed is not None:
            raise ValueError(f"{op}: normed is written only with rms_weight")
        if checking:  # ``transport="auto"``'s check before its agreement: no more
            return out if rms_weight is None else (out, normed)
        if M == 0:
            # no rows on every rank: the call's agreement (every eager call of this transport
            # agrees before it runs, ``pattern.AGREED``) compared M, so every rank returns here
            # alike, and no counter of this workspace has moved on any rank
            return out if rms_weight is None else (out, normed)
        capturing = self.capturing()
        if capturing:
            # before the plan: a first call checks the ranks (a host collective) and copies
            # the plan's tables to the device, neither of which a capture takes
            known = self._plans.get(self._plan_key(kind, M, N, a.dtype, cfg))
            if known is None or not known.warm:
                raise RuntimeError(f"{op}: call it once with these shapes outside graph "
                                   f"capture first (the first call loads kernels and checks "
                                   f"the ranks agree)")
        plan = self.plan_call(kind, op, M, N, K, a.dtype, cfg)
        gemm, reorder = self.launch_plan(plan, a, b, out, bias, residual, rms_weight, normed)
        stage = self.stage_raw[:plan.stage_bytes].view(a.dtype)
        recv = self._recv_raw[:plan.recv_bytes].view(a.dtype) if plan.recv_bytes else stage
        gemm_args = signal_gemm_args(plan, a, b, stage, self.counters, gemm.programs,
                                     self.world.facts)
        reorder_args = _reorder_args(plan, recv, out, bias, residual, rms_weight, normed, eps)
        first = not plan.warm
        if self._mod is None and self._collectives:
            self._check_stamp(op, plan)
        self._fork()
        gemm(gemm_args)  # nothing is waited on before this launch returned (see kernel.py)
        try:
            self._communicate(plan, stage, recv, guarded=not first and cfg.gate == "value")
        except BaseException as e:
            if not capturing:
                self._recover(plan, e)
            else:  # a failed capture ran nothing (the graph is discarded): just rejoin
                try:
                    self._join()
                except Exception:
                    pass
            if isinstance(e, RuntimeError) and not isinstance(e, PeerTimeoutError):
                # the collective library's own errors: a timeout, or a peer that went away
                raise self._peer_lost(op, "collective", e) from e
            raise
        self._join()
        reorder(reorder_args)
        if first:
            self.backend.synchronize(self.device)
            plan.warm = True
        return out if rms_weight is None else (out, normed)

    def _group(self):
        """The world's signal group as it was when this context was made (``_bounded_group``),
    with this context's timeout."""
        group = self._sig_group
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:  # torch >= 2.3; older ones keep the default timeout
            set_timeout(self._timeout, group)
        return group

    def _bounded_gather(self, op: str, what: str):
        """``world.all_gather_object`` on this context's signal group, under its ``timeout_s``:
        a shape's first call meets its peers in the plan's check, where a peer that refused the
        call on the host (bad input) never comes, and the world's group would hold the others
        there for the process group's timeout (minutes). Where the collective library raises
        on a timeout (gloo) the context breaks with ``PeerTimeoutError``; NCCL's watchdog acts
        on its own (``GemmSignal``). Without a signal group (``collectives=False``) the
        world's own."""
        if self._sig_group is None:
            return None

        def gather(obj):
            self.world.collectives += 1  # (a collective of the world: collective_setup)
            if self.size == 1:  # (as the world's own: no collective, nothing copied)
                return [obj]
            got = [None] * self.size
            try:
                dist.all_gather_object(got, obj, group=self._group())
            except RuntimeError as e:
                self._mark_broken(e)
                raise self._peer_lost(op, what, e) from e
            return got
        return gather

    def _mark_broken(self, e: BaseException) -> None:
        """Refuse further calls, and drop the world's signal group: it may hold a collective a
        peer never joined (``_bounded_group``)."""
        self._broken = f"{type(e).__name__}: {e}"
        _drop_bounded_group(self.world)

    def _peer_lost(self, op: str, what: str, e: BaseException) -> PeerTimeoutError:
        """The error a failed collective of a call becomes: a timeout or a peer that went away."""
        return PeerTimeoutError(
            f"{op}: rank {self.rank}'s {what} failed (timeout_s={self.timeout_s}): a peer "
            f"skipped this call, left, or called with other shapes; the context is broken: close "
            f"it and create a new one. ({type(e).__name__}: {str(e).splitlines()[0][:200]})")

    def _check_stamp(self, op, plan) -> None:
        """Under gloo (synchronous) every call first compares its plan's tag across the ranks: a
        collective of another size is fatal to a gloo rank (it aborts), so a rank that skipped a
        call, or calls with other shapes, is caught here and every rank raises
        RankMismatchError before any data moves. (On GPUs the collectives are queued, not run,
        by the call: a mismatch there is bounded by the group's timeout only.)"""
        own = self.call_tag(plan.tag)
        tag = torch.tensor([own], dtype=torch.int64)
        tags = [torch.empty_like(tag) for _ in range(self.size)]
        try:
            dist.all_gather(tags, tag, group=self._group())
        except RuntimeError as e:
            self._mark_broken(e)
            raise self._peer_lost(op, "call check", e) from e
        seen = [int(t) for t in tags]
        if len(set(seen)) != 1:
            raise RankMismatchError(self._mismatch(op, own, seen))

    def _mismatch(self, op: str, tag: int, seen: list) -> str:
        """The message of a call whose plan tags differ across the ranks (``seen``, by rank):
        every rank got the same tags, so every rank is here, and the ranks' descriptions of
        their calls are gathered (the bounded group) to tell which ranks disagree on what."""
        from ..call_tags import describe_tag, differing, mismatch_message

        own = describe_tag(tag, OP)
        texts = [None] * self.size
        try:
            dist.all_gather_object(texts, own, group=self._group())
        except RuntimeError:  # the tags alone still say that the ranks disagree
            texts = [own if q == self.rank else None for q in range(self.size)]
        mine = seen[self.rank]
        peers = {q: texts[q] for q in range(self.size) if seen[q] != mine}
        return mismatch_message(op, self.rank, own, peers, differing(own, list(peers.values())))

    def _communicate(self, plan, stage, recv, guarded: bool) -> None:
        if not self._collectives:
            raise RuntimeError(f"{OP}: this context was made with collectives=False")
        be, group = self.backend, self._group()
        with self._on_comm():
            if not guarded:  # the comm stream waits for the whole GEMM, no stream is held; a
                # kernel resets the counters (capturable where stream value ops may not be)
                self._wait_caller()
                self.counters.zero_(plan.groups.n_groups)
            tile = plan.tile_elems
            for g, (start, size) in enumerate(zip(plan.groups.starts, plan.groups.sizes)):
                if guarded:  # wait for the group's tiles, then reset its counter
                    wait_counter(be, self._comm_handle, self.counters.address(g), size)
                chunk = stage[start * tile:(start + size) * tile]
                if plan.kind == "all_reduce":
                    dist.all_reduce(chunk, group=group)
                elif plan.kind == "reduce_scatter":
                    part = recv[start // self.size * tile:(start + size) // self.size * tile]
                    collectives.reduce_scatter(part, chunk, group=group)
                else:
                    dist.all_to_all_single(recv[start * tile:(start + size) * tile], chunk,
                                           group=group)

    def _recover(self, plan, e) -> None:
        """A collective raised after the GEMM was launched: clear this plan's counters behind the
        GEMM so that no later call passes a wait early, and refuse further calls (peers may have
        run collectives this rank did not). A collective that timed out raises
        PeerTimeoutError (``run``)."""
        self._mark_broken(e)
        try:
            with self._on_comm():
                self._wait_caller()
                for g in range(plan.groups.n_groups):
                    self.backend.stream_write_value(self._comm_handle,
                                                    self.counters.address(g), 0)
            self._join()
        except Exception:
            pass

    # -- streams (no-ops on the CPU backend, where everything runs synchronously) ---------------
    def _on_comm(self):
        return self._mod.stream(self.comm_stream) if self._mod else contextlib.nullcontext()

    def _fork(self) -> None:
        if self._mod:
            self.comm_stream.wait_stream(self._caller)

    def _wait_caller(self) -> None:  # called on the comm stream: wait for the caller's work
        if self._mod:
            self.comm_stream.wait_stream(self._caller)

    def _join(self) -> None:
        if self._mod:
            self._caller.wait_stream(self.comm_stream)

    # -- planning --------------------------------------------------------------------------------
    def grid_programs(self, cfg: SignalConfig) -> int:
        """The GEMM's persistent grid under ``cfg``: the device's SMs less the reserve, less
        what a stream wait holds while it waits (``DeviceFacts.gate_programs``: 0 where the
        GPU's front end waits, 1 where the wait is a spinning kernel). The group waits start
        while the GEMM runs; a grid of every SM would leave a spinning wait no room, or push
        one GEMM program into a second wave behind it."""
        facts = self.world.facts
        sms = facts.sm_count
        reserve = cfg.reserve_sms
        if reserve is None:
            reserve = round(RESERVE_PER_132 * sms / 132)
        if reserve + facts.gate_programs >= sms:
            raise ValueError(f"SignalConfig: reserve_sms={reserve} leaves no SM of {sms} for the "
                             f"GEMM (the stream waits hold {facts.gate_programs})")
        return sms - reserve - facts.gate_programs

    @staticmethod
    def _plan_key(kind, M, N, dtype, cfg: SignalConfig) -> tuple:
        return (kind, M, N, dtype, cfg)

    def plan_call(self, kind, op, M, N, K, dtype, cfg: SignalConfig) -> _Plan:
        """The plan of one (kind, shape, dtype, config): tiling, wave groups, buffer sizes;
        made once and cached (the first ``run`` of it checks that every rank made the same).
        Not keyed by K, which the plan does not use: a reduction's K shards may differ between
        ranks, and a K in the key would make one rank reuse a plan while another makes one and
        waits alone in the plan's host check of the ranks."""
        key = self._plan_key(kind, M, N, dtype, cfg)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        mm = cfg.matmul or default_config(dtype, self.device)
        dests = 1 if kind == "all_reduce" else self.size
        m_dest = M // dests
        pm, pn = -(-m_dest // mm.block_m), -(-N // mm.block_n)
        per_dest = pm * pn
        n_tiles = per_dest * dests
        try:
            programs = max(1, min(self.grid_programs(cfg), n_tiles))
            if cfg.partition is not None:
                groups = WaveGroups(cfg.partition)
                groups.validate(n_tiles, dests, what=f"{op}: partition")
            else:
                groups = default_partition(n_tiles, programs, dests, cfg.max_groups)
            if groups.n_groups > MAX_GROUPS:
                raise ValueError(f"{op}: at most {MAX_GROUPS} wave groups, got {groups.n_groups}")
            refusal = None
        except ValueError as e:
            refusal = e
        # every rank must run the same collectives on the same chunks: a rank planning another
        # partition or tiling would make the collectives mismatch (a hang or garbage). Not K:
        # each rank's product has its own (a reduction's K shards may differ in width), and
        # the collectives move [M, N] tiles whatever it is. A plan refused on some ranks only
        # (ranks' configs may differ: a partition that does not fit, an SM reserve too large)
        # is raised after the comparison, by every rank
        self.world.check_same_or_raise(
            f"{op} plan (M, N, dtype, tiling, partition)",
            None if refusal is not None else (kind, M, N, str(dtype), mm, groups.sizes),
            refusal, gather=self._bounded_gather(op, "plan check"))
        lay = tile_layout(groups, dests)
        tile = mm.block_m * mm.block_n
        if kind == "all_reduce":  # reordered from staging: slot s holds tile t = inverse[s]
            src = [lay.tile_of_slot(s) for s in range(n_tiles)]
            table = [_dst(lay.local[t], 0, m_dest, pm, pn, mm) for t in src]
        elif kind == "reduce_scatter":  # received tile u is tile u of this rank's row block
            table = [_dst(u, 0, m_dest, pm, pn, mm) for u in range(per_dest)]
        else:  # received slot s holds source q's tile u of this rank's block: rows q*M/W + ...
            src = [lay.tile_of_slot(s) for s in range(n_tiles)]
            table = [_dst(lay.local[t], lay.dest[t] * m_dest, m_dest, pm, pn, mm) for t in src]
        plan = _Plan()
        plan.kind, plan.groups, plan.dests, plan.m_dest, plan.mm = kind, groups, dests, m_dest, mm
        plan.programs, plan.tile_elems, plan.warm = programs, tile, False
        it = torch.int32
        plan.slot_t = kept_tensor(lay.slot, it, self.device)
        plan.group_t = kept_tensor(lay.group, it, self.device)
        plan.table_t = kept_tensor(table, it, self.device).reshape(-1, 3)
        # for the fused RMSNorm: (row0, nrows) of every row block of out, and which received
        # tile holds each (row block, column tile)
        blocks: dict = {}
        for s, (row0, nrows, col0) in enumerate(table):
            blocks.setdefault(row0, [nrows, [0] * pn])[1][col0 // mm.block_n] = s
        order = sorted(blocks)
        plan.norm_rows_t = kept_tensor([[r0, blocks[r0][0]] for r0 in order], it,
                                       self.device).reshape(-1, 2)
        plan.norm_index_t = kept_tensor([blocks[r0][1] for r0 in order], it,
                                        self.device).reshape(len(order), pn)
        esz = torch.empty((), dtype=dtype).element_size()
        plan.stage_bytes = n_tiles * tile * esz
        plan.recv_bytes = {"all_reduce": 0, "reduce_scatter": per_dest * tile * esz,
                           "all_to_all": n_tiles * tile * esz}[kind]
        self._stage_buf.get(plan.stage_bytes)
        self._recv_buf.get(plan.recv_bytes)
        # what the ranks must agree on, compared by every call under gloo (``_check_stamp``)
        plan.tag = shape_tag(OP, kind, M=M, N=N, dtype=str(dtype), config=repr(cfg),
                             groups=tuple(plan.groups.sizes))
        self._plans[key] = plan
        return plan

    @property
    def stage_raw(self) -> torch.Tensor:
        """The staging bytes, as large as the largest plan made: a call views its first
        ``plan.stage_bytes``."""
        return self._stage_buf.buffer if self._stage_buf.buffer is not None else _NO_BYTES

    @property
    def _recv_raw(self) -> torch.Tensor:
        return self._recv_buf.buffer if self._recv_buf.buffer is not None else _NO_BYTES

    def launch_plan(self, plan, a, b, out, bias, residual, rms_weight, normed, *,
                    with_reorder: bool = True):
        """The compiled GEMM and reorder launches for these tensors (the JIT specializes on
        strides and 16-byte alignment, so those are part of the key, and the GEMM on whether K
        fills whole K blocks: the plan is not keyed by K, and an ``a`` whose strides do not
        change with K, a transposed or a stride-0 one, would otherwise run a launch made for
        another K, its K loop unmasked past the end). ``with_reorder=False``: the GEMM alone
        (``None`` for the reorder), for transports that consume staging in their own kernel
        (copy_engine.py)."""
        extra = [t for t in (bias, residual, rms_weight, normed) if t is not None]
        even_k = a.shape[1] % plan.mm.block_k == 0  # the GEMM's EVEN_K
        key = (id(plan), with_reorder, even_k, a.stride(), b.stride(), out.stride(0),
               residual.stride(0) if residual is not None else None,
               normed.stride(0) if normed is not None else None,
               bias is not None, align_key(a, b, out, *extra))
        got = self._launches.get(key)
        if got is not None:
            return got
        mm = plan.mm
        use_desc = tile_descriptors(a, b, mm, self.world.facts)[0] is not None
        gemm_consts = dict(USE_DESC=use_desc, BLOCK_M=mm.block_m, BLOCK_N=mm.block_n,
                           BLOCK_K=mm.block_k,
                           GROUP_M=mm.group_m, NUM_STAGES=mm.num_stages,
                           EVEN_K=even_k,
                           PRECISION=dot_precision(a.dtype),
                           UPCAST=dot_upcast(a.dtype), GATE_TABLE=self.counters.indirect,
                           num_warps=mm.num_warps, num_stages=mm.num_stages)
        stage = self.stage_raw[:plan.stage_bytes].view(a.dtype)
        recv = self._recv_raw[:plan.recv_bytes].view(a.dtype) if plan.recv_bytes else stage

        def gemm_args(g):
            return signal_gemm_args(plan, a, b, stage, self.counters, g, self.world.facts)

        rows = min(mm.block_m, 32)  # a 32 x BLOCK_N slab per program keeps registers low
        reorder_consts = dict(BLOCK_M=mm.block_m, BLOCK_N=mm.block_n, ROWS=rows,
                              HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                              num_warps=4)
        reorder_args = _reorder_args(plan, recv, out, bias, residual, rms_weight, normed, 1e-6)
        gemm = self.compile_launch(gemm_signal_kernel, plan.programs, gemm_consts, gemm_args, True)
        if not with_reorder:
            reorder = None
        elif rms_weight is None:  # one program per ROWS rows of a received tile
            reorder = self.compile_launch(signal_reorder_kernel,
                                          plan.table_t.shape[0] * (mm.block_m // rows),
                                          reorder_consts, lambda g: reorder_args, False)
        else:  # one program per ROWS rows of a row block of out (whole rows: the norm)
            reorder_consts["num_warps"] = 8 if mm.block_n >= 256 else 4
            reorder = self.compile_launch(signal_reorder_norm_kernel,
                                          plan.norm_rows_t.shape[0] * (mm.block_m // rows),
                                          reorder_consts, lambda g: reorder_args, False)
        self._launches[key] = (gemm, reorder)
        return gemm, reorder

    def compile_launch(self, kernel, programs, consts, make_args,
                       cap_resident: bool) -> PlannedLaunch:
        """``kernel`` compiled once for ``consts`` and held as a launch of ``programs``
        programs (capped at what fits on the device at once where ``cap_resident``: a persistent
        kernel whose programs wait for each other must all be resident)."""
        facts = self.world.facts
        if facts.vendor == "cpu":  # the interpreter has no compiled kernel to hold on to
            return PlannedLaunch(kernel, None, programs, consts, None)
        k = kernel.warmup(*make_args(programs), grid=(programs,), **consts)
        if cap_resident:  # a persistent grid never exceeds what is resident at once
            fit = min(programs, resident_programs(k, consts["num_warps"], facts))
            if fit != programs:  # the grid size is an argument too: compile for the real one
                programs = fit
                k = kernel.warmup(*make_args(programs), grid=(programs,), **consts)
        backend, device = self.backend, self.device
        return PlannedLaunch(kernel, k, programs, consts, lambda: backend.current_stream(device))


def signal_gemm_args(plan, a, b, stage, counters, programs, facts=None):
    """The signal GEMM's runtime arguments (``counters``: the context's ``GateWords``, which the
    kernel takes as its words or their address table); with ``facts``, tensor descriptors of a
    and b where the device and operands allow (``tile_descriptors``; the launch was compiled for
    the same choice: its key holds the strides and alignments that decide it)."""
    a_desc, b_desc = tile_descriptors(a, b, plan.mm, facts) if facts else (None, None)
    return (a, b, stage, plan.slot_t, plan.group_t, counters.kernel_arg, plan.m_dest, b.shape[1],
            a.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1), plan.dests, programs,
            a_desc, b_desc)


def _reorder_args(plan, recv, out, bias, residual, rms_weight=None, normed=None, eps=1e-6):
    # absent bias / residual: ``out`` stands in for the pointer (never read: HAS_BIAS / HAS_RES)
    bias_ = bias if bias is not None else out
    res_, stride_rm = (residual, residual.stride(0)) if residual is not None else (out, 0)
    if rms_weight is None:
        return (recv, plan.table_t, out, bias_, res_, out.shape[1], out.stride(0), stride_rm)
    return (recv, plan.norm_rows_t, plan.norm_index_t, out, normed, bias_, res_, rms_weight,
            out.shape[1], plan.norm_index_t.shape[1], out.stride(0), normed.stride(0),
            stride_rm, float(eps))


def _dst(u, row_base, m_dest, pm, pn, mm):
    """(row0, nrows, col0) in out of tile u (grouped order) of a [m_dest, N] row block."""
    i, j = grouped_tile(u, pm, pn, mm.group_m)
    return (row_base + i * mm.block_m, min(mm.block_m, m_dest - i * mm.block_m), j * mm.block_n)


def _bounded_group(world):
    """The process group over ``world``'s ranks that the tile-group-signal collectives use: one
    per world, made by the first context (collective) and shared, so that a collective that
    timed out never leaves the world's own group holding a half-done operation (the group is
    then dropped, ``_drop_bounded_group``, and the next context makes another). Its timeout is
    set to the calling context's before each call (``GemmSignal._group``)."""
    group = getattr(world, "_signal_group", None)
    whole = world.group is None or dist.get_world_size(world.group) == dist.get_world_size()
    held = world.all_gather_object((group is not None, None if whole else _groups_made()))
    if not all(h[0] for h in held):  # every rank makes a new one
        ranks = (list(range(dist.get_world_size())) if world.group is None else
                 dist.get_process_group_ranks(world.group))
        if not whole:
            _pad_groups_made(max(h[1] for h in held))
        # a subgroup world (one rank of a job, say) makes its group with its own ranks alone
        group = dist.new_group(ranks, backend=dist.get_backend(world.group),
                               use_local_synchronization=not whole)
        world._signal_group = group
    return group


def _groups_made() -> int:
    """How many process groups this process has made: torch names a group made with
    ``use_local_synchronization`` by its ranks and this count, so the members of a subgroup
    world meet under one name only where their counts agree. They differ where a process is
    in two subgroup worlds (tensor parallel beside data parallel) and one of its other worlds
    made a signal group that the other members' worlds did not (another pipeline stage runs
    another transport): the members then waited in ``new_group`` for ever, each under its own
    name. -1 where this torch keeps no such count (nothing to agree on)."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    return -1 if names is None else len(names)


def _pad_groups_made(count: int) -> None:
    """Make groups of this process alone (gloo: no device, no peer) until this process has
    made ``count`` (the most any member of the world made), so the next group made with
    ``use_local_synchronization`` has the same name on every member (``_groups_made``)."""
    me = dist.get_rank()
    while 0 <= _groups_made() < count:
        dist.new_group([me], backend="gloo", use_local_synchronization=True)


def _drop_bounded_group(world) -> None:
    """Forget the world's signal group after a failed collective (see ``_bounded_group``)."""
    world._signal_group = None
