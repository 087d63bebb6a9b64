"""The wave-group predictor against the real op: its error against measured times, and the
search's pick against a bounded exhaustive search (issue 4, item 4: mean error < 10 %, the pick
>= 97 % of the best's speed). Run under torchrun:

    torchrun --nproc-per-node 2 -m benchmarks.bench_wave_predictor --out results.jsonl \
        --device-kind nvidia-h200-x2 [--shapes 4096x8192x8192,...] [--max-candidates 32] \
        [--max-groups 4] [--iters 50] [--ops all_reduce,reduce_scatter] [--budget-s 120] \
        [--no-slowdown] [--no-comm-terms] [--no-graph]

Shapes are (M, N, K) with K split over the ranks, as in bench_gemm_signal (each rank holds
a [M, K/W], b [K/W, N]); GEMM + AllReduce and GEMM + ReduceScatter of bf16.

Calibration (``schedule.predict.Calibration``), never fitted to the op's own times:
- per (collective, dtype): the collective's time against message size, 1 MiB .. 256 MiB, twice:
  CUDA-graph replay timed by events (``comm_curve``, what the prediction uses: the op's
  collectives are captured too) and ``schedule.measure_comm_curve`` (host-timed plain launches,
  reported as a variant); ``group_overhead_ms``: ``GROUP_RUN`` collectives of one size back to
  back in one CUDA graph, each behind a stream wait and write as in the op, against one of them
  alone the same way (``(t_k - k * t_1) / (k - 1)``), averaged over ``GROUP_BYTES``, not below
  minus the curve's smallest time;
- per (collective, dtype), at the first shape: the signal GEMM (``GemmSignal.phases``) and a
  collective lasting about as long launched together (the GEMM first, the collective on another
  stream, plain launches), each also alone: ``slowdown`` = the GEMM's time beside the collective
  over its time alone, ``comm_slowdown`` = ``schedule.predict.invert_comm_slowdown`` of the
  GEMM's time, the collective's time alone and its end beside the GEMM (from their common
  start);
- per shape: the signal GEMM alone (graph replay): ``tiles_per_wave`` is its grid,
  ``wave_ms = gemm_ms * tiles_per_wave / n_tiles``; the reorder alone (``reorder_ms``).

The library's tuner (``GemmSignal.tune``, ``ops/gemm_signal/tune.py``) runs per shape on a fresh
cache (``--top-k`` 0 skips it): its own calibration, the predictor's top ``--top-k`` partitions,
one group and the default measured through the op; its pick is measured again here as role
``tuned`` (``best_over_tuned``: the issue's >= 97 % target for a search that measures a few).

Partitions per shape: ``schedule.candidate_partitions`` (every composition into at most
``--max-groups`` groups of whole units of k waves, the smallest k giving at most
``--max-candidates``), the search's pick (``schedule.search`` with its defaults) and the op's
default partition. With a 116-program GEMM (16 of 132 SMs reserved, ``reserve_sms=16``) that is
15 candidates at 4096x8192x8192 (units of 2 waves) and 26 at 8192x8192x8192 (3 waves) per
collective, about 90 measured partitions in all (18 s on 2x H200); the whole run, tuner
included, takes 18-24 s there. Rank 0 decides the list and broadcasts it. Each is checked
against the reference, then timed (graph replay, median of ``--iters``, slowest rank); a
failing partition is recorded and skipped. The pick and the default are measured first, then
the candidates until ``--budget-s`` seconds have passed since the start.

Predictions per partition: ``main`` (the full calibration; what the search uses) and the
variants ``no_comm_terms`` (``comm_slowdown`` 1, ``group_overhead_ms`` 0: the model before those
terms), ``host_curve`` (the host-timed curve) and ``no_slowdown`` (GEMM ``slowdown`` 1).

Results: JSON lines ``op=wave_predictor`` (one per measured partition: ``kind`` the collective,
``partition``, ``role`` (candidate / search / default), ``predicted_ms``, the protocol's timing
keys), ``wave_predictor_calibration`` and ``wave_predictor_summary`` (mean / max relative error,
best measured vs the pick); a table at the end. benchmarks/refit_wave_predictor.py reads them
back offline.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from benchmarks.bench_gemm_signal import OPS
from benchmarks.cli import BenchParser
from benchmarks.harness import time_op
from benchmarks.runner import rel_err, run_main
from portable_overlap import ContextBrokenError
from portable_overlap.ops.gemm_signal import GemmSignal, SignalConfig
from portable_overlap.ops.gemm_signal.tune import bytes_lasting, collective_fn, measure_beside
from portable_overlap.schedule import (Calibration, TuningCache, candidate_partitions,
                                       measure_comm_curve, predict_ms, search)

SHAPES = [(4096, 8192, 8192), (8192, 8192, 8192)]
MIB = 1 << 20
# message sizes of the curves: a group is 1 .. 2048 tiles of 64 KiB (128 x 256 bf16) at these
# shapes, 7.6 MiB (one 116-tile wave) .. 128 MiB; 1 MiB and 256 MiB bracket them
CURVE_BYTES = [MIB << i for i in range(9)]
TOL = 1e-2  # bf16 relative error of a correct result (bench_gemm_signal's threshold)
# the group overhead's runs: sizes of typical groups at these shapes (1 .. 4 waves of 7.25 MiB),
# points of the curve, and how many collectives back to back
GROUP_BYTES = [8 * MIB, 16 * MIB, 32 * MIB]
GROUP_RUN = 4


def say(world, msg: str) -> None:
    if world.rank == 0:
        print(msg, flush=True)


def comm_curve_graph(world, kind: str, sizes, iters: int) -> tuple:
    """((bytes, ms), ...) of the collective per rank's message size: CUDA-graph replay, slowest
    rank's median (the harness's timer)."""
    curve = []
    for nbytes in sizes:
        fn, real = collective_fn(kind, nbytes, world)
        curve.append((real, time_op(fn, world, graph=True, iters=iters, warmup=5)["median_ms"]))
        del fn
    return tuple(curve)


def group_overhead(world, kind: str, iters: int) -> dict:
    """``group_overhead_ms``: per size of ``GROUP_BYTES``, ``GROUP_RUN`` collectives back to back
    in one CUDA graph (``t_k``) and one (``t_1``), each behind a stream wait (passing at once) and
    a stream write on a counter as in the op; ``(t_k - k t_1) / (k - 1)`` averaged over the
    sizes. Returns it with the per-size figures."""
    be, dev = world.backend, world.device
    flag = torch.zeros(1, dtype=torch.int32, device=dev)  # waits for >= 0: pass at once
    per = []
    for nbytes in GROUP_BYTES:
        fn, real = collective_fn(kind, nbytes, world)

        def chain(k, fn=fn):
            h = be.current_stream(dev)
            for _ in range(k):
                be.stream_wait_value(h, flag.data_ptr(), 0)
                be.stream_write_value(h, flag.data_ptr(), 0)
                fn()

        t1 = time_op(lambda: chain(1), world, graph=True, iters=iters, warmup=5)["median_ms"]
        tk = time_op(lambda: chain(GROUP_RUN), world, graph=True, iters=iters,
                     warmup=5)["median_ms"]
        per.append({"bytes": real, "t1_ms": t1, "tk_ms": tk,
                    "overhead_ms": (tk - GROUP_RUN * t1) / (GROUP_RUN - 1)})
        del fn
    return {"group_overhead_ms": statistics.fmean(p["overhead_ms"] for p in per),
            "k": GROUP_RUN, "sizes": per}


def summarize(rows: list, variants=("main",)) -> dict:
    """Per-shape figures from the measured partitions. ``rows``: dicts with ``partition``,
    ``roles`` (a collection of "candidate" / "search" / "default"), ``measured_ms`` (None: not
    measured) and ``predicted`` ({variant: ms}). Returns the mean and max of
    ``|predicted - measured| / measured`` per variant over the measured rows, the best measured
    partition (over every measured row) against the search's pick (``best_over_pick`` =
    best / pick, 1 when the pick is the best), and the partition the model ranks first among the
    measured candidates against the best (``best_over_model_best``)."""
    done = [r for r in rows if r.get("measured_ms") is not None]
    out = {"n_measured": len(done),
           "n_candidates": sum("candidate" in r["roles"] for r in rows)}
    for v in variants:
        errs = [abs(r["predicted"][v] - r["measured_ms"]) / r["measured_ms"] for r in done
                if r["predicted"].get(v) is not None]  # None: another SM reserve (the tuner's)
        out[f"mean_err[{v}]"] = statistics.fmean(errs) if errs else None
        out[f"max_err[{v}]"] = max(errs) if errs else None
    out["mean_err"], out["max_err"] = out[f"mean_err[{variants[0]}]"], \
        out[f"max_err[{variants[0]}]"]
    best = min(done, key=lambda r: r["measured_ms"], default=None)
    out["best_ms"] = best["measured_ms"] if best else None
    out["best_partition"] = list(best["partition"]) if best else None
    for role in ("search", "default", "tuned"):
        r = next((r for r in rows if role in r["roles"]), None)
        got = r is not None and r.get("measured_ms") is not None
        key = "pick" if role == "search" else role
        out[f"{key}_ms"] = r["measured_ms"] if got else None
        out[f"{key}_partition"] = list(r["partition"]) if r else None
        out[f"{key}_predicted_ms"] = r["predicted"][variants[0]] if r else None
    out["pick_in_candidates"] = any("search" in r["roles"] and "candidate" in r["roles"]
                                    for r in rows)
    out["best_over_pick"] = best["measured_ms"] / out["pick_ms"] if best and out["pick_ms"] \
        else None
    out["best_over_tuned"] = best["measured_ms"] / out["tuned_ms"] \
        if best and out["tuned_ms"] else None
    cands = [r for r in done if "candidate" in r["roles"]]
    top = min(cands, key=lambda r: r["predicted"][variants[0]], default=None)
    out["model_best_partition"] = list(top["partition"]) if top else None
    out["best_over_model_best"] = best["measured_ms"] / top["measured_ms"] if top else None
    return out


class Run:
    """The benchmark's state on one rank: the shared run (world, arguments, writer), the op
    context (rebuilt when a failure broke it), the clock."""

    def __init__(self, bench):
        self.bench = bench
        self.args = bench.args
        self.world = bench.world
        self.W = self.world.world_size
        self.ctx = GemmSignal(self.world)
        self.writer = bench.writer
        self.t0 = time.perf_counter()
        self.graph = bench.args.graphs[0]
        self.table = []
        import tempfile  # the tuner's caches: fresh per run, so every shape is tuned anew

        self.tmp = tempfile.mkdtemp(prefix="po-tune-")

    def elapsed(self) -> float:
        # rank 0's clock decides, so every rank stops at the same partition
        return self.world.broadcast_object(time.perf_counter() - self.t0)

    def heal(self) -> None:
        """A new context on every rank if a failure broke this one on any rank."""
        try:
            self.ctx.check()
            broken = False
        except ContextBrokenError:
            broken = True
        if any(self.world.all_gather_object(broken)):
            say(self.world, "  (context broken by a failure: a new one)")
            torch.cuda.synchronize()
            self.ctx.close()
            self.ctx = GemmSignal(self.world)

    def measure(self, fused_fn, a, b, out, ref, part, cfg=None) -> tuple:
        """(timing dict or None, rel_err, failure text or None) of the op with partition
        ``part`` (None: the default) or the whole config ``cfg``; checked before it is
        timed (``Bench.check_impl``: every rank decides alike whether to time)."""
        world = self.world
        cfg = cfg or (SignalConfig(partition=part) if part else None)
        name = f"partition {list(part) if part else 'default'}"

        def check(_):
            out.fill_(float("nan"))
            fused_fn(a, b, self.ctx, out, config=cfg)
            self.ctx.synchronize()
            return rel_err(out, ref)

        err = self.bench.check_impl(name, check)
        if not err < TOL:
            self.heal()
            return None, err, ("failed (reason printed above)" if err == float("inf")
                               else f"wrong result (rel_err {err:.2e})")
        r = self.bench.time_impl(name, lambda: fused_fn(a, b, self.ctx, out, config=cfg),
                                 self.graph)
        if not all(world.all_gather_object(r is not None)):
            self.heal()  # every rank, whichever failed
            return None, err, "timing failed (on this rank or another)"
        return r, err, None

    def calibrate_collective(self, kind: str) -> dict:
        world, it = self.world, self.args.curve_iters
        t = time.perf_counter()
        graph = comm_curve_graph(world, kind, CURVE_BYTES, it)
        host = measure_comm_curve(world, kind, CURVE_BYTES, torch.bfloat16, iters=it)
        graph, host = world.broadcast_object((graph, host))
        say(world, f"[{kind}] comm curve (MiB: graph ms / host ms): " + ", ".join(
            f"{b // MIB}: {tg:.3f}/{th:.3f}" for (b, tg), (_, th) in zip(graph, host))
            + f"  ({time.perf_counter() - t:.1f} s)")
        try:
            oh = group_overhead(world, kind, it)
        except Exception as e:  # the model runs without it
            say(world, f"[{kind}] group overhead not measured ({type(e).__name__}: "
                       f"{str(e)[:160]}): 0")
            torch.cuda.synchronize()
            oh = {"group_overhead_ms": 0.0, "failure": f"{type(e).__name__}: {str(e)[:200]}"}
        # back-to-back collectives cannot share more of their per-call cost than a whole call
        floor = -min(t for _, t in graph)
        if oh["group_overhead_ms"] < floor:
            oh = {**oh, "group_overhead_ms": floor, "clamped_from": oh["group_overhead_ms"]}
        oh = world.broadcast_object(oh)
        say(world, f"[{kind}] group overhead {oh['group_overhead_ms'] * 1e3:+.1f} us (" + ", ".join(
            f"{p['bytes'] // MIB} MiB: 1 {p['t1_ms']:.3f} / {oh['k']} {p['tk_ms']:.3f} ms"
            for p in oh.get("sizes", ())) + ")")
        return {"graph": graph, "host": host, "beside": None, "group_overhead": oh}

    def calibrate_shape(self, kind, coll, a, b, out, shape) -> tuple:
        """(Calibration, the phases dict, calibration record) for this shape; the two slowdowns
        are measured at the first shape of ``kind`` and reused."""
        world, it = self.world, self.args.iters
        p = self.ctx.phases(kind, a, b, out)
        try:
            gemm_ms = time_op(p["gemm"], world, graph=True, iters=it, warmup=5)["median_ms"]
        finally:
            torch.cuda.synchronize()
            p["reset"]()  # the GEMM alone bumped the counters the op's waits read
            torch.cuda.synchronize()
        reorder_ms = time_op(p["reorder"], world, graph=True, iters=it, warmup=5)["median_ms"]
        if coll["beside"] is None:
            # a collective lasting at least the GEMM alone: it runs beside the whole GEMM
            # (the GEMM's slowdown) and its end tells how far it got beside it
            nbytes = bytes_lasting(coll["graph"], gemm_ms)
            fn, real = collective_fn(kind, nbytes, world)
            try:
                m = measure_beside(world, p["gemm"], p["reset"], fn, self.args.curve_iters)
            except Exception as e:  # the model runs without them
                say(world, f"[{kind}] slowdowns not measured ({type(e).__name__}: "
                           f"{str(e)[:160]}): 1.0")
                m = {"slowdown": 1.0, "comm_slowdown": 1.0,
                     "failure": f"{type(e).__name__}: {str(e)[:200]}"}
            del fn
            coll["beside"] = world.broadcast_object({**m, "bytes": real})
        raw = coll["beside"]["slowdown"]
        comm_terms = not self.args.no_comm_terms
        cal = Calibration(wave_ms=gemm_ms * p["programs"] / p["n_tiles"],
                          tiles_per_wave=p["programs"], comm_curve=coll["graph"],
                          slowdown=1.0 if self.args.no_slowdown else max(1.0, raw),
                          reorder_ms=reorder_ms,
                          comm_slowdown=coll["beside"]["comm_slowdown"] if comm_terms else 1.0,
                          group_overhead_ms=coll["group_overhead"]["group_overhead_ms"]
                          if comm_terms else 0.0)
        cal = world.broadcast_object(cal)  # rank 0's numbers: every rank searches alike
        rec = {"gemm_ms": gemm_ms, "wave_ms": cal.wave_ms, "tiles_per_wave": cal.tiles_per_wave,
               "n_tiles": p["n_tiles"], "dests": p["dests"], "tile_bytes": p["tile_bytes"],
               "reorder_ms": reorder_ms, "slowdown": cal.slowdown,
               "comm_slowdown": cal.comm_slowdown, "group_overhead_ms": cal.group_overhead_ms,
               "beside_measured": coll["beside"], "group_overhead_measured": coll["group_overhead"],
               "comm_curve": [list(x) for x in coll["graph"]],
               "comm_curve_host": [list(x) for x in coll["host"]]}
        say(world, f"[{kind} {shape}] gemm {gemm_ms:.3f} ms = {p['n_tiles']} tiles / "
                   f"{p['programs']} per wave, wave {cal.wave_ms:.4f} ms, reorder "
                   f"{reorder_ms:.3f} ms, slowdown {cal.slowdown:.3f} (measured {raw:.3f}), "
                   f"comm slowdown {cal.comm_slowdown:.3g}, group overhead "
                   f"{cal.group_overhead_ms * 1e3:+.1f} us")
        return cal, p, rec

    def one_shape(self, kind, coll, M, N, K) -> None:
        args, world, W, dev = self.args, self.world, self.W, self.world.device
        _, fused_fn, ref_fn = OPS[kind]
        name = f"{M}x{N}x{K}"
        Kl = K // W
        shape = {"M": M, "N": N, "K": K, "K_local": Kl}
        gen = torch.Generator(device=dev).manual_seed(1000 * M + world.rank)
        a = torch.randn(M, Kl, generator=gen, device=dev, dtype=torch.float32).bfloat16()
        b = torch.randn(Kl, N, generator=gen, device=dev, dtype=torch.float32).bfloat16()
        out = torch.empty(M // W if kind == "reduce_scatter" else M, N, device=dev,
                          dtype=torch.bfloat16)
        ref = ref_fn(a, b, world.group).float()
        # the default partition first: plans, loads the kernels, checks the result, and fills
        # the receive buffer the reorder is then timed on
        first, first_err, why = self.measure(fused_fn, a, b, out, ref, None)
        if first is None:
            say(world, f"[{kind} {name}] the op fails with its default partition ({why}): "
                       f"shape skipped")
            return
        try:
            cal, p, rec = self.calibrate_shape(kind, coll, a, b, out, name)
        except Exception as e:
            say(world, f"[{kind} {name}] calibration failed ({type(e).__name__}: "
                       f"{str(e)[:200]}): shape skipped")
            torch.cuda.synchronize()
            self.heal()
            return
        n_tiles, dests, tile_bytes = p["n_tiles"], p["dests"], p["tile_bytes"]
        if world.rank == 0:
            self.writer.write(op="wave_predictor_calibration", shape=shape, dtype="bf16",
                              kind=kind, **rec)
        variants = {"main": cal,
                    "no_comm_terms": dataclasses.replace(cal, comm_slowdown=1.0,
                                                         group_overhead_ms=0.0),
                    "host_curve": dataclasses.replace(cal, comm_curve=coll["host"]),
                    "no_slowdown": dataclasses.replace(cal, slowdown=1.0)}
        # the library's tuner (GemmSignal.tune: its own calibration, the predictor's top
        # partitions, one group and the default measured through the op), on a fresh cache
        tuned, tune_s = None, None  # the tuner's config: partition and SM reserve
        if args.top_k:
            t = time.perf_counter()
            try:
                cache = TuningCache(f"{self.tmp}/{kind}-{name}-rank{world.rank}.json")
                tuned = self.ctx.tune(kind, a, b, cache=cache, top_k=args.top_k,
                                      iters=args.tune_iters)
                tune_s = time.perf_counter() - t
                say(world, f"[{kind} {name}] tuner picked {list(tuned.partition)}, reserve "
                           f"{tuned.reserve_sms} in {tune_s:.1f} s")
                if world.rank == 0:
                    self.writer.write(op="wave_predictor_tuning", shape=shape, dtype="bf16",
                                      kind=kind, top_k=args.top_k, tune_s=tune_s,
                                      **next(iter(cache.entries.values())))
            except Exception as e:
                say(world, f"[{kind} {name}] tuner failed ({type(e).__name__}: "
                           f"{str(e)[:200]})")
                torch.cuda.synchronize()
                self.heal()
        plan = None
        if world.rank == 0:  # rank 0 decides the partitions; the others take its list
            roles: dict = {}
            pick, _ = search(n_tiles, cal, tile_bytes, multiple_of=dests)
            roles.setdefault(tuple(pick.sizes), []).append("search")
            roles.setdefault(tuple(p["groups"].sizes), []).append("default")
            if tuned is not None and tuned.reserve_sms == self.ctx.config.reserve_sms:
                roles.setdefault(tuple(tuned.partition), []).append("tuned")
            for c in candidate_partitions(n_tiles, cal.tiles_per_wave, multiple_of=dests,
                                          max_groups=args.max_groups, cap=args.max_candidates):
                roles.setdefault(tuple(c), []).append("candidate")
            # the pick and the default first: they are never cut by the time budget
            plan = sorted(roles.items(), key=lambda kv: kv[1] == ["candidate"])
        plan = world.broadcast_object(plan)
        n_cand = sum("candidate" in r for _, r in plan)
        say(world, f"[{kind} {name}] {len(plan)} partitions ({n_cand} candidates, cap "
                   f"{args.max_candidates}, <= {args.max_groups} groups); search picked "
                   f"{next(pt for pt, r in plan if 'search' in r)}")
        rows = []
        for i, (part, roles) in enumerate(plan):
            pred = {v: predict_ms(part, c, tile_bytes) for v, c in variants.items()}
            row = {"partition": part, "roles": roles, "predicted": pred, "measured_ms": None}
            rows.append(row)
            if roles == ["candidate"] and self.elapsed() > args.budget_s:
                say(world, f"  {i + 1}/{len(plan)} {list(part)}: skipped (budget "
                           f"{args.budget_s:.0f} s spent)")
                continue
            if tuple(p["groups"].sizes) == part:
                r, err = first, first_err  # the default partition: measured above
            else:
                r, err, why = self.measure(fused_fn, a, b, out, ref, part)
            if r is None:
                say(world, f"  {i + 1}/{len(plan)} {list(part)} {'/'.join(roles)}: {why}")
                row["failure"] = why
                continue
            row["measured_ms"] = r["median_ms"]
            e = (pred["main"] - r["median_ms"]) / r["median_ms"]
            say(world, f"  {i + 1}/{len(plan)} {'/'.join(roles):>16} {len(part)} groups "
                       f"{list(part)}: measured {r['median_ms']:.3f} predicted "
                       f"{pred['main']:.3f} ms ({e:+.1%})")
            if world.rank == 0:
                self.writer.write(op="wave_predictor", shape=shape, dtype="bf16", impl="fused",
                                  graph=self.graph, **{k: round(v, 5) for k, v in r.items()},
                                  kind=kind, partition=list(part), role=roles,
                                  predicted_ms=round(pred["main"], 5),
                                  predicted_variants={k: round(v, 5) for k, v in pred.items()},
                                  rel_err=err)
        if tuned is not None and tuned.reserve_sms != self.ctx.config.reserve_sms:
            # the tuner kept another SM reserve: its config measured as it is (the model's
            # calibration holds for the default grid only, so no prediction)
            r, err, why = self.measure(fused_fn, a, b, out, ref, None, cfg=tuned)
            row = {"partition": tuple(tuned.partition), "roles": ["tuned"],
                   "predicted": {v: None for v in variants},
                   "measured_ms": r["median_ms"] if r else None}
            rows.append(row)
            say(world, f"  tuned (reserve {tuned.reserve_sms}) {list(tuned.partition)}: "
                       + (f"measured {r['median_ms']:.3f} ms" if r else str(why)))
            if r and world.rank == 0:
                self.writer.write(op="wave_predictor", shape=shape, dtype="bf16", impl="fused",
                                  graph=self.graph, **{k: round(v, 5) for k, v in r.items()},
                                  kind=kind, partition=list(tuned.partition), role=["tuned"],
                                  reserve_sms=tuned.reserve_sms, rel_err=err)
        s = summarize(rows, tuple(variants))
        if world.rank == 0:
            # (impl: the protocol's key, which every summary row carries)
            self.writer.write(op="wave_predictor_summary", shape=shape, dtype="bf16",
                              impl="fused", graph=self.graph, kind=kind,
                              max_candidates=args.max_candidates, max_groups=args.max_groups,
                              iters=args.iters, **s)
        self.table.append((kind, name, s))

    def print_table(self) -> None:
        if self.world.rank != 0:
            return
        print(f"\nwave-group predictor, {self.W} ranks, "
              f"{'CUDA-graph replay' if self.graph else 'plain launches'}, slowest rank's "
              f"median; err = |predicted - measured| / measured over the measured partitions; "
              f"best/pick: best measured over the search's pick, best/tuned: over the tuner's "
              f"pick (target >= 0.97)")
        print(f"{'kind':>14} {'M x N x K':>15} {'n':>3} {'mean':>6} {'max':>6} {'best':>7} "
              f"{'pick':>7} {'default':>7} {'tuned':>7} {'best/pick':>9} {'best/tuned':>10}  "
              f"pick partition / tuned partition")
        f = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
        for kind, name, s in self.table:
            print(f"{kind:>14} {name:>15} {s['n_measured']:>3} {f(s['mean_err'], '6.1%')} "
                  f"{f(s['max_err'], '6.1%')} {f(s['best_ms'], '7.3f')} "
                  f"{f(s['pick_ms'], '7.3f')} {f(s['default_ms'], '7.3f')} "
                  f"{f(s['tuned_ms'], '7.3f')} {f(s['best_over_pick'], '9.3f')} "
                  f"{f(s['best_over_tuned'], '10.3f')}  {s['pick_partition']} / "
                  f"{s['tuned_partition']}")
        print("mean err by calibration (main: graph-timed curve, both slowdowns, group overhead; "
              "no_comm_terms: comm_slowdown 1, group overhead 0; host_curve: measure_comm_curve; "
              "no_slowdown: GEMM slowdown 1):")
        for kind, name, s in self.table:
            print(f"{kind:>14} {name:>15} " + "  ".join(
                f"{k[9:-1]} {f(v, '.1%')}" for k, v in s.items() if k.startswith("mean_err[")))
        print(f"total {time.perf_counter() - self.t0:.0f} s", flush=True)


def parser() -> BenchParser:
    ap = BenchParser(__doc__, dims=("M", "N", "K"),
                     split_dims=("M", "K"), shapes=SHAPES, dtypes=("bf16",), iters=50,
                     warmup=10, graphs=(True,))
    ap.add_choices("--ops", ("all_reduce", "reduce_scatter"), "all_reduce,reduce_scatter")
    ap.add_argument("--max-candidates", type=int, default=32,
                    help="cap of the exhaustive set per shape (the unit of waves grows to fit)")
    ap.add_argument("--max-groups", type=int, default=4)
    ap.add_argument("--curve-iters", type=int, default=20,
                    help="timed iterations per message size and for the slowdown")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="no further candidates after this many seconds (the search's pick and "
                         "the default are always measured)")
    ap.add_argument("--top-k", type=int, default=4,
                    help="the library tuner's measured top partitions (0: no tuner run)")
    ap.add_argument("--tune-iters", type=int, default=20,
                    help="the tuner's timed iterations per partition and curve point")
    ap.add_argument("--no-slowdown", action="store_true",
                    help="predict and search with slowdown 1 (still measured and recorded)")
    ap.add_argument("--no-comm-terms", action="store_true",
                    help="predict and search with comm_slowdown 1 and group overhead 0 (still "
                         "measured and recorded)")
    return ap


def body(bench) -> int:
    if len(bench.args.graphs) != 1:
        bench.say("one graph mode at a time: --graph graph (the default) or --no-graph")
        return 2
    run = Run(bench)
    for kind in [k for k in bench.args.ops.split(",") if k]:
        try:
            coll = run.calibrate_collective(kind)
        except Exception as e:
            say(run.world, f"[{kind}] comm calibration failed ({type(e).__name__}: "
                           f"{str(e)[:200]}): skipped")
            continue
        for s in bench.args.shapes:
            run.one_shape(kind, coll, s["M"], s["N"], s["K"])
    run.print_table()
    run.ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(parser(), body))
