"""The fused transports of the MoE dispatch (``"stores"``, ``"shmem"``): the workspace
:class:`MoeDispatchKernel` and its three launches; ``pattern.py`` holds the public context
``MoeDispatch``, which runs them, the torch path (``sequential.py``) or ``"auto"``.

What a call computes on rank r (``E`` local experts per rank, expert ``g`` on rank ``g // E``)::

    # tokens [S, H], topk_ids [S, k]: rank r's tokens and the global experts of each
    x, counts, slots = moe_dispatch_reference(tokens, topk_ids, E)   # all_to_all of real rows
    # x [R, H]: the rows routed to r's experts, by source rank q, then local expert e, in slot
    # order within a segment; counts [W, E] int32 (rows from q for e); slots [R] int32 (the
    # row's slot s * k + j on its source rank)

A call returns ``(x, counts, slots)`` with ``x`` and ``slots`` of ``capacity`` rows: the first
``counts.sum()`` are the dispatch's, the rest are left as they were. They are views of the
workspace's buffers, valid until its next call or ``close()``: the layout ``moe_gemm_combine``
takes.

- ``"stores"``: three kernels (kernel.py) count the routing, exchange the counts and store
  every row straight into its destination's receive buffer (zero-copy over NVLink / Infinity
  Fabric). The host reads nothing: a call can be captured in a CUDA graph and replayed with
  new routing. Routing faults are found on the device and raised at the context's next check,
  on every rank for the same call: an expert id out of range (its slot is routed nowhere),
  more rows for a rank than its ``capacity`` (the rows past it are not stored and that rank's
  counts are zeros, so a consumer reads no row past the buffer);
- ``"shmem"`` (the scale-out design): the same three kernels, but the receive buffers (rows
  and slots) are in the symmetric memory of the process's SHMEM library (NVSHMEM / ROC_SHMEM,
  shmem/providers) and a peer's rows and slots are put by the library from the kernel, row by
  row, completed (quiet) before the same release signals; the counts, flags and signals stay
  in this library's heap. The tokens are first copied into the library's memory (the puts'
  source; one local copy of S rows per call). Same results, layout, faults, call protocol and
  capture as ``"stores"``. Needs a usable library on every rank and two or more ranks, else
  every rank raises ``ShmemUnavailable`` when the workspace is made, before anything is
  allocated. ``dispatch_swiglu`` raises for it (the fused kernel stores rows; it needs
  ``"stores"``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ...shmem.providers import agreed_put_provider
from ..context import (align_key, check_sizes as check_bounds, check_transport,
                       collective_call, G_MAX, OverlapContext, refuse_grad, shape_tag,
                       shares_memory)
from ..launch import PlannedLaunch
from ..matmul.api import DTYPES
from .kernel import (FLAG_NAMES, dispatch_put_kernel, dispatch_scatter_kernel,
                     route_count_kernel, route_exchange_kernel)

OP = "moe_dispatch"
#: the transports of this module's workspace (``pattern.TRANSPORTS`` adds ``"sequential"``)
FUSED_TRANSPORTS = ("stores", "shmem")
MAX_EXPERTS = 1024  # experts in all (world * experts_per_rank): the count kernel's one-hot width
ID_DTYPES = (torch.int32, torch.int64)


#: ``dedup=None`` sends each token once per peer rank where a token is expected to have at
#: least this many of its experts on a rank it goes to (``rows_per_rank_reached``) ...
DEDUP_MIN_ROWS = 1.2
#: ... and a call of ``max_tokens`` tokens is expected to send at least this many bytes fewer
#: (about 25 µs over NVLink at the SM stores' 350 GB/s): at decode sizes the receiver's copies
#: cost more than the link time they save
DEDUP_MIN_SAVED_BYTES = 8 << 20


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rows_per_rank_reached(world_size: int, experts_per_rank: int, top_k: int) -> float:
    """The rows a token sends to each rank it reaches, on average, where its ``top_k`` distinct
    experts are drawn uniformly from all ``world_size * experts_per_rank``: ``top_k`` over the
    expected number of ranks reached, ``W * (1 - C(E_total - E, k) / C(E_total, k))``."""
    E_total = world_size * experts_per_rank
    k = min(top_k, E_total)
    missed = math.comb(E_total - experts_per_rank, k) / math.comb(E_total, k)
    return k / (world_size * (1.0 - missed))


def rows_saved_per_token(world_size: int, experts_per_rank: int, top_k: int) -> float:
    """The rows a token sends to peers a row per expert (``top_k * (W - 1) / W`` on average)
    less those it sends once per peer rank reached, with its experts drawn uniformly."""
    W = world_size
    reached = top_k / rows_per_rank_reached(W, experts_per_rank, top_k)  # ranks, its own too
    return min(top_k, W * experts_per_rank) * (W - 1) / W - reached * (W - 1) / W


def default_dedup(world_size: int, experts_per_rank: int, top_k: int, max_tokens: int,
                  row_bytes: int) -> bool:
    """``dedup=None``: send a token once per peer rank (and copy it to its places there) where
    a token is expected to reach a rank with :data:`DEDUP_MIN_ROWS` rows or more and a call of
    ``max_tokens`` tokens to send :data:`DEDUP_MIN_SAVED_BYTES` fewer; never on one rank (no
    peer). Measured on 2 H200s (docs/moe.md): on at S 8192 for (H, experts, top-k) = (7168,
    16, 8) (the dispatch 0.63-0.70 against 1.36-1.87 ms) and (4096, 8, 2) (0.23-0.26 against
    0.23-0.32 ms; the layer within 2 % either way); off at 128 tokens, where it costs 5-11
    µs."""
    if world_size < 2:
        return False
    saved = max_tokens * rows_saved_per_token(world_size, experts_per_rank, top_k) * row_bytes
    return (rows_per_rank_reached(world_size, experts_per_rank, top_k) >= DEDUP_MIN_ROWS
            and saved >= DEDUP_MIN_SAVED_BYTES)


def check_sizes(world, max_tokens, top_k, hidden, experts_per_rank, dtype, capacity) -> int:
    """The sizes a dispatch context is made with, checked: returns ``capacity`` (None: ``world
    * max_tokens * top_k``, which no routing exceeds)."""
    W = world.world_size
    if capacity is None and all(isinstance(v, int) for v in (max_tokens, top_k)):
        capacity = W * max_tokens * top_k
    check_bounds(OP, max_tokens=max_tokens, top_k=top_k, hidden=hidden,
                 experts_per_rank=experts_per_rank, capacity=capacity)
    if dtype not in DTYPES:
        raise TypeError(f"{OP}: dtype must be one of {DTYPES}, got {dtype}")
    if W * experts_per_rank > MAX_EXPERTS:
        raise ValueError(f"{OP}: at most {MAX_EXPERTS} experts in all, got {W} ranks x "
                         f"{experts_per_rank}")
    if max_tokens * top_k >= 2 ** 31 or capacity >= 2 ** 31:
        raise ValueError(f"{OP}: max_tokens * top_k and capacity must stay below 2**31")
    return capacity


def check_call(ctx, tokens, topk_ids) -> None:
    """A call's tokens and expert ids against the context ``ctx`` (any transport's: its world,
    ``dtype``, ``hidden``, ``top_k`` and ``max_tokens``)."""
    dev = ctx.world.device
    for name, t in (("tokens", tokens), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a tensor")
        if t.device != dev:
            raise ValueError(f"{OP}: {name} must be on {dev}, got {t.device}")
    if tokens.dtype != ctx.dtype:
        raise TypeError(f"{OP}: tokens must be {ctx.dtype} (the context's dtype), got "
                        f"{tokens.dtype}")
    # the kernels step through a row by 1, a single token's row too ([1, H] may be a strided
    # view); the row stride is an argument
    if tokens.dim() != 2 or tokens.shape[1] != ctx.hidden or (
            tokens.numel() > tokens.shape[0] and tokens.stride(1) != 1) \
            or tokens.stride(0) < 0:
        raise ValueError(f"{OP}: tokens must be [S, {ctx.hidden}] with contiguous rows; got "
                         f"{tuple(tokens.shape)} strides {tokens.stride()}")
    if topk_ids.dtype not in ID_DTYPES or topk_ids.dim() != 2 \
            or topk_ids.shape != (tokens.shape[0], ctx.top_k) \
            or not topk_ids.is_contiguous():
        raise ValueError(f"{OP}: topk_ids must be a contiguous int32/int64 [S, "
                         f"{ctx.top_k}] tensor with S = tokens.shape[0] = "
                         f"{tokens.shape[0]}; got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tokens.shape[0] > ctx.max_tokens:
        raise ValueError(f"{OP}: S={tokens.shape[0]} tokens exceed this context's "
                         f"max_tokens={ctx.max_tokens}")
    check_not_received(ctx, tokens=tokens, topk_ids=topk_ids)


def check_not_received(ctx, **inputs) -> None:
    """A ValueError where one of ``inputs`` (name -> tensor) shares memory with the context's
    receive buffers (``recv``, ``recv_slots``, ``counts``: what a call returns), e.g. the
    previous call's rows passed back as tokens: the call stores its own and its peers' rows
    there while it still reads its inputs (on 2 emulated ranks a peer's rows landed on the
    tokens before they were sent, and the call returned wrong rows with no error)."""
    for name, t in inputs.items():
        for buf in (ctx.recv, ctx.recv_slots, ctx.counts):
            if isinstance(t, torch.Tensor) and buf is not None and shares_memory(t, buf):
                raise ValueError(f"{OP}: {name} share memory with this context's receive "
                                 f"buffers (the rows, slots or counts a call returns, which the "
                                 f"next call overwrites while it reads its inputs): pass a copy "
                                 f"({name}.clone())")


class MoeDispatchKernel(OverlapContext):
    """The fused transports' workspace on one rank: a receive buffer of ``capacity`` rows of
    ``hidden`` elements of ``dtype`` and their slots, the routing counts of every rank and the
    flags in the symmetric heap. ``max_tokens``: the most tokens any rank passes in a call;
    ``capacity``: the most rows any rank may receive in a call (default ``world * max_tokens *
    top_k``, which no routing exceeds; a smaller one saves memory, and a call that passes it
    raises). With ``transport="shmem"`` the receive buffers and a copy of the tokens are in the
    SHMEM library's symmetric memory instead (module docstring). Collective to create and
    close; calls in the same order on every rank, on any streams (each call runs after the
    last). Made by ``MoeDispatch`` (pattern.py), which users make.

    ``dedup`` (``"stores"`` only): send a token to a peer rank once, however many of its experts
    that rank holds, into a buffer of ``(W - 1) * max_tokens`` rows there (with a map of its
    slots' places, ``(W - 1) * max_tokens * top_k`` words), from which the rank copies it to
    each of its places in the same launch (kernel.py, ``ONCE``): fewer bytes over the links
    for one more local copy of the received rows. None: :func:`default_dedup` (where tokens
    are expected to reach a rank with 1.2 rows or more and a call of ``max_tokens`` to send 8
    MB fewer), and only where that buffer is no larger than the receive buffer (``capacity``
    rows: a context made with a small capacity to save memory does not get twice it by
    default). The results are the same either way."""

    OP = OP
    TRANSPORTS = FUSED_TRANSPORTS
    FLAG_NAMES = FLAG_NAMES

    def __init__(self, world, *, max_tokens: int, top_k: int, hidden: int,
                 experts_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                 capacity: Optional[int] = None, timeout_s: float = 10.0,
                 transport: str = "stores", dedup: Optional[bool] = None):
        W = world.world_size
        capacity = check_sizes(world, max_tokens, top_k, hidden, experts_per_rank, dtype,
                               capacity)
        check_transport(OP, transport, FUSED_TRANSPORTS)
        if dedup is not None and not isinstance(dedup, bool):
            raise ValueError(f"{OP}: dedup must be True, False or None, got {dedup!r}")
        if dedup and transport != "stores":
            raise ValueError(f"{OP}: dedup=True is an option of transport='stores', not of "
                             f"{transport!r}")
        if dedup is None:  # (not where its buffer would outgrow the receive buffer)
            dedup = transport == "stores" and (W - 1) * max_tokens <= capacity and default_dedup(
                W, experts_per_rank, top_k, max_tokens, hidden * dtype.itemsize)
        dedup = dedup and W > 1  # (one rank has no peer to send to)
        world.check_same(f"{OP} context arguments", (max_tokens, top_k, hidden, experts_per_rank,
                                                     str(dtype), capacity, transport, dedup))
        # collective, before any allocation: every rank raises if one has no SHMEM library
        self._provider = agreed_put_provider(world, OP, transport)
        self.transport = transport
        self.max_tokens, self.top_k, self.hidden = max_tokens, top_k, hidden
        self.experts_per_rank, self.dtype, self.capacity = experts_per_rank, dtype, capacity
        self.dedup = dedup
        E_total = W * experts_per_rank
        cpu = world.device.type == "cpu"
        # slots per block: the scatter ranks a block's slots with a [BLOCK_T, BLOCK_T] compare,
        # the count kernel takes a [BLOCK_T, BLOCK_E] one-hot
        self.block_e = _pow2(E_total)
        self.block_t = 16 if cpu else (64 if self.block_e <= 256 else 32)
        n_blocks = -(-max_tokens * top_k // self.block_t)
        # the receive buffers: in the heap, or in the library's symmetric memory (below)
        recv = [] if self._provider is not None else [
            ("recv", (capacity, hidden), dtype), ("recv_slots", (capacity,), torch.int32)]
        if dedup:  # each peer's tokens sent once and their slots' places: q at q - (q > rank)
            recv += [("rows_once", (W - 1, max_tokens, hidden), dtype),
                     ("places_once", (W - 1, max_tokens * top_k), torch.int64)]
        super().__init__(world, recv + [
            ("counts_in", (W, E_total + 1), torch.int32),
            ("count_flag", (W, 1), torch.int64), ("sent", (W, G_MAX), torch.int64),
            ("consumed", (W,), torch.int64), ("ctl", (4,), torch.int64),
        ], timeout_s)
        self.call_protocol(self.ctl, call_flags=(self.count_flag, self.sent),
                           free_flags=(self.consumed,))
        dev = world.device
        # the put transport's slot ids and stage; the zero-copy kernel takes (and never
        # touches) the receive slots in their place
        self._sym = self._send = self._put_kernel = None
        if self._provider is not None:
            self._symmetric_buffers(max_tokens * top_k)
        else:
            self._slot_ids = self._stage = self.recv_slots
        self._hist = torch.zeros(n_blocks * self.block_e, dtype=torch.int32, device=dev)
        self._base = torch.zeros_like(self._hist)
        self._dest_start = torch.zeros(E_total, dtype=torch.int32, device=dev)
        self._bad = torch.zeros(1, dtype=torch.int32, device=dev)
        self.counts = torch.zeros((W, experts_per_rank), dtype=torch.int32, device=dev)
        # the fused dispatch + gated GEMM's tile queues (swiglu_kernel.py), zero between calls
        self._queue = torch.zeros(3, dtype=torch.int32, device=dev)
        # the one-launch layer's gated activations (ops/moe_layer), per I, made on first use
        self._layer_h: dict = {}
        # the scatter's programs per SM (``_plan``; a probe may set it before the first call):
        # with dedup most of its bytes are local copies (its own rows, and the peers' to their
        # places), which more programs per SM speed up (2 H200s, S 8192, H 7168, top-8 of 16:
        # 0.515 -> 0.450 ms; 4 per SM 0.446), where the rows sent per expert are bound by the link
        self._scatter_programs_per_sm = 2 if dedup and not cpu else 1

    def _symmetric_buffers(self, n_slots: int) -> None:
        """The put transport's buffers: one collective allocation of the library's symmetric
        memory holding the receive rows and slots, the slot ids (the slots' puts' source:
        ``slot_ids[i] = i``) and a copy of the tokens (the rows' puts' source); and each
        program's stage (device memory, kernel.py ``put_rows``)."""
        parts = (("recv", (self.capacity, self.hidden), self.dtype),
                 ("recv_slots", (self.capacity,), torch.int32),
                 ("_slot_ids", (n_slots,), torch.int32),
                 ("_send", (self.max_tokens, self.hidden), self.dtype))
        at, offsets = 0, []
        for _, shape, dtype in parts:  # each buffer 256-byte aligned
            at = -(-at // 256) * 256
            offsets.append(at)
            at += math.prod(shape) * dtype.itemsize
        self._sym = self._provider.symmetric_empty(at)
        for (name, shape, dtype), at in zip(parts, offsets):
            n = math.prod(shape) * dtype.itemsize
            setattr(self, name, self._sym[at:at + n].view(dtype).view(shape))
        self._slot_ids.copy_(torch.arange(n_slots, dtype=torch.int32,
                                          device=self.world.device))
        self._stage = torch.zeros(G_MAX * 2 * self.block_t, dtype=torch.int32,
                                  device=self.world.device)
        self._put_kernel = self._provider.wrap(dispatch_put_kernel)

    def close(self) -> None:
        """Collective: also lets the library's symmetric memory go (torch frees it once no view
        of it is left)."""
        super().close()
        self._layer_h = {}
        self.recv = self.recv_slots = self._slot_ids = self._stage = None
        self._send = self._sym = self._put_kernel = None

    @collective_call
    def __call__(self, tokens: torch.Tensor, topk_ids: torch.Tensor) -> tuple:
        refuse_grad(OP, tokens)  # the context's buffers carry no gradient
        self._validate(tokens, topk_ids)
        for launch in self._launches(tokens, topk_ids):
            launch()
        return self.recv, self.counts, self.recv_slots

    @collective_call
    def dispatch_swiglu(self, tokens: torch.Tensor, topk_ids: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor,
                        out: Optional[torch.Tensor] = None, *, senders: Optional[int] = None,
                        config=None, rows_per_segment: Optional[float] = None) -> tuple:
        """The dispatch with the experts' gated first GEMM fused into it: ``(h, counts,
        slots)`` (``swiglu.py``; ``moe_dispatch_swiglu`` is the function form)."""
        from . import swiglu

        if self.transport == "shmem":
            raise ValueError(f"{swiglu.OP}: the fused dispatch + gated GEMM stores the rows "
                             f"itself and needs transport='stores'; this context's transport is "
                             f"'shmem' (call moe_dispatch, then expert_swiglu on its rows)")
        out = swiglu.check_arguments(self, tokens, topk_ids, w_gate, w_up, out, senders, config,
                                     rows_per_segment)
        if self.world.world_size > swiglu.MAX_WORLD:
            raise ValueError(f"{swiglu.OP}: at most {swiglu.MAX_WORLD} ranks, got "
                             f"{self.world.world_size}")
        return swiglu.run(self, tokens, topk_ids, w_gate, w_up, out, senders, config,
                          rows_per_segment)

    # -- launches ------------------------------------------------------------------------------
    def _launches(self, tokens, topk_ids) -> tuple:
        """The call's three launches (count, exchange, scatter), planned on first use."""
        # S changes with the call and is never specialized on (kernel.py): plans depend on
        # what is fixed for a model (dtype, strides, alignment)
        key = (tokens.dtype, tokens.stride(0), topk_ids.dtype,
               align_key(tokens, topk_ids))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(tokens, topk_ids)
        count, exchange, scatter = plan
        args = self._args(tokens, topk_ids, self.call_tag(scatter.tag))
        if self._provider is None:
            return tuple(functools.partial(launch, a) for launch, a in zip(plan, args))

        def put():
            # the puts' source is the library's memory (kernel.py put_rows); the previous call's
            # puts from it completed before its launch ended
            self._send[:tokens.shape[0]].copy_(tokens)
            self._launched = True
            # through the library's launcher (it sets up each compiled module)
            self._put_kernel[(scatter.programs,)](*args[2], **scatter.consts)

        return lambda: count(args[0]), lambda: exchange(args[1]), put

    def _args(self, tokens, topk_ids, tag) -> tuple:
        W, E = self.world.world_size, self.experts_per_rank
        n = topk_ids.numel()
        st = self.status.address
        count = (topk_ids, self._hist, self._bad, st, n, W * E)
        exchange = (self._hist, self._base, self._bad, self._dest_start, self.counts,
                    self.counts_in, self.count_flag, self.consumed, self.ctl, self.call_clock,
                    self.heap.bases, st, n, E, self.capacity, self.rank, W, tag, self.timeout_us)
        # the put transport's rows come from the tokens' copy in the library's memory
        src, stride = ((tokens, tokens.stride(0)) if self._provider is None else
                       (self._send, self.hidden))
        # (unused without dedup)
        once, places = ((self.rows_once, self.places_once) if self.dedup else
                        (self.recv, self.sent))
        scatter = (src, topk_ids, self._base, self._dest_start, self.recv, self.recv_slots,
                   self._slot_ids, self._stage, once, places, self.sent, self.ctl,
                   self.call_clock, self.heap.bases, st, n, self.top_k, self.hidden, stride, E,
                   self.capacity, self.max_tokens, self.rank, W, tag, self.timeout_us)
        return count, exchange, scatter

    def _plan(self, tokens, topk_ids) -> tuple:
        E = self.experts_per_rank
        cpu = self.world.device.type == "cpu"
        programs = min(self.world.facts.sm_count * self._scatter_programs_per_sm, G_MAX)
        BT, BE = self.block_t, self.block_e
        elem = tokens.element_size()
        block_h = 16 if cpu else min(_pow2(self.hidden), 512 // elem)

        def tag_of(g):  # what must agree across ranks (not S, which may differ)
            return shape_tag(OP, hidden=self.hidden, top_k=self.top_k, experts_per_rank=E,
                             dtype=str(tokens.dtype), capacity=self.capacity, programs=g,
                             block_t=BT, dedup=self.dedup)

        def args(g):
            return self._args(tokens, topk_ids, tag_of(g))

        consts = dict(BLOCK_T=BT, BLOCK_E=BE, BLOCK_H=block_h, G_MAX=G_MAX, num_warps=4,
                      num_stages=1)
        if self._provider is None:
            # every program waits for its counterparts on the peers: the grid must be resident
            scatter = self._compile(dispatch_scatter_kernel, programs,
                                    dict(consts, ONCE=self.dedup), lambda g: args(g)[2])
        else:
            # compiled by the library's launcher on first use, so not capped here: one program
            # of 4 warps per SM is resident whatever its registers (at most 255 x 128 of an
            # SM's 64K) and its few KB of shared memory
            scatter = PlannedLaunch(dispatch_put_kernel, None, programs, consts, None,
                                    owner=self)
        scatter.tag = tag_of(scatter.programs)
        count, exchange = self._plan_routing(tokens, topk_ids, scatter.programs, scatter.tag)
        return count, exchange, scatter

    def _plan_routing(self, tokens, topk_ids, programs: int, tag: int) -> tuple:
        """The count (``programs`` programs) and exchange launches of a call whose launches
        carry ``tag``: the routing part of the dispatch and of the fused dispatch + GEMM."""
        W, E = self.world.world_size, self.experts_per_rank
        BT, BE = self.block_t, self.block_e
        final = self._args(tokens, topk_ids, tag)
        count = self._compile(route_count_kernel, programs,
                              dict(BLOCK_T=BT, BLOCK_E=BE, num_warps=4, num_stages=1),
                              lambda g: final[0])
        exchange = self._compile(route_exchange_kernel, 1,
                                 dict(BLOCK_T=BT, BLOCK_E=BE, BLOCK_P=max(1, min(64, 8192 // BE)),
                                      BLOCK_W=_pow2(W), BLOCK_EL=_pow2(E), num_warps=4,
                                      num_stages=1), lambda g: final[1])
        return count, exchange

    # -- checks --------------------------------------------------------------------------------
    def _validate(self, tokens, topk_ids) -> None:
        check_call(self, tokens, topk_ids)
