"""``transport="auto"`` (ops/planner.py) on the four multi-transport pattern contexts, on
emulated ranks: the results of every transport it can pick, the decision shared by every rank
and reused without timing, the disk cache, the candidates and options it takes and refuses, a
candidate that raises, graph capture of an undecided call, and the context's lifecycle.

Most tests replace ``schedule.tuning.time_call`` in the ranks by :class:`_FakeTimings`, which
runs the timed call once and returns the time the test gave its transport: the interpreter's
timings always pick ``"sequential"``, and the test must steer the pick to each transport."""
import contextlib
import json
import os
import warnings

import pytest
import torch

import portable_overlap as po
from portable_overlap.errors import ConcurrentUseError, ContextClosedError
from portable_overlap.ops import planner
from portable_overlap.ops.gemm_signal import SignalConfig
from portable_overlap.schedule import tuning
from portable_overlap.testing import environ
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.patterns import GEMM_PATTERNS, pattern_inputs

TOL = 1e-5  # fp32


class _FakeTimings:
    """Stands in for ``tuning.time_call``: counts the timings, runs the timed call once and
    returns ``costs[(transport, graph)]`` or ``costs[transport]`` (1.0 for transports not
    listed) for the transport it ran, the same on every rank. It learns the transport from
    the context's ``_run``, which it wraps."""

    def __init__(self, ctx):
        self.count, self.ran, self.costs = 0, [], {}
        run = ctx._run

        def recording(transport, impl, *args):
            self.ran.append(transport)
            return run(transport, impl, *args)

        ctx._run = recording

    def __call__(self, fn, world, *, iters, warmup, graph, host_bound=False):
        self.count += 1
        fn()
        t = self.ran[-1]  # a cost per (transport, graph) where given, else per transport
        return self.costs.get((t, graph), self.costs.get(t, 1.0))


class _CountedTimings:
    """``tuning.time_call`` itself, counted."""

    def __init__(self):
        self.count, self.real = 0, tuning.time_call

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.real(*args, **kwargs)


@contextlib.contextmanager
def _timing(fake):
    real = tuning.time_call
    tuning.time_call = fake
    try:
        yield fake
    finally:
        tuning.time_call = real


def _ag_reference(a, b, group, bias=None, residual=None):
    return po.all_gather_matmul_reference(a, b, group)


def _cases(W):
    """(op, context class, reference, rows of the result, shapes, sizes the context needs)
    per pattern; shapes off every tile (odd N and K; M a multiple of W where rows are split)."""
    out = []
    for name, (make, ref, rows) in GEMM_PATTERNS.items():
        shapes = [(W * (i + 1), 5 + 2 * i, 3 + 2 * i) for i in range(len(make.TRANSPORTS) + 1)]
        out.append((name, make, ref, rows, shapes,
                    (max(s[0] for s in shapes), max(s[1] for s in shapes))))
    shapes = [(2 * i + 1, 5 + 2 * i, 3 + i) for i in range(len(po.AllGatherMatmul.TRANSPORTS)
                                                           + 1)]
    out.append(("all_gather_matmul", po.AllGatherMatmul, _ag_reference,
                lambda m, W: W * m, shapes, (max(m * k for m, _, k in shapes),)))
    return out


def _inputs(world, name, rows, M, N, K, seed):
    """Fresh random inputs of a call (AllGather + GEMM: no bias or residual)."""
    g = torch.Generator().manual_seed(1000 * seed + 10 * world.rank + M)
    a, b, bias, res = pattern_inputs(g, M, N, K, rows(M, world.world_size), torch.float32)
    if name == "all_gather_matmul":
        b = torch.randn(K, N, generator=torch.Generator().manual_seed(seed))  # same everywhere
        return a, b, None, None
    return a, b, bias, res


def _call(name, ctx, a, b, bias, res, out=None):
    fn = getattr(po, name)
    if name == "all_gather_matmul":
        return fn(a, b, ctx, out)
    return fn(a, b, ctx, out, bias=bias, residual=res)


def _forced_picks(world):
    """Each pattern's auto context, one call key per transport with the timings steered to it,
    and one where the fastest fused transport wins by less than the tie margin (sequential is
    kept); each key called twice, the second time through the torch.library op."""
    W = world.world_size
    found, decisions, available = [], {}, {}
    for name, make, ref, rows, shapes, sizes in _cases(W):
        ctx = make(world, *sizes, transport="auto", iters=1, warmup=0)
        fake = _FakeTimings(ctx)
        here = make.available(world)  # the default candidates (torch_fused: GPUs only)
        steer = [(want, {t: 1.0 if t == want else 2.0 for t in here}) for want in here]
        steer.append(("sequential", {**{t: 2.0 for t in here}, here[0]: 1.0,
                                     "sequential": 1.0 + planner.TIE / 2}))
        try:
            with _timing(fake):
                for i, (want, costs) in enumerate(steer):
                    fake.costs = costs
                    M, N, K = shapes[i]
                    for rep in range(2):
                        a, b, bias, res = _inputs(world, name, rows, M, N, K, 2 * i + rep)
                        before = fake.count
                        if rep == 0:
                            out = torch.full((rows(M, W), N), float("nan"))  # poisoned
                            into_out = _call(name, ctx, a, b, bias, res, out) is out
                        else:
                            op = getattr(torch.ops.portable_overlap, name)
                            args = (a, b, ctx.handle) + (() if bias is None else (bias, res))
                            out, into_out = op(*args), True
                        ctx.synchronize()
                        found.append((name, want, rep, ctx.choice(a, b, *(
                            () if bias is None else (bias, res))), into_out,
                            rel_err(out, ref(a, b, world.group, bias, res)),
                            fake.count - before))
            assert all(json.loads(k)["op"] == name for k in ctx.decisions)
            decisions[name] = sorted(d["transport"] for d in ctx.decisions.values())
            available[name] = here
        finally:
            ctx.close()
    return found, decisions, available


