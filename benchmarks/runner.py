"""The loop every benchmark shares, by the protocol in benchmarks/harness.py.

A benchmark script declares its command line (``cli.BenchParser`` plus its own options) and a
``body(bench)`` that builds, per case, the inputs and the impl callables; ``run_main`` parses,
launches or skips per ``--worlds``, starts the world, calls the body and prints the table.
``Bench.run(case)``, for one case:

1. checks each checked impl (by default every ``fused*`` and ``auto*`` one) against the
   reference, on every rank, before anything is timed; the slowest rank's error counts, and a
   wrong impl is not timed;
2. times every impl with ``time_op`` in each graph mode (plain launches, CUDA-graph replay);
3. writes one row per timed impl (the protocol's keys, ``correct``, ``rel_err``, the case's own
   fields) and one ``<op>_summary`` row per graph mode and summarized impl (speedup, fraction of
   ideal);
4. prints the case's lines of the table (``metrics.format_table``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Callable, Mapping, Optional, Sequence, Union

from benchmarks import cli
from benchmarks.metrics import format_table, rounded, summarize
from benchmarks.rows import ResultWriter
from portable_overlap.schedule.tuning import rotated_rounds
from portable_overlap.testing.compare import rel_err  # noqa: F401  (the benchmarks import it from here)


#: the planner's variants every benchmark of a multi-transport op times: ``auto`` with its
#: defaults (it times plain calls and graph replays, and a captured call runs the replays' pick)
AUTO_VARIANTS = {"auto": {}}


def auto_fields(ctx, *args) -> dict:
    """Row fields of an ``auto`` impl: its picks for the call (``ctx.choices``) and the times
    its latest decision measured (``{"ms": ..., "captured": {"ms": ...}}``)."""
    decision = list(ctx.decisions.values())[-1] if ctx.decisions else {}
    return {"pick": ctx.choices(*args),
            "decision_ms": {"plain": decision.get("ms"),
                            "captured": decision.get("captured", {}).get("ms")}}


def auto_contexts(make: Callable[..., object]) -> dict:
    """``{impl name: make(transport="auto", **options)}`` per :data:`AUTO_VARIANTS`: the
    ``transport="auto"`` contexts a benchmark times beside the transports it names. The first
    call of each shape (the check) makes the decision; the timed calls run the pick."""
    return {name: make(transport="auto", **opts) for name, opts in AUTO_VARIANTS.items()}


@dataclasses.dataclass
class Case:
    """One problem of one op: what to time and how to check it.

    ``impls``: {name: callable} in timing order; the roles are ``fused``, ``sequential``,
    ``compute``, ``comm``, ``torch_fused``, anything else a named variant.
    ``check(name)``: runs impl ``name`` once and returns its relative error against the
    reference (raising counts as a failure); ``checked``: the names to check (default: every
    impl whose name starts with ``fused`` or ``auto``); ``tol``: the largest correct error.
    ``fields``: extra row fields, {impl: dict} or a callable ``name -> dict`` (evaluated when the
    row is written, after the checks). ``summarize``: the impls that get summary rows.
    ``notes``: fixed facts about the case; ``derive(times)``: figures from one graph mode's
    {impl: ms}; both go into the summary rows and the printed table. ``plain_only``: impls
    timed with plain launches only (they read on the host, which a CUDA graph cannot hold)."""

    op: str
    shape: Mapping
    dtype: str
    impls: Mapping[str, Callable[[], object]]
    check: Optional[Callable[[str], float]] = None
    checked: Optional[Sequence[str]] = None
    tol: float = 1e-2
    fields: Union[Mapping[str, Mapping], Callable[[str], Mapping], None] = None
    summarize: Sequence[str] = ("fused",)
    notes: Optional[Mapping] = None
    derive: Optional[Callable[[Mapping[str, float]], Mapping]] = None
    label: Optional[str] = None
    plain_only: Sequence[str] = ()

    def checked_names(self) -> list:
        names = self.checked if self.checked is not None else \
            [n for n in self.impls if n.startswith(("fused", "auto"))]
        return [n for n in names if n in self.impls]

    def row_fields(self, name: str) -> dict:
        if self.fields is None:
            return {}
        if callable(self.fields):
            return dict(self.fields(name) or {})
        return dict(self.fields.get(name, {}))

    def title(self) -> str:
        return self.label or f"{cli.format_shape(self.shape)} {self.dtype}"


class Bench:
    """One benchmark run on this rank: the parsed arguments, the world, the results file and
    the cases' records for the table."""

    def __init__(self, args, world):
        self.args = args
        self.world = world
        self.rank, self.W = world.rank, world.world_size
        self.device = world.device
        self.writer = ResultWriter(args.out, args.device_kind, world.world_size)
        self.records: list = []
        #: the --impls names no case has had so far: a typo timed nothing and exited 0
        self.unmatched = set(getattr(args, "impls", ()))
        #: impls that failed their check or their timing, each once: the run's exit status
        #: (a wrong result was printed and the run exited 0)
        self.failed: list = []

    def say(self, msg: str) -> None:
        """Prints on rank 0."""
        if self.rank == 0:
            print(msg, flush=True)

    def write(self, **fields) -> Optional[dict]:
        """Appends a row on rank 0 (``ResultWriter.write``); None elsewhere."""
        return self.writer.write(**fields) if self.rank == 0 else None

    def agree(self, value: float) -> float:
        """The largest of ``value`` over the ranks, so that every rank decides alike."""
        return max(self.world.all_gather_object(value))

    def check_impl(self, name: str, check: Callable[[str], float]) -> float:
        """Relative error of impl ``name`` (``check(name)``), the largest over the ranks; inf
        where it raised (the reason printed by that rank)."""
        try:
            err = float(check(name))
        except Exception as e:
            print(f"rank {self.rank}: {name} failed its check: {type(e).__name__}: "
                  f"{str(e)[-300:]}", flush=True)
            _sync()
            err = float("inf")
        return self.agree(err if math.isfinite(err) else float("inf"))

    def time_impl(self, name: str, fn: Callable, graph: bool, iters: Optional[int] = None,
                  warmup: Optional[int] = None) -> Optional[dict]:
        """``time_op`` of ``fn`` (the slowest rank's median / p10 / p90); None with the reason
        printed when it raised."""
        from benchmarks.harness import time_op

        try:
            return time_op(fn, self.world, graph=graph, iters=iters or self.args.iters,
                           warmup=self.args.warmup if warmup is None else warmup,
                           barrier=getattr(self.args, "barrier", "device"))
        except Exception as e:
            if self.rank == 0:
                print(f"{name} graph={graph} failed: {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
            _sync()
            return None

    def run(self, case: Case) -> dict:
        """Checks, times, writes and prints ``case`` (see the module's docstring); returns
        {(impl, graph): median ms} of what was timed."""
        wanted = getattr(self.args, "impls", ())  # (--impls: a subset of them)
        if wanted:
            self.unmatched -= set(case.impls)
            missing = [n for n in wanted if n not in case.impls]
            if missing:
                self.say(f"{case.title()}: --impls {', '.join(missing)} not among this case's "
                         f"impls ({', '.join(case.impls)})")
            case = dataclasses.replace(case, impls={n: f for n, f in case.impls.items()
                                                    if n in wanted})
        errs = {}
        if self.args.check and case.check is not None:
            for name in case.checked_names():
                errs[name] = self.check_impl(name, case.check)
        correct = {n: bool(e < case.tol) for n, e in errs.items()}
        self.failed += [f"{case.title()}: {n} rel_err {errs[n]:.1e}" for n, ok in correct.items()
                        if not ok]
        if errs:
            self.say(f"{case.title()}: rel_err " + ", ".join(
                f"{n} {e:.1e}{'' if correct[n] else ' WRONG: not timed'}"
                for n, e in errs.items()))
        times = {}
        rounds = max(1, getattr(self.args, "rounds", 1))
        for graph in self.args.graphs:
            names = [n for n in case.impls  # never time a wrong result
                     if correct.get(n) is not False and not (graph and n in case.plain_only)]
            # (--rounds: the impls timed round by round, the order rotated each round; each
            # impl's row is its round with the median median)
            got = {n: [] for n in names}
            for order in rotated_rounds(names, rounds):
                for name in order:
                    r = self.time_impl(name, case.impls[name], graph)
                    if r is not None:
                        got[name].append(r)
                    elif f"{case.title()}: {name} graph={graph} not timed" not in self.failed:
                        self.failed.append(f"{case.title()}: {name} graph={graph} not timed")
            for name in names:
                if not got[name]:
                    continue
                r = sorted(got[name], key=lambda x: x["median_ms"])[len(got[name]) // 2]
                times[(name, graph)] = r["median_ms"]
                if self.rank == 0:
                    fields = {"correct": correct.get(name), "rel_err": errs.get(name),
                              "barrier": getattr(self.args, "barrier", "device"),
                              "rounds": rounds,
                              **case.row_fields(name)}
                    self.write(op=case.op, shape=case.shape, dtype=case.dtype, impl=name,
                               graph=graph, **fields, **rounded(r))
        new = []
        for graph in self.args.graphs:
            t = {n: ms for (n, g), ms in times.items() if g == graph}
            extra = {**(case.notes or {}), **(dict(case.derive(t)) if case.derive else {})}
            for impl in case.summarize:
                if impl in t and "sequential" in t:
                    self.write(op=case.op + "_summary", shape=case.shape, dtype=case.dtype,
                               graph=graph, impl=impl, **rounded(summarize(t, impl), 5),
                               **rounded(extra, 5))
            if not t:
                continue
            ok = correct.get("fused", all(correct.values()) if correct else None)
            new.append({"label": case.title(), "graph": graph, "times": t, "ok": ok,
                        "notes": extra})
        self.records += new
        if self.rank == 0 and new:
            print("\n".join(format_table(new)[1:]), flush=True)
        return times

    def print_table(self) -> None:
        if self.rank == 0 and self.records:
            print("\n" + "\n".join(format_table(self.records)), flush=True)


def _sync() -> None:
    # after a failure: let the device finish what it queued before the next impl starts
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        pass


#: what a benchmark started without GPUs says (CUDA / HIP events time it; the CPU-emulated ranks
#: check the ops, tests/, and run the demo and the examples)
GPU_ONLY = ("the benchmarks time GPU kernels: run them on a GPU machine, one process per GPU "
            "(torchrun, or --worlds)")


def run_main(parser: "cli.BenchParser", body: Callable[[Bench], Optional[int]],
             argv: Optional[Sequence[str]] = None) -> int:
    """Parses ``argv`` (default: the command line); launches the script per ``--worlds`` when
    started alone with that option, or skips when its launcher's world size is not listed;
    otherwise starts the world, runs ``body(bench)``, prints the table and ends the process
    group. Returns the exit status: 1 where an impl gave a wrong result or could not be timed,
    2 for an ``--impls`` name no case has, a world without GPUs or a ``--worlds`` of which no
    size fits the visible devices."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    size = cli.launched_world_size(os.environ)
    if size is None and args.worlds:
        return cli.launch(cli.this_script(), argv, args.worlds)
    if size is not None and args.worlds and size not in args.worlds:
        if os.environ.get("RANK", "0") == "0":
            print(f"skipping: world size {size} is not in --worlds "
                  f"{','.join(map(str, args.worlds))}", flush=True)
        return 0
    import torch.distributed as dist

    from portable_overlap import BackendUnavailable, World

    try:
        world = World.from_env()
    except BackendUnavailable as e:
        print(f"{GPU_ONLY} ({e})", flush=True)
        return 2
    if getattr(getattr(world, "backend", None), "name", None) == "cpu":
        if world.rank == 0:
            print(f"{GPU_ONLY} (this world's ranks are CPU-emulated)", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    bad = [f"{cli.format_shape(shape, parser.dims)}: {d}={shape[d]}" for shape in args.shapes
           for d in getattr(parser, "split_dims", ()) if shape[d] % world.world_size]
    if bad:
        if world.rank == 0:
            print(f"--shapes: {'; '.join(bad)} does not divide by the world size "
                  f"{world.world_size} (each rank holds a share of "
                  f"{', '.join(parser.split_dims)})", flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    bench = Bench(args, world)
    try:
        rc = body(bench) or 0
        bench.print_table()
        if bench.unmatched:
            bench.say(f"--impls {', '.join(sorted(bench.unmatched))}: no case has an impl of "
                      f"that name (each case printed its impls)")
            rc = rc or 2
        if bench.failed:
            bench.say(f"FAILED: {len(bench.failed)} impl(s) gave a wrong result or could not be "
                      f"timed:\n  " + "\n  ".join(bench.failed))
            rc = rc or 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rc


def torch_dtype(name: str):
    """The torch dtype of a ``--dtypes`` name (fp32, fp16, bf16, fp8)."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
            "fp8": torch.float8_e4m3fn}[name]
