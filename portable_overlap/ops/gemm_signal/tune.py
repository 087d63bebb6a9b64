"""Wave-group tuning of the tile-group-signal ops (issue 4, item 4): calibrate once, let the
predictor rank the partitions, measure the few it ranks best, keep the fastest, cache it.

``tune_partition(ctx, kind, a, b)`` (collective; ``GemmSignal.tune`` calls it) returns a
``SignalConfig`` whose ``partition`` every rank shares. Inside ``schedule.decide``:

1. **Calibration** on these tensors (``calibrate``): the signal GEMM alone and the reorder alone
   (``GemmSignal.phases``), the collective's time against message size
   (``schedule.measure_comm_curve``, host-timed: it predicted the op's times with 3.6–4.4 % mean
   error on 2x H200 where the graph-timed curve gave 8–11 %, docs/gemm_signal.md), and on a GPU
   the two slowdowns (``measure_beside``: the GEMM and a collective lasting about as long,
   launched together and each alone).
2. **Prediction**: ``schedule.search_top`` ranks every admissible partition and keeps ``top_k``.
3. **Measurement**: those, one group and the default partition, each timed through the op itself
   (``schedule.time_call``; CUDA-graph replay on a GPU), fastest first. One group and the default
   are always measured because the model can be wrong in the one way that matters here: when the
   collectives barely progress beside the GEMM (NCCL on 2x H200 ran at 1/3 of its rate beside
   it), extra groups only add per-collective costs and no overlap; measured, one group was then
   within 1.4–2.9 % of the best partition.
   The fastest of these and one group are then measured again with the other SM reserve (none,
   or 16 of 132 SMs when none is configured: a reserve only helps collectives that progress
   beside the GEMM), so the pick also says which reserve to use.
4. **Decision**: rank 0's result (partition and reserve), recorded in every rank's
   cache (the ``cache`` given, else the file ``PORTABLE_OVERLAP_TUNING_CACHE`` names, else
   the process's memory) under a key of the op, shape, dtype, world size, ranks per host,
   device name, tiling, the configured SM reserve and versions. When every rank holds it,
   nothing is measured; an entry that is no partition of this shape's tiles, or ranks whose
   caches hold different entries, warn and tune again (``schedule.decide``).

The cached value keeps what decided it (the candidates with their predicted and measured times,
the calibration), so a surprising choice can be read back from the cache file.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

import torch
import torch.distributed as dist

from ... import collectives
from ...schedule import (Calibration, TuningCache, WaveGroups, cache_key, decide,
                         measure_comm_curve, predict_ms, search_top, time_call)
from ...schedule.predict import invert_comm_slowdown
from .config import ALT_RESERVE_PER_132, KINDS, MAX_GROUPS, SignalConfig

MIB = 1 << 20


def collective_fn(kind: str, nbytes: int, world, dtype=torch.bfloat16):
    """``(run, bytes)``: a closure running ``kind``'s collective ("all_reduce", "reduce_scatter",
    "all_to_all") on about ``nbytes`` per rank of fresh random data, and the exact bytes."""
    W, dev = world.world_size, world.device
    n = max(W, nbytes // torch.empty((), dtype=dtype).element_size() // W * W)
    x = torch.randn(n, device=dev, dtype=torch.float32).to(dtype)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x, group=world.group)), n * x.element_size()
    if kind == "reduce_scatter":
        y = torch.empty(n // W, device=dev, dtype=dtype)
        return (lambda: collectives.reduce_scatter(y, x, group=world.group)), \
            n * x.element_size()
    if kind == "all_to_all":
        y = torch.empty(n, device=dev, dtype=dtype)
        return (lambda: dist.all_to_all_single(y, x, group=world.group)), n * x.element_size()
    raise ValueError(f"unknown collective {kind!r}")


def bytes_lasting(curve, ms: float, most: int = 1 << 30) -> int:
    """The smallest power-of-two message (>= 1 MiB, <= ``most``) whose interpolated collective
    time on ``curve`` ((bytes, ms), ...) reaches ``ms``."""
    cal = Calibration(wave_ms=1.0, tiles_per_wave=1, comm_curve=curve)
    n = MIB
    while n < most and cal.comm_ms(n) < ms:
        n *= 2
    return n


def measure_beside(world, gemm, reset, coll, iters: int) -> dict:
    """The signal GEMM (``gemm()``) and the collective ``coll()`` launched together (the GEMM
    first, as in the op, so the collective's kernels get the SMs the GEMM leaves; the collective
    on another stream; plain launches), and each alone. Returns the slowest rank's medians
    ``gemm_alone_ms``, ``comm_alone_ms``, ``gemm_beside_ms``, ``comm_beside_ms`` (from their
    common start to the collective's end), ``slowdown`` = gemm_beside / gemm_alone and
    ``comm_slowdown`` (``invert_comm_slowdown``). ``reset()`` zeroes the counters the GEMM
    bumped. Device only (the CPU backend runs everything in order)."""
    dev = world.device
    mod = torch.get_device_module(dev)
    main, side = mod.current_stream(dev), mod.Stream(device=dev)

    def run(with_gemm: bool, with_coll: bool) -> tuple:
        g_times, c_times = [], []
        for i in range(iters + 3):  # 3 warm-up iterations
            world.barrier()
            ev = [mod.Event(enable_timing=True) for _ in range(3)]
            ev[0].record(main)
            side.wait_stream(main)  # the collective starts with the GEMM, not before
            if with_gemm:
                gemm()
            ev[1].record(main)
            if with_coll:
                with mod.stream(side):
                    coll()
            ev[2].record(side)
            main.wait_stream(side)
            mod.synchronize(dev)
            if i >= 3:
                g_times.append(ev[0].elapsed_time(ev[1]))
                c_times.append(ev[0].elapsed_time(ev[2]))
        return statistics.median(g_times), statistics.median(c_times)

    try:
        gemm_alone = run(True, False)[0]
        comm_alone = run(False, True)[1]
        gemm_beside, comm_beside = run(True, True)
    finally:
        mod.synchronize(dev)
        reset()
        mod.synchronize(dev)
    t = [max(x) for x in zip(*world.all_gather_object(
        (gemm_alone, comm_alone, gemm_beside, comm_beside)))]
    return {"gemm_alone_ms": t[0], "comm_alone_ms": t[1], "gemm_beside_ms": t[2],
            "comm_beside_ms": t[3], "slowdown": t[2] / t[0],
            "comm_slowdown": invert_comm_slowdown(t[2], t[1], t[3])}


def _warmup(dev) -> int:
    """Warm-up runs before timing: a device loads kernels and settles clocks; the CPU backend
    (the interpreter, emulated ranks) has nothing to warm, and each run costs it ~0.5 s."""
    return 0 if dev.type == "cpu" else 3


def curve_sizes(total_bytes: int) -> list:
    """Message sizes of the calibration curve: powers of two from 1 MiB to the first at least
    ``total_bytes`` (a whole-output collective), at least two points."""
    sizes = [MIB]
    while sizes[-1] < total_bytes or len(sizes) < 2:
        sizes.append(sizes[-1] * 2)
    return sizes


def calibrate(ctx, kind: str, a, b, out, *, config=None, iters: int = 20,
              curve_iters: int = 10, graph: bool = False) -> tuple:
    """Collective: ``(Calibration, phases, record)`` for ``kind`` on these tensors (module
    docstring, step 1); rank 0's numbers on every rank. ``record`` is a JSON-able summary."""
    world, dev = ctx.world, ctx.device
    warm = _warmup(dev)
    p = ctx.phases(kind, a, b, out, config=config)
    try:
        gemm_ms = time_call(p["gemm"], world, iters=iters, warmup=warm, graph=graph)
    finally:
        ctx.backend.synchronize(dev)
        p["reset"]()  # the GEMM alone bumped the counters the op's waits read
        ctx.backend.synchronize(dev)
    reorder_ms = time_call(p["reorder"], world, iters=iters, warmup=warm, graph=graph)
    total = p["n_tiles"] * p["tile_bytes"]
    curve = measure_comm_curve(world, kind, curve_sizes(total), a.dtype, iters=curve_iters)
    curve = world.broadcast_object(curve)
    beside = {"slowdown": 1.0, "comm_slowdown": 1.0}
    if dev.type != "cpu":  # nothing runs side by side on the CPU backend
        fn, real = collective_fn(kind, bytes_lasting(curve, gemm_ms), world, a.dtype)
        beside = {**measure_beside(world, p["gemm"], p["reset"], fn, curve_iters),
                  "bytes": real}
    cal = Calibration(wave_ms=gemm_ms * p["programs"] / p["n_tiles"],
                      tiles_per_wave=p["programs"], comm_curve=curve,
                      slowdown=max(1.0, beside["slowdown"]), reorder_ms=reorder_ms,
                      comm_slowdown=beside["comm_slowdown"])
    cal = world.broadcast_object(cal)
    record = {"gemm_ms": gemm_ms, "reorder_ms": reorder_ms, "programs": p["programs"],
              "n_tiles": p["n_tiles"], "dests": p["dests"], "tile_bytes": p["tile_bytes"],
              "comm_curve": [list(x) for x in curve], "slowdown": cal.slowdown,
              "comm_slowdown": cal.comm_slowdown}
    return cal, p, record


def tune_partition(ctx, kind: str, a: torch.Tensor, b: torch.Tensor, *,
                   config=None, top_k: int = 4, iters: int = 20, graph: Optional[bool] = None,
                   cache: Optional[TuningCache] = None):
    """Collective: ``config`` (or the context's) with the ``partition`` and ``reserve_sms``
    that measured fastest for ``kind`` ("all_reduce", "reduce_scatter", "all_to_all") on tensors
    shaped like ``a`` and ``b``, among the predictor's ``top_k``, one group and the default
    (module docstring). Cached per (op, shape, dtype, world size, ranks per host, device,
    tiling, reserve, versions): a cached decision costs one exchange of the cache entries.
    ``graph`` (default: on a GPU) times CUDA-graph replays, as the benchmarks do; call it
    outside graph capture."""
    if kind not in KINDS:
        raise ValueError(f"gemm_signal tune: kind must be one of {sorted(KINDS)}, got {kind!r}")
    if top_k < 1 or iters < 1:
        raise ValueError(f"gemm_signal tune: top_k and iters must be >= 1, got {top_k}, {iters}")
    base = config or ctx.config
    # the partition is what is tuned: plan with the default one, whatever base says
    base = dataclasses.replace(base, partition=None)
    ctx.check()  # a closed or broken context: raised here, before any collective
    # inputs refused on some ranks only are raised on every rank, after the ranks compared
    # their checks (bounded), not on those ranks alone while the others wait for them
    try:
        op, cfg, M, N, K, out_rows = ctx.check_call(kind, a, b, base)
        refusal = None
    except (ValueError, TypeError) as e:
        refusal = e
    ctx.world.check_same_or_raise("gemm_signal tune: the call's checks", None, refusal,
                                  gather=ctx._bounded_gather("gemm_signal tune", "call check"))
    graph = ctx.device.type != "cpu" if graph is None else graph
    plan = ctx.plan_call(kind, op, M, N, K, a.dtype, cfg)
    # every rank's K, not this rank's: ``decide`` compares the ranks' entries of one key, and
    # ranks whose K shards differ each found the entry of a uniform K of their own (tuned
    # earlier, into a shared file) and raised a mismatch where the entries differed
    shape = {"M": M, "N": N, "K": ctx.world.all_gather_object(K),
             "tiling": dataclasses.asdict(plan.mm), "programs": plan.programs, "gate": cfg.gate}
    key = cache_key(f"{op}.partition", shape, a.dtype, ctx.size, ctx.world.facts.name,
                    ctx.world.host_layout())

    def compute():
        out = torch.empty((out_rows, N), dtype=a.dtype, device=a.device)
        ctx.run(kind, a, b, out, None, None, cfg)  # plans, loads and checks the ranks agree
        ctx.synchronize()
        cal, p, record = calibrate(ctx, kind, a, b, out, config=cfg, iters=iters, graph=graph)
        ranked = search_top(p["n_tiles"], cal, p["tile_bytes"], top_k, multiple_of=p["dests"])
        cands, seen = [], set()
        for sizes, why in ([(g.sizes, "predicted") for g, _ in ranked]
                           + [((p["n_tiles"],), "one group"), (p["groups"].sizes, "default")]):
            if tuple(sizes) not in seen:
                seen.add(tuple(sizes))
                cands.append((tuple(sizes), why))
        cands = ctx.world.broadcast_object(cands)  # every rank measures the same list
        rows = []

        def measure(sizes, why, reserve):
            c = dataclasses.replace(cfg, partition=sizes, reserve_sms=reserve)
            run = lambda: ctx.run(kind, a, b, out, None, None, c)  # noqa: E731
            run()  # the plan's first call: unguarded, loads, checks (never in a capture)
            ctx.synchronize()
            ms = time_call(run, ctx.world, iters=iters, warmup=_warmup(ctx.device),
                           graph=graph)
            ctx.check()
            rows.append({"partition": list(sizes), "why": why, "reserve_sms": reserve,
                         "measured_ms": ms,
                         "predicted_ms": predict_ms(sizes, cal, p["tile_bytes"])})

        for sizes, why in cands:
            measure(sizes, why, cfg.reserve_sms)
        # The SM reserve helps only collectives that run beside the GEMM; where they do not
        # (NCCL on 2x H200: comm_slowdown 5-717) it only slows the GEMM (reserve 0 measured
        # 4-7 % faster at 8192^3). So the fastest partition and one group are
        # also measured with the other reserve (none, or 16 of 132 SMs when none is
        # configured), and the reserve is part of the decision.
        sms = ctx.world.facts.sm_count
        configured = sms - ctx.world.facts.gate_programs - ctx.grid_programs(cfg)
        other = 0 if configured else round(ALT_RESERVE_PER_132 * sms / 132)
        if other != configured:
            lead = min(rows, key=lambda r: r["measured_ms"])["partition"]
            for sizes in {tuple(lead): None, (p["n_tiles"],): None}:
                measure(sizes, "other reserve", other)
        best = min(rows, key=lambda r: r["measured_ms"])
        return {"partition": best["partition"], "reserve_sms": best["reserve_sms"],
                "candidates": rows, "calibration": record}

    def config_of(value) -> SignalConfig:
        """The config a decision gives; raises where ``value`` is none of this shape's (an
        entry edited by hand: ``decide`` then makes it again)."""
        c = dataclasses.replace(base, partition=tuple(value["partition"]),
                                reserve_sms=value.get("reserve_sms", base.reserve_sms))
        WaveGroups(c.partition).validate(plan.groups.n_tiles, plan.dests,
                                         what="cached partition")
        # a config the call's plan would refuse is no decision either
        ctx.grid_programs(c)  # an SM reserve this device cannot leave
        if len(c.partition) > MAX_GROUPS:
            raise ValueError(f"cached partition: at most {MAX_GROUPS} wave groups, got "
                             f"{len(c.partition)}")
        return c

    return config_of(decide(ctx.world, key, compute, cache, valid=config_of))