def test_every_pick_is_correct_and_reused(world):
    per_rank = world.run(_forced_picks, timeout=540)
    transports = per_rank[0][2]
    assert set(transports) == {c[0] for c in _cases(2)}
    for found, decisions, _ in per_rank:
        assert len(found) == 2 * sum(len(t) + 1 for t in transports.values())
        for name, want, rep, chose, into_out, err, timings in found:
            assert chose == want, (name, want, rep, chose)
            assert into_out and err < TOL, (name, want, rep, err)
            # every candidate timed once at the key's first call, none at the second
            assert timings == (len(transports[name]) if rep == 0 else 0), (name, want, rep,
                                                                           timings)
        for name, picks in decisions.items():
            assert picks == sorted([*transports[name], "sequential"]), (name, picks)
    picks = [[x[:4] for x in found] for found, _, _ in per_rank]
    assert all(p == picks[0] for p in picks[1:])  # the same pick on every rank


def _keys(world):
    """What makes a new call key: shapes, strides (but not a size-1 dimension's), optional
    inputs given; new values in the same layout do not."""
    M, N, K = world.world_size, 5, 3
    ctx = po.MatmulAllReduce(world, 4 * M, N, transport="auto", iters=1, warmup=0)
    fake = _FakeTimings(ctx)
    counts = {}
    try:
        a, b = torch.randn(M, K), torch.randn(K, N)
        with _timing(fake):
            for label, args, kw in (
                    ("first", (a, b), {}),
                    ("new values", (torch.randn(M, K), torch.randn(K, N)), {}),
                    ("b transposed", (a, torch.randn(N, K).t()), {}),
                    ("bias", (a, b), {"bias": torch.randn(N)}),
                    ("rows", (torch.randn(2 * M, K), b), {}),
                    ("one row", (torch.randn(1, K), b), {}),
                    ("one row of a wider tensor", (torch.randn(1, 2 * K)[:, :K], b), {})):
                before = fake.count
                y = po.matmul_all_reduce(*args, ctx, **kw)
                ref = GEMM_PATTERNS["matmul_all_reduce"][1]
                err = rel_err(y, ref(*args, world.group, kw.get("bias"), None))
                counts[label] = (fake.count - before, err)
    finally:
        ctx.close()
    return counts


def test_what_makes_a_new_call_key(world2):
    n = len(po.MatmulAllReduce.TRANSPORTS)
    for counts in world2.run(_keys):
        assert all(err < TOL for _, err in counts.values()), counts
        assert {k: c for k, (c, _) in counts.items()} == {
            "first": n, "new values": 0, "b transposed": n, "bias": n, "rows": n,
            "one row": n, "one row of a wider tensor": 0}, counts


def _disk_cache(world, tmp):
    """Real timings (the interpreter's: sequential wins by far) and where decisions are kept:
    in memory only, in a file named by cache_path (shared by the ranks) that a second context
    reads without timing, in the file the environment names; never in the home directory."""
    W = world.world_size
    M, N, K = 3 * W, 7, 5
    home = os.path.join(tmp, f"home{world.rank}")
    os.makedirs(home)
    path, env_path = os.path.join(tmp, "decisions.json"), os.path.join(tmp, "env.json")
    steps = {}

    def run(step, **kw):
        ctx = po.MatmulAllReduce(world, M, N, transport="auto", iters=2, warmup=1, **kw)
        try:
            g = torch.Generator().manual_seed(world.rank + len(steps))
            a, b, bias, res = pattern_inputs(g, M, N, K, M, torch.float32)
            out = torch.full((M, N), float("nan"))
            with _timing(_CountedTimings()) as counted:
                po.matmul_all_reduce(a, b, ctx, out, bias=bias)
            err = rel_err(out, GEMM_PATTERNS["matmul_all_reduce"][1](a, b, world.group, bias,
                                                                     None))
            steps[step] = (ctx.choice(a, b, bias), counted.count, err, list(ctx.decisions))
        finally:
            ctx.close()

    with environ(HOME=home, **{tuning.CACHE_VAR: None}):
        run("memory")
        run("file", cache_path=path)
        run("file again", cache_path=path)
        with environ(**{tuning.CACHE_VAR: env_path}):
            run("env")
        with open(path) as f:
            on_disk = json.load(f)
        return steps, on_disk, os.path.exists(env_path), os.listdir(home)


def test_decisions_in_memory_and_in_a_file(world2, tmp_path):
    n = len(po.MatmulAllReduce.TRANSPORTS)
    for steps, on_disk, env_file, home in world2.run(_disk_cache, str(tmp_path)):
        for step, (chose, timings, err, keys) in steps.items():
            assert chose == "sequential" and err < TOL, (step, chose, err)
            assert len(keys) == 1, (step, keys)
            assert timings == (0 if step == "file again" else n), (step, timings)
        assert steps["file"][3] == steps["file again"][3] == list(on_disk)
        assert on_disk[steps["file"][3][0]]["transport"] == "sequential"
        assert set(on_disk[steps["file"][3][0]]["ms"]) == set(po.MatmulAllReduce.TRANSPORTS)
        assert env_file and home == []


def _candidates(world):
    """candidates= restricts what is made and timed; bad values name the op."""
    M, N, K = 2 * world.world_size, 5, 3
    ctx = po.MatmulReduceScatter(world, M, N, transport="auto",
                                 candidates=["sequential", "copy_engine"], iters=1, warmup=0)
    fake = _FakeTimings(ctx)
    try:
        a, b = torch.randn(M, K), torch.randn(K, N)
        with _timing(fake):
            y = po.matmul_reduce_scatter(a, b, ctx)
        err = rel_err(y, po.matmul_reduce_scatter_reference(a, b, world.group))
        good = (repr(ctx), sorted(set(fake.ran)), fake.count, err)
    finally:
        ctx.close()
    one = po.MatmulAllToAll(world, M, N, transport="auto", candidates=("copy_engine",))
    try:
        with _timing(_CountedTimings()) as counted:
            po.matmul_all_to_all(a, b, one)
        good += (one.choice(a, b), counted.count)
    finally:
        one.close()
    bad = {}
    for label, value in (("str", "sequential"), ("empty", ()), ("unknown", ("nccl",)),
                         ("twice", ("sequential", "sequential")), ("auto", ("auto",)),
                         ("not a collection", 3)):
        try:
            po.MatmulAllReduce(world, M, N, transport="auto", candidates=value).close()
            bad[label] = None
        except ValueError as e:
            bad[label] = str(e)
    return good, bad


def test_candidates_restrict_the_choice(world2):
    for good, bad in world2.run(_candidates):
        text, ran, timings, err, one_choice, one_timings = good
        assert "candidates=('copy_engine', 'sequential')" in text, text
        assert ran == ["copy_engine", "sequential"] and timings == 2 and err < TOL
        assert one_choice == "copy_engine" and one_timings == 0  # nothing to choose
        for label, msg in bad.items():
            assert msg and msg.startswith("matmul_all_reduce: candidates must be"), (label, msg)


def _bad_options(world):
    """Option combinations refused at creation (with the op's name), per-call options no
    candidate takes, and per-call options that settle the transport without timing."""
    M, N = 2 * world.world_size, 5
    made = {
        "direct transport option": dict(transport="auto", pieces=2),
        "options for a non-candidate": dict(transport="auto", candidates=("sequential",
                                                                          "copy_engine"),
                                            options={"signal_collective": {}}),
        "options for an unknown transport": dict(transport="auto", options={"nccl": {}}),
        "options not a dict": dict(transport="auto", options=[("copy_engine", {})]),
        "a transport's options not a dict": dict(transport="auto",
                                                 options={"copy_engine": 4}),
        "iters": dict(transport="auto", iters=0),
        "warmup": dict(transport="auto", warmup=-1),
        "graph": dict(transport="auto", graph="yes"),
        "cache_path a directory": dict(transport="auto", cache_path="/"),
        "candidates with a named transport": dict(transport="sequential",
                                                  candidates=("sequential",)),
        "cache_path with a named transport": dict(transport="copy_engine", cache_path="x.json"),
        "refused by the transport": dict(transport="auto", options={"sequential": {"pieces": 2}}),
        "unknown transport": dict(transport="automatic"),
    }
    msgs = {}
    for label, kw in made.items():
        try:
            po.MatmulAllReduce(world, M, N, **kw).close()
            msgs[label] = None
        except ValueError as e:
            msgs[label] = str(e)
    ctx = po.MatmulAllReduce(world, M, N, transport="auto", options={"copy_engine": {"pieces": 2}})
    try:
        a, b = torch.randn(M, 3), torch.randn(3, N)
        with _timing(_CountedTimings()) as counted:
            y = po.matmul_all_reduce(a, b, ctx, config=SignalConfig())
        msgs["signal config"] = (ctx.choice(a, b, config=SignalConfig()), counted.count,
                                 rel_err(y, po.matmul_all_reduce_reference(a, b, world.group)),
                                 ctx.impl, ctx.planner.impls["copy_engine"].pieces)
    finally:
        ctx.close()
    ag = po.AllGatherMatmul(world, 64, transport="auto", candidates=("stores", "sequential"))
    try:
        po.all_gather_matmul(torch.randn(3, 4), torch.randn(4, 5), ag, schedule="hetero-fused-1d")
        msgs["schedule without copy_engine"] = None
    except ValueError as e:
        msgs["schedule without copy_engine"] = str(e)
    finally:
        ag.close()
    return msgs


def test_bad_option_combinations(world2):
    for msgs in world2.run(_bad_options):
        chose, timings, err, impl, pieces = msgs.pop("signal config")
        assert chose == "signal_collective" and timings == 0 and err < TOL
        assert impl is None and pieces == 2
        for label, msg in msgs.items():
            assert msg and msg.startswith(("matmul_all_reduce", "all_gather_matmul")), (label, msg)
        assert "options={name: {...}}" in msgs["direct transport option"]
        assert "not a candidate" in msgs["options for a non-candidate"]
        assert "not a transport" in msgs["options for an unknown transport"]
        assert "is an option of transport='auto'" in msgs["candidates with a named transport"]
        assert "is an option of transport='auto'" in msgs["cache_path with a named transport"]
        assert "'sequential' transport takes no options" in msgs["refused by the transport"]
        assert "or 'auto'" in msgs["unknown transport"]
        assert "no candidate transport takes the per-call options schedule=" in \
            msgs["schedule without copy_engine"]


def _failing(world, only_rank0):
    """A candidate that raises while it is timed is left out with a warning (on every rank,
    also when it raised on one rank only and left its peers' workspace broken); when all raise,
    the call raises; bad input raises what a named transport raises."""
    M, N, K = 2 * world.world_size, 5, 3
    ctx = po.MatmulAllReduce(world, M, N, transport="auto", iters=1, warmup=0, timeout_s=3.0)
    run = ctx._run
    broken = {"copy_engine"}

    def failing(transport, impl, *args):
        if transport in broken and (world.rank == 0 or not only_rank0):
            raise RuntimeError(f"injected failure of {transport}")
        return run(transport, impl, *args)

    ctx._run = failing
    found = {}
    try:
        a, b = torch.randn(M, K), torch.randn(K, N)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = po.matmul_all_reduce(a, b, ctx)
        ctx.synchronize()  # every workspace still checks clean
        found["dropped"] = (ctx.choice(a, b), rel_err(y, po.matmul_all_reduce_reference(
            a, b, world.group)), [str(w.message) for w in caught if w.category is RuntimeWarning],
            list(ctx.decisions.values())[0]["failed"], ctx.planner.candidates)
        if not only_rank0:  # (on one rank only, its peer's collectives would wait for it)
            broken.update(ctx.TRANSPORTS)  # now every candidate raises
            try:
                po.matmul_all_reduce(torch.randn(M - 1, K), torch.randn(K, N), ctx)  # new key
                found["all fail"] = None
            except RuntimeError as e:
                found["all fail"] = str(e)
                found["all fail kind"] = type(e).__name__
            broken.clear()
            named = po.MatmulAllReduce(world, M, N, transport="sequential")
            for label, c in (("auto", ctx), ("named", named)):
                try:
                    po.matmul_all_reduce(a, torch.randn(K + 1, N), c)
                    found[label] = None
                except ValueError as e:
                    found[label] = str(e)
            named.close()
    finally:
        ctx.close()
    return found


@pytest.mark.parametrize("only_rank0", [False, True], ids=["every-rank", "rank0"])
def test_a_candidate_that_raises_is_dropped(world2, only_rank0):
    for found in world2.run(_failing, only_rank0, timeout=300):
        chose, err, warned, failed, left = found["dropped"]
        assert chose == "sequential" and err < TOL
        assert len(warned) == 1 and "transport 'copy_engine' raised" in warned[0], warned
        assert list(failed) == ["copy_engine"] and "injected failure" in failed["copy_engine"]
        if only_rank0:  # its peer timed out waiting: that workspace is out of step for good
            assert "every later one" in warned[0] and "copy_engine" not in left, (warned, left)
            continue
        assert "copy_engine" in left
        assert found["auto"] and found["auto"] == found["named"], found
        assert found["all fail"].startswith("matmul_all_reduce: no candidate transport could "
                                            "run this call"), found["all fail"]
        # the library's own error class, which a caller catching its errors catches
        assert found["all fail kind"] == "PortableOverlapError", found
        assert all(f"{t}: rank 0: RuntimeError: injected" in found["all fail"] for t in left)


def _capture(world):
    """A call under graph capture whose key is undecided raises (timing cannot be captured); a
    decided key runs as its transport does."""
    M, N, K = 2 * world.world_size, 5, 3
    ctx = po.MatmulAllToAll(world, M, N, transport="auto", iters=1, warmup=0)
    real = planner.stream_capturing
    found = {}
    try:
        a, b = torch.randn(M, K), torch.randn(K, N)
        planner.stream_capturing = lambda device: True
        try:
            po.matmul_all_to_all(a, b, ctx)
            found["undecided"] = None
        except RuntimeError as e:
            found["undecided"] = str(e)
        planner.stream_capturing = real
        po.matmul_all_to_all(a, b, ctx)  # eager: decides
        planner.stream_capturing = lambda device: True
        y = po.matmul_all_to_all(a, b, ctx)
        found["decided"] = rel_err(y, po.matmul_all_to_all_reference(a, b, world.group))
    finally:
        planner.stream_capturing = real
        ctx.close()
    return found


def test_graph_capture_needs_a_decided_call(world2):
    for found in world2.run(_capture):
        assert "make one eager call with these shapes before capturing" in found["undecided"]
        assert found["decided"] < TOL


def _two_picks(world):
    """Where the device can capture, a key's first call times plain calls and graph replays;
    calls under capture run the replays' pick, the others the plain calls' pick, and a decided
    key times nothing more."""
    M, N, K = 2 * world.world_size, 5, 3
    real_capture, real_capturing = planner._can_capture, planner.stream_capturing
    planner._can_capture = lambda device: True
    ctx = po.MatmulAllToAll(world, M, N, transport="auto", iters=1, warmup=0)
    found = {}
    try:
        fake = _FakeTimings(ctx)
        cands = ctx.planner.candidates
        fake.costs = {**{(t, g): 3.0 for t in cands for g in (False, True)},
                      ("stores", False): 1.0, ("copy_engine", True): 1.0}
        with _timing(fake):
            a, b = torch.randn(M, K), torch.randn(K, N)
            ref = po.matmul_all_to_all_reference(a, b, world.group)
            found["eager"] = (rel_err(po.matmul_all_to_all(a, b, ctx), ref), fake.ran[-1])
            found["timed"] = (fake.count, len(cands))
            found["choices"] = ctx.choices(a, b)
            found["captured record"] = [d.get("captured", {}).get("transport")
                                        for d in ctx.decisions.values()]
            planner.stream_capturing = lambda device: True
            found["choice captured"] = ctx.choice(a, b)
            a2, b2 = torch.randn(M, K), torch.randn(K, N)
            y = po.matmul_all_to_all(a2, b2, ctx)
            found["captured"] = (rel_err(y, po.matmul_all_to_all_reference(a2, b2, world.group)),
                                 fake.ran[-1], fake.count)
            planner.stream_capturing = real_capturing
            found["choice eager"] = ctx.choice(a, b)
            found["named"] = po.MatmulAllToAll(world, M, N, transport="stores")
            found["named"] = (found["named"].choices(a, b), found["named"].close())[0]
    finally:
        planner._can_capture, planner.stream_capturing = real_capture, real_capturing
        ctx.close()
    return found


def test_plain_and_captured_calls_get_their_own_pick(world2):
    for found in world2.run(_two_picks):
        err, ran = found["eager"]
        assert err < TOL and ran == "stores"
        timed, n = found["timed"]
        assert timed == 2 * planner.ROUNDS * n  # each candidate, mode and round once
        assert found["choices"] == {"plain": "stores", "captured": "copy_engine"}
        assert found["captured record"] == ["copy_engine"]
        assert found["choice captured"] == "copy_engine"
        err, ran, count = found["captured"]
        assert err < TOL and ran == "copy_engine" and count == timed
        assert found["choice eager"] == "stores"
        assert found["named"] == {"plain": "stores", "captured": "stores"}


def _timed_as_called(world):
    """The timed runs of a key's first call fill an output of their own where the call passes
    ``out``, and make their own result where it does not, as the call will."""
    M, N, K = 2 * world.world_size, 5, 3
    ctx = po.MatmulAllReduce(world, 2 * M, N, transport="auto", iters=1, warmup=0)
    found = {}
    try:
        fake = _FakeTimings(ctx)
        outs, run = [], ctx._run

        def recording(transport, impl, inputs, out, options):
            if not impl.checking_only:  # (the input checks of a transport without a deadline)
                outs.append(out is None)
            return run(transport, impl, inputs, out, options)

        ctx._run = recording
        n = len(ctx.planner.candidates)
        with _timing(fake):
            for given in (False, True):
                a, b = torch.randn(M + given * world.world_size, K), torch.randn(K, N)
                out = torch.full((a.shape[0], N), float("nan")) if given else None
                del outs[:]
                y = po.matmul_all_reduce(a, b, ctx, out)
                # n probes (no out), n timed runs, then the call itself
                found[given] = (outs[:n], outs[n:2 * n], outs[2 * n:],
                                y is out or not given,
                                rel_err(y, po.matmul_all_reduce_reference(a, b, world.group)))
    finally:
        ctx.close()
    return found


def test_timed_runs_make_their_result_as_the_call_does(world2):
    for found in world2.run(_timed_as_called):
        for given, (probes, timed, call, into_out, err) in found.items():
            assert all(probes) and timed == [not given] * len(timed) and len(timed) > 1
            assert call == [not given] and into_out and err < TOL


def _lifecycle(world):
    """timeout_s, check, synchronize and close cover every candidate's workspace."""
    M, N = 2 * world.world_size, 5
    found = {}
    with po.AllGatherMatmul(world, 32, transport="auto", timeout_s=7.0) as ctx:
        found["timeout"] = ctx.timeout_s
        found["workspaces"] = sorted(ctx.planner.impls)
        found["available"] = sorted(ctx.available(world))
        ctx.check()
        ctx.synchronize()
        ctx.planner._lock.acquire()  # another thread's call is under way
        try:
            po.all_gather_matmul(torch.randn(2, 3), torch.randn(3, 4), ctx)
        except ConcurrentUseError as e:
            found["threads"] = str(e)
        finally:
            ctx.planner._lock.release()
        found["default"] = po.MatmulAllReduce(world, M, N, transport="auto")
        found["default timeout"] = found["default"].timeout_s
        found["default"].close()
        found["default"] = repr(found["default"])
    found["closed"] = [impl._closed for impl in ctx.planner.impls.values()]
    ctx.close()  # twice: nothing
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    for what, call in (("call", lambda: po.all_gather_matmul(a, b, ctx)), ("check", ctx.check),
                       ("synchronize", ctx.synchronize)):
        try:
            call()
            found[what] = None
        except ContextClosedError as e:
            found[what] = str(e)
    return found


def test_lifecycle_covers_every_workspace(world2):
    for found in world2.run(_lifecycle):
        assert found["timeout"] == 7.0
        assert found["workspaces"] == found["available"]  # every one that runs here
        assert found["available"] == sorted(set(po.AllGatherMatmul.TRANSPORTS)
                                            - {"torch_fused"})
        assert "already running a call in another thread" in found["threads"]
        assert found["default timeout"] == 60.0  # the longest default (sequential's)
        assert "transport='auto', candidates=(" in found["default"]
        assert found["closed"] == [True] * len(found["available"])
        for what in ("call", "check", "synchronize"):
            assert found[what] and "all_gather_matmul: this context was closed" in found[what]


def _new_on_one_rank(world):
    """The first call is decided on both ranks; the next call's key is new on rank 1 only (its
    weight is a transposed view: other strides). Rank 1 waits for a decision its peer never
    joins and raises within its bound, naming the rule; rank 0's decided transport raises at
    its own bounded waits; rank 1's context refuses every later call. Before, rank 1 waited
    for ever (or gloo aborted the process on a collective mismatch)."""
    import time

    planner.EXCHANGE_MIN_S = 2.0  # the bound, shortened for the test
    M, N, K = 3, 5, 4
    ctx = po.AllGatherMatmul(world, M * K, transport="auto", candidates=("stores", "copy_engine"),
                             timeout_s=2.0, iters=1, warmup=0)
    g = torch.Generator().manual_seed(world.rank)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    found = {"first": rel_err(po.all_gather_matmul(a, b, ctx),
                              _ag_reference(a, b, world.group))}
    b2 = b.t().contiguous().t() if world.rank == 1 else b
    t0 = time.monotonic()
    try:
        po.all_gather_matmul(a, b2, ctx)
        ctx.synchronize()
        found["second"] = ("no error", "")
    except Exception as e:
        found["second"] = (type(e).__name__, str(e))
    found["seconds"] = time.monotonic() - t0
    try:
        po.all_gather_matmul(a, b, ctx)
        found["third"] = ("no error", "")
    except Exception as e:
        found["third"] = (type(e).__name__, str(e))
    ctx.close()
    return found


def test_a_call_new_on_one_rank_raises_on_every_rank(world2):
    r0, r1 = world2.run(_new_on_one_rank, timeout=120)
    assert r0["first"] < TOL and r1["first"] < TOL
    assert r0["second"][0] == "PeerTimeoutError", r0
    assert r1["second"][0] == "PeerTimeoutError" and "new on every rank" in r1["second"][1], r1
    assert "rank(s) [0] did not join" in r1["second"][1], r1
    assert r0["seconds"] < 30 and r1["seconds"] < 30
    assert r1["third"][0] == "ContextBrokenError" and "out of step" in r1["third"][1], r1
    assert r0["third"][0] != "no error", r0  # its decided workspace is out of step too


def _sizes_differ(world):
    """A key's first call whose sizes the collective moves differ across ranks (another N on
    the last rank; AllGather + GEMM: another K of the shard) raises RankMismatchError on every
    rank before anything runs, where the ``"sequential"`` candidate would wait in gloo; the
    next call, matched, is right."""
    import time

    W, last = world.world_size, world.world_size - 1
    M, N, K = 2 * W, 5, 3
    mine = N + (world.rank == last)
    cases = {
        "matmul_all_reduce": (lambda: po.MatmulAllReduce(world, M, N + 1, **kw),
                              lambda c, n, k: po.matmul_all_reduce(torch.randn(M, k),
                                                                   torch.randn(k, n), c)),
        "matmul_reduce_scatter": (lambda: po.MatmulReduceScatter(world, M, N + 1, **kw),
                                  lambda c, n, k: po.matmul_reduce_scatter(
                                      torch.randn(M, k), torch.randn(k, n), c)),
        "matmul_all_to_all": (lambda: po.MatmulAllToAll(world, M, N + 1, **kw),
                              lambda c, n, k: po.matmul_all_to_all(torch.randn(M, k),
                                                                   torch.randn(k, n), c)),
        "gemv_all_reduce": (lambda: po.GemvAllReduce(world, N + 1, **kw),
                            lambda c, n, k: c(torch.randn(2, k), torch.randn(n, k))),
        "all_gather_matmul": (lambda: po.AllGatherMatmul(world, 2 * (K + 1), **kw),
                              lambda c, n, k: po.all_gather_matmul(
                                  torch.randn(2, k), torch.randn(k, N), c)),
    }
    kw = dict(transport="auto", iters=1, warmup=0)
    found = {}
    for name, (make, call) in cases.items():
        ctx = make()
        try:
            with _timing(_FakeTimings(ctx)):
                t0 = time.monotonic()
                try:
                    if name == "all_gather_matmul":  # the shard's K differs
                        call(ctx, N, K + (world.rank == last))
                    else:
                        call(ctx, mine, K)
                    found[name] = ("no error",)
                except Exception as e:
                    found[name] = (type(e).__name__, str(e), time.monotonic() - t0)
                try:
                    y = call(ctx, N, K)
                    found[name + " after"] = ("ok", tuple(y.shape))
                except Exception as e:
                    found[name + " after"] = (type(e).__name__, str(e))
        finally:
            ctx.close()
    return found


def test_first_calls_whose_collective_sizes_differ_raise_on_every_rank(world2):
    for found in world2.run(_sizes_differ, timeout=240):
        for name in ("matmul_all_reduce", "matmul_reduce_scatter", "matmul_all_to_all",
                     "gemv_all_reduce", "all_gather_matmul"):
            kind, msg, seconds = found[name]
            assert kind == "RankMismatchError" and seconds < 30, (name, found[name])
            assert msg.startswith(name + ": the ranks' calls differ in what every rank's must "
                                  "share"), msg
            assert "rank 0: {" in msg and "rank 1: {" in msg, msg
            assert found[name + " after"][0] == "ok", (name, found[name + " after"])


def _unmatched_calls(world):
    """Calls whose keys are new on some ranks only, or that some ranks refuse on the host, next
    to a decided ``"sequential"`` (a collective without a deadline): every rank raises in the
    same call within seconds, naming the ranks and their calls, and the context stays usable
    (the next matched call is right). Keys new on every rank decide together, also where the
    ranks' K shards differ."""
    import time

    planner.EXCHANGE_MIN_S = 5.0  # the bound of a peer that never joins, shortened for the test
    last, M, N, K = world.world_size - 1, 2, 3, 2
    ctx = po.MatmulAllReduce(world, 2 * M, N, transport="auto",
                             candidates=("sequential", "stores"), iters=1, warmup=0, timeout_s=5.0)
    fake = _FakeTimings(ctx)
    fake.costs = {"sequential": 1.0, "stores": 2.0}
    g = torch.Generator().manual_seed(world.rank)
    found = {}

    def step(label, a, b, matched, **kw):
        t0 = time.monotonic()
        try:
            y = po.matmul_all_reduce(a, b, ctx, **kw)
            err = rel_err(y, po.matmul_all_reduce_reference(a.detach(), b, world.group)
                          ) if matched else None
            found[label] = ("ok", err, time.monotonic() - t0, ctx.choice(a, b))
        except Exception as e:
            found[label] = (type(e).__name__, str(e), time.monotonic() - t0)

    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    try:
        with _timing(fake):
            step("decided", a, b, True)
            step("new on one rank", torch.randn(2 * M, K) if world.rank == last else a, b, False)
            step("matched again", a, b, True)
            k = K + 1 + world.rank  # a call new on every rank, its K shard differing across ranks
            step("new, shards differ", torch.randn(M, k), torch.randn(k, N), True)
            a3 = torch.randn(M + 1, K)
            step("refused new", a3.clone().requires_grad_(world.rank == 0), b, False)
            step("refused decided", a.clone().requires_grad_(world.rank == 0), b, False)
            step("options no candidate takes", a3, b, False,
                 **({"config": SignalConfig()} if world.rank == last else {}))
            step("after refusals", a3, b, True)
            # input that only the transport's own checks refuse (an out of another shape), on
            # a decided "sequential" key and at a key's first call: the checks run before the
            # agreement, not inside the collective that would wait for this rank
            bad = {"out": torch.empty(1, N)} if world.rank == last else {}
            step("bad out decided", a, b, False, **bad)
            a5, b5 = torch.randn(M + 1, K + 6, generator=g), torch.randn(K + 6, N, generator=g)
            step("bad out new", a5, b5, False, **bad)
            step("after bad outs", a5, b5, True)
        found["timings"] = fake.count
    finally:
        ctx.close()
    return found


def test_unmatched_calls_raise_on_every_rank(world):
    per_rank = world.run(_unmatched_calls, timeout=240)
    last = world.size - 1
    for r, found in enumerate(per_rank):
        for label in ("decided", "matched again", "new, shards differ", "after refusals",
                      "after bad outs"):
            assert found[label][0] == "ok" and found[label][1] < TOL, (r, label, found[label])
            assert found[label][3] == "sequential", (r, label, found[label])
        assert found["timings"] == 4 * 2  # four decisions of two candidates, nothing more
        kind, msg, seconds = found["new on one rank"]
        assert kind == "RankMismatchError" and seconds < 4, (r, found["new on one rank"])
        assert msg.startswith("matmul_all_reduce: ") and f"rank {last}: a call new" in msg, msg
        assert "rank 0: a call decided" in msg and "'sequential'" in msg, msg
        for label, why in (("refused new", "has no backward"),
                           ("refused decided", "has no backward"),
                           ("options no candidate takes", "no candidate transport takes"),
                           ("bad out decided", "out"), ("bad out new", "out")):
            refuser = 0 if label.startswith("refused") else last
            kind, msg, seconds = found[label]
            assert seconds < 4 and why in msg, (r, label, found[label])
            if r == refuser:
                assert kind in ("RuntimeError", "ValueError"), (r, label, found[label])
            else:
                assert kind == "RankMismatchError", (r, label, found[label])
                assert f"rank {refuser} refused this call" in msg, (r, label, msg)


def _cache_on_some_ranks(world, tmp):
    """Each rank's own cache file; a decision that only some ranks' files hold is new in every
    rank's memory, so every rank decides it again (measuring: not every rank's file has it)."""
    M, N, K = 2, 3, 2
    path = os.path.join(tmp, f"rank{world.rank}.json")
    found = []
    for step in range(2):
        if step == 1 and world.rank == 0:
            os.remove(path)  # rank 0 lost its decisions; its peers kept theirs
        ctx = po.MatmulAllReduce(world, M, N, transport="auto", candidates=("sequential",
                                                                            "stores"),
                                 cache_path=path, iters=1, warmup=0)
        fake = _FakeTimings(ctx)
        fake.costs = {"sequential": 2.0, "stores": 1.0}
        try:
            a, b = torch.randn(M, K), torch.randn(K, N)
            with _timing(fake):
                y = po.matmul_all_reduce(a, b, ctx)
            found.append((ctx.choice(a, b), fake.count,
                          rel_err(y, po.matmul_all_reduce_reference(a, b, world.group))))
        finally:
            ctx.close()
    return found


def test_a_decision_some_ranks_cache_is_made_again(world2, tmp_path):
    for found in world2.run(_cache_on_some_ranks, str(tmp_path), timeout=240):
        assert [f[:2] for f in found] == [("stores", 2), ("stores", 2)], found
        assert all(f[2] < TOL for f in found), found


def _agreements_timed(world):
    """How many store agreements a key's first call and a decided call of "sequential" make."""
    M, N, K = 2 * world.world_size, 5, 3
    ctx = po.MatmulAllReduce(world, M, N, transport="auto", iters=1, warmup=0)
    try:
        fake = _FakeTimings(ctx)
        fake.costs = {"sequential": 1.0, "copy_engine": 2.0, "stores": 2.0,
                      "signal_collective": 2.0}
        a, b = torch.randn(M, K), torch.randn(K, N)
        with _timing(fake):
            y = po.matmul_all_reduce(a, b, ctx)
            first = ctx.planner._begun
            po.matmul_all_reduce(a, b, ctx)
            later = ctx.planner._begun - first
        return first, later, ctx.choice(a, b), rel_err(
            y, po.matmul_all_reduce_reference(a, b, world.group))
    finally:
        ctx.close()


def test_plain_timing_of_sequential_counts_its_agreement(world2):
    """A decided eager call of "sequential" agrees with its peers first (its waits have no
    deadline); its plain calls' timing makes that agreement too, so the pick weighs it: the
    key's own agreement plus one per timed run of each candidate that agrees first
    (``UNBOUNDED``: "sequential" and "signal_collective"; the fake timing runs once)."""
    for first, later, pick, err in world2.run(_agreements_timed):
        assert (first, later, pick) == (3, 1, "sequential") and err < TOL, (first, later, pick)


def _cache_path_refused_on_one_rank(world, tmp):
    """Rank 1's cache_path is a folder, rank 0's a file."""
    path = tmp if world.rank == 1 else os.path.join(tmp, "t.json")
    try:
        po.MatmulAllReduce(world, 2, 3, transport="auto", cache_path=path).close()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_a_cache_path_refused_on_one_rank_raises_on_every_rank(world2, tmp_path):
    """The refusal was raised before the ranks compared their settings: rank 0 waited in that
    comparison for ever."""
    got = world2.run(_cache_path_refused_on_one_rank, str(tmp_path), timeout=60)
    assert [g[0] for g in got] == ["RankMismatchError"] * 2, got
    assert all("rank 1:" in g[1] and "cache_path must be the path of a file" in g[1]
               for g in got), got


#: entries a cache file may hold for a call's key that are no decision among its candidates
#: ("sequential", "stores"), and ranks' own files that hold different decisions
_STALE = {"unknown transport": {"transport": "nvshmem_put", "ms": {}},
          "not a record": "sequential",
          "captured pick not a record": {"transport": "sequential", "captured": "stores"},
          "differ across ranks": None}


def _stale_entries(world, tmp, kind):
    """A key decided into a file, the file's entry replaced by ``_STALE[kind]`` (or, each rank
    with its own file, by a different decision on each rank), then a new context's call of that
    key: what it runs, how many timings, its warnings, and the entry the file holds after."""
    M, N, K = 2, 3, 2
    shared = _STALE[kind] is not None
    path = os.path.join(tmp, "t.json" if shared else f"rank{world.rank}.json")
    a, b = torch.randn(M, K), torch.randn(K, N)

    def call(costs):
        ctx = po.MatmulAllReduce(world, M, N, transport="auto",
                                 candidates=("sequential", "stores"), cache_path=path,
                                 iters=1, warmup=0)
        fake = _FakeTimings(ctx)
        fake.costs = costs
        try:
            with warnings.catch_warnings(record=True) as caught, _timing(fake):
                warnings.simplefilter("always")
                y = po.matmul_all_reduce(a, b, ctx)
            return (ctx.choice(a, b), fake.count, [str(w.message) for w in caught],
                    list(ctx.decisions)[0],
                    rel_err(y, po.matmul_all_reduce_reference(a, b, world.group)))
        finally:
            ctx.close()

    key = call({"sequential": 1.0, "stores": 2.0})[3]
    world.barrier()
    if world.rank == 0 or not shared:
        with open(path) as f:
            entries = json.load(f)
        entries[key] = _STALE[kind] or {"transport": ("sequential", "stores")[world.rank % 2],
                                        "ms": {}}
        with open(path, "w") as f:
            json.dump(entries, f)
    world.barrier()
    choice, timings, warned, _, err = call({"sequential": 2.0, "stores": 1.0})
    with open(path) as f:
        return choice, timings, warned, json.load(f)[key]["transport"], err


@pytest.mark.parametrize("kind", list(_STALE))
def test_a_cache_entry_that_is_no_decision_or_differs_is_made_again(world2, tmp_path, kind):
    """An entry naming no candidate raised a RuntimeError, and ranks' files that disagreed a
    RankMismatchError, on every rank at every call of the key until the files were edited:
    now every rank warns, measures again, runs rank 0's pick and records it."""
    for choice, timings, warned, on_disk, err in world2.run(_stale_entries, str(tmp_path),
                                                            kind, timeout=240):
        assert (choice, timings, on_disk) == ("stores", 2, "stores") and err < TOL, \
            (choice, timings, on_disk, warned)
        assert any("made again" in w for w in warned), warned
