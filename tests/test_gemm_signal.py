"""GEMM with tile-group signals (host-collective transport) on CPU-emulated ranks against
torch.matmul + the plain collective, and the wave-group schedule on the host.

Cases are batched into one emulated-world call per test (each call costs a round trip to the
spawned ranks); shapes are tiny so the interpreter stays fast."""
import pytest
import torch

from portable_overlap import RankMismatchError
from portable_overlap import MatmulAllReduce, MatmulAllToAll, MatmulReduceScatter
from portable_overlap.testing.signal_calls import (gemm_all_reduce, gemm_all_to_all_signal,
                                                   gemm_reduce_scatter)
from portable_overlap.ops.gemm_signal import (GemmReduceScatterCE, GemmSignal, SignalConfig,
                                              gemm_all_reduce_reference,
                                              gemm_all_to_all_signal_reference,
                                              gemm_reduce_scatter_reference)
from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.schedule import (WaveGroups, default_partition, default_partitions,
                                       tile_layout)

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
OPS = {"all_reduce": (gemm_all_reduce, gemm_all_reduce_reference),
       "reduce_scatter": (gemm_reduce_scatter, gemm_reduce_scatter_reference),
       "all_to_all": (gemm_all_to_all_signal, gemm_all_to_all_signal_reference)}


def _n_tiles(kind, M, N, world_size, mm=SMALL):
    dests = 1 if kind == "all_reduce" else world_size
    return dests * -(-(M // dests) // mm.block_m) * -(-N // mm.block_n), dests


def _partitions(kind, M, N, world_size):
    """Every partition the default heuristic gives for this GEMM (any grid size), plus hand-made
    ones: a single group, one round of tiles per group, and an uneven split."""
    n, dests = _n_tiles(kind, M, N, world_size)
    parts = [p.sizes for p in default_partitions(n, dests)]
    rounds = n // dests
    hand = [(n,), (dests,) * rounds]
    if rounds >= 3:
        hand.append((dests * (rounds - 2), dests, dests))  # large first group, small tail
        hand.append((dests, dests * (rounds - 1)))
    for h in hand:
        if h not in parts:
            parts.append(h)
    return parts


def _cases(world, cases, repeat=1):
    """cases: (kind, dtype, M, N, K, b_transposed, partition or None, fused epilogue), each run
    ``repeat`` times with fresh inputs (the first call of a plan runs unguarded, later ones wait
    on the counters); returns the relative errors (``repeat`` per case, in order), and whether
    every counter was back at zero afterwards."""
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
    errs = []
    try:
        for i, (kind, dtype, M, N, K, bt, part, fused) in enumerate(
                c for c in cases for _ in range(repeat)):
            fn, ref_fn = OPS[kind]
            g = torch.Generator().manual_seed(1000 * i + world.rank)
            a = torch.randn(M, K, generator=g).to(dtype)
            b = torch.randn(N, K, generator=g).to(dtype).t() if bt else \
                torch.randn(K, N, generator=g).to(dtype)
            rows = M // world.world_size if kind == "reduce_scatter" else M
            bias = torch.randn(N, generator=g).to(dtype) if fused else None
            res = torch.randn(rows, N, generator=g).to(dtype) if fused else None
            out = torch.full((rows, N), float("nan"), dtype=dtype)
            cfg = None
            if part == "event":  # the collectives wait for the whole GEMM (no overlap)
                cfg = SignalConfig(matmul=SMALL, gate="event")
            elif part:
                cfg = SignalConfig(matmul=SMALL, partition=part)
            fn(a, b, ctx, out, bias=bias, residual=res, config=cfg)
            assert not torch.isnan(out).any(), f"output not fully written: {cases[i // repeat]}"
            ref = ref_fn(a, b, world.group, bias=bias, residual=res)
            errs.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
        zero = bool((ctx.counters.values() == 0).all())
    finally:
        ctx.close()
    return errs, zero


def _check(results, cases, repeat=1):
    for errs, zero in results:
        assert zero, "group counters were not reset after the calls"
        assert len(errs) == len(cases) * repeat
        for i, e in enumerate(errs):
            assert e < TOL[cases[i // repeat][1]], (e, cases[i // repeat], i % repeat)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_ops_match_reference(world, dtype):
    # odd N and K, M odd for AllReduce, a transposed b, a fused bias + residual, default
    # partitions; shapes change from call to call on one context
    W = world.size
    cases = [("all_reduce", dtype, 13, 33, 17, False, None, False),
             ("all_reduce", dtype, 24, 20, 9, True, None, True),
             ("reduce_scatter", dtype, 6 * W, 33, 17, False, None, False),
             ("reduce_scatter", dtype, 4 * W, 20, 40, True, None, True),
             ("all_to_all", dtype, 6 * W, 33, 17, False, None, False),
             ("all_to_all", dtype, 2 * W, 17, 5, False, None, True)]
    # bf16 twice: the first call of a plan runs unguarded, the second waits on the counters
    repeat = 2 if dtype == torch.bfloat16 else 1
    _check(world.run(_cases, cases, repeat), cases, repeat)


def _separate_gate_words(world, cases, repeat):
    """``_cases`` with the group counters as the ROCm backend gives them under
    GPU_STREAMOPS_CP_WAIT=1: each word its own allocation (in falling address order here, so
    word g + 1 is nowhere near word g), which the GEMM counts into through the address table."""
    from portable_overlap.backends import GateWords

    be, made = world.backend, []

    def separate(n, device):
        views = [torch.zeros(16, dtype=torch.int32, device=device)[:1] for _ in range(n)]
        views.sort(key=lambda v: -v.data_ptr())
        table = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)
        made.append(GateWords(views=views, table=table, release=lambda: made.append("freed")))
        return made[0]

    be.alloc_gate_words = separate
    try:
        errs, zero = _cases(world, cases, repeat)
    finally:
        del be.alloc_gate_words
    words = made[0]
    apart = all(words.address(g + 1) != words.address(g) + 4 for g in range(words.n - 1))
    for v in words.views:
        v.fill_(7)
    words.zero_(3)  # one kernel through the table: words 0..2 only
    zeroed = words.values().tolist() == [0] * 3 + [7] * (words.n - 3)
    return errs, zero, words.indirect and apart, made[1:] == ["freed"], zeroed


def _k_shards_of_their_own(world):
    """Each rank's K is its own (a reduction's K shards of different widths): rel. errors of
    the three kinds against their references, twice each (the first call of a plan and a
    guarded one)."""
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
    K = 24 + 8 * world.rank
    errs = []
    try:
        for i, kind in enumerate(("all_reduce", "reduce_scatter", "all_to_all") * 2):
            fn, ref_fn = OPS[kind]
            g = torch.Generator().manual_seed(77 * i + world.rank)
            a, b = torch.randn(32, K, generator=g), torch.randn(K, 20, generator=g)
            rows = 32 // world.world_size if kind == "reduce_scatter" else 32
            out = torch.full((rows, 20), float("nan"))
            fn(a, b, ctx, out)
            ref = ref_fn(a, b, world.group)
            errs.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
    finally:
        ctx.close()
    return errs


def test_k_shards_of_different_widths(world2):
    """The ranks compare the product's M, N, dtype and tiling, not K: uneven K shards of a
    reduction (and each rank's own K in the All-to-All) run; they were refused as a mismatch."""
    for errs in world2.run(_k_shards_of_their_own):
        assert len(errs) == 6 and all(e < TOL[torch.float32] for e in errs), errs


def test_counters_through_the_address_table(world2):
    """The signal GEMM counts into gate words that are separate allocations (ROCm's signal
    memory, where the command processor waits) through their address table: every kind,
    several groups, the second call of each plan waiting on every group's word, the event gate
    (the words zeroed through the table every call), and the words handed back at close."""
    cases = [("all_reduce", torch.float32, 24, 35, 9, False, (2, 4), False),
             ("reduce_scatter", torch.float32, 40, 35, 9, False, (2, 4, 6), False),
             ("all_to_all", torch.float32, 8, 35, 9, False, (2, 2, 2), True),
             ("all_reduce", torch.float32, 24, 35, 9, False, "event", False)]
    results = world2.run(_separate_gate_words, cases, 2)
    _check([r[:2] for r in results], cases, 2)
    for _, _, indirect, freed, zeroed in results:
        assert indirect, "the counters were not separate words reached through a table"
        assert freed, "close did not hand the separate words back once"
        assert zeroed, "zero_(n) through the table did not zero exactly words [0, n)"


def test_every_partition_gives_the_same_result(world):
    W = world.size
    cases = []
    for kind, M, N, K in (("all_reduce", 24, 35, 9), ("reduce_scatter", 10 * W, 35, 9),
                          ("all_to_all", 4 * W, 35, 9)):
        for part in _partitions(kind, M, N, W):
            cases.append((kind, torch.float32, M, N, K, False, part, False))
        cases.append((kind, torch.float32, M, N, K, False, "event", False))
    # on 2 ranks each case twice: the second call waits on every group's counter (a threshold
    # above the tiles a group really has would time out); once on 4 ranks (4 processes on the
    # 2-core CI machine are slow)
    repeat = 2 if W == 2 else 1
    _check(world.run(_cases, cases, repeat), cases, repeat)


def test_library_ops_and_defaults(world2):
    errs = world2.run(_library_ops)
    for e in errs:
        assert all(x < 1e-5 for x in e), e


def _library_ops(world):
    # the torch.library ops of the three patterns through their handles, on this transport,
    # with the CPU default tiling and partition
    ctxs = [make(world, 10, 7, transport="signal_collective")
            for make in (MatmulAllReduce, MatmulReduceScatter, MatmulAllToAll)]
    ops = [torch.ops.portable_overlap.matmul_all_reduce,
           torch.ops.portable_overlap.matmul_reduce_scatter,
           torch.ops.portable_overlap.matmul_all_to_all]
    try:
        a, b = torch.randn(10, 12), torch.randn(12, 7)
        out = [op(a, b, ctx.handle) for op, ctx in zip(ops, ctxs)]
        refs = [gemm_all_reduce_reference(a, b), gemm_reduce_scatter_reference(a, b),
                gemm_all_to_all_signal_reference(a, b)]
        errs = [((o - r).norm() / r.norm()).item() for o, r in zip(out, refs)]
        # the fake implementations (torch.compile's shape propagation) give the real shapes
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fa, fb = mode.from_tensor(a), mode.from_tensor(b)
            shapes = [tuple(op(fa, fb, ctx.handle).shape) for op, ctx in zip(ops, ctxs)]
        assert shapes == [tuple(o.shape) for o in out], shapes
        return errs
    finally:
        for ctx in ctxs:
            ctx.close()


def _rmsnorm(world, cases):
    """The reorder fused with bias, residual and RMSNorm, against the reference."""
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
    errs = []
    try:
        for i, (kind, dtype, M, N, K) in enumerate(cases):
            fn, ref_fn = OPS[kind]
            g = torch.Generator().manual_seed(77 * i + world.rank)
            a = torch.randn(M, K, generator=g).to(dtype)
            b = torch.randn(K, N, generator=g).to(dtype)
            rows = M // world.world_size if kind == "reduce_scatter" else M
            bias, w = torch.randn(N, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
            res = torch.randn(rows, N, generator=g).to(dtype)
            for _ in range(2):  # the second call waits on the counters
                h = torch.full((rows, N), float("nan"), dtype=dtype)
                normed = torch.full((rows, N), float("nan"), dtype=dtype)
                got = fn(a, b, ctx, h, bias=bias, residual=res, rms_weight=w, eps=1e-5,
                         normed=normed)
                assert got[0] is h and got[1] is normed
                ref_h, ref_n = ref_fn(a, b, world.group, bias=bias, residual=res, rms_weight=w,
                                      eps=1e-5)
                errs.append(max(((x.double() - r.double()).norm() / r.double().norm()).item()
                                for x, r in ((h, ref_h), (normed, ref_n))))
    finally:
        ctx.close()
    return errs


def test_fused_rmsnorm(world2):
    # N spans several column tiles (whole-row norm), odd sizes, edge rows
    cases = [("all_reduce", torch.float32, 13, 50, 9),
             ("reduce_scatter", torch.bfloat16, 20, 40, 8), ("all_to_all", torch.float32, 12, 33, 7)]
    for errs in world2.run(_rmsnorm, cases):
        for e, c in zip(errs, [c for c in cases for _ in range(2)]):
            assert e < TOL[c[1]], (e, c)


def _bad(world):
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
    msgs = []
    a, b = torch.randn(8, 8), torch.randn(8, 20)  # 1 x 2 tiles (all_reduce), 4 (the others)
    bad = [(gemm_reduce_scatter, torch.randn(5, 8), b, {}),  # M does not split
           (gemm_all_reduce, torch.randn(4, 8), torch.randn(7, 4), {}),  # K mismatch
           (gemm_all_reduce, a, b.double(), {}),  # dtype
           (gemm_all_reduce, a, b, {"out": torch.empty(8, 21)}),  # out shape
           (gemm_all_reduce, a, b, {"bias": torch.randn(8)}),  # bias shape
           (gemm_reduce_scatter, a, b, {"residual": torch.randn(8, 20)}),  # residual shape
           (gemm_all_reduce, a, b, {"config": SignalConfig(matmul=SMALL, partition=(1, 2))}),
           (gemm_reduce_scatter, a, b, {"config": SignalConfig(matmul=SMALL, partition=(1, 3))}),
           (gemm_all_reduce, a, b, {"config": SignalConfig(matmul=SMALL, reserve_sms=99)}),
           (gemm_all_reduce, a, b, {"normed": torch.empty(8, 20)}),  # normed without weight
           (gemm_all_reduce, a, b, {"rms_weight": torch.randn(3)}),
           (gemm_all_reduce, a, b, {"rms_weight": torch.randn(20), "eps": 0.0}),
           (gemm_all_reduce, a, b, {"config": "gate"}),
           # rows that overlap: every row would be written into the same memory
           (gemm_all_reduce, a, b, {"out": torch.empty(1, 20).expand(8, 20)}),
           (gemm_all_to_all_signal, a, b, {"out": torch.empty(90).as_strided((8, 20), (10, 1))}),
           (gemm_all_reduce, a, b, {"rms_weight": torch.randn(20),
                                    "normed": torch.empty(1, 20).expand(8, 20)})]
    for fn, x, y, kw in bad:
        try:
            if kw.get("config") == "gate":
                kw = {"config": SignalConfig(matmul=SMALL, gate="spin")}
            fn(x, y, ctx, **kw)
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    # the context still works after refused calls
    ok = ((gemm_all_reduce(a, b, ctx) - gemm_all_reduce_reference(a, b)).abs().max() < 1e-4)
    ctx.close()
    return msgs, bool(ok)


def test_bad_input(world2):
    for msgs, ok in world2.run(_bad):
        assert ok
        assert all(m and m.startswith(("matmul_", "SignalConfig: ")) for m in msgs), msgs
        assert "split evenly" in msgs[0] and "partition" in msgs[6] and "multiples" in msgs[7]
        assert "reserve_sms" in msgs[8] and "rms_weight" in msgs[9] and "rms_weight" in msgs[10]
        assert "eps" in msgs[11] and "gate" in msgs[12]
        assert all("out must be a contiguous" in m and "not contiguous" in m
                   for m in msgs[13:15]), msgs[13:15]
        assert "normed must be a contiguous" in msgs[15], msgs[15]


def _disagree(world, what):
    r = []
    if what == "partition":  # the ranks plan different wave groups: caught before any collective
        ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
        part = (2,) if world.rank == 0 else (1, 1)
        try:
            gemm_all_reduce(torch.randn(8, 8), torch.randn(8, 20), ctx,
                            config=SignalConfig(matmul=SMALL, partition=part))
            r.append("no error")
        except RankMismatchError as e:
            r.append(str(e))
        ctx.close()
    else:  # different context configs
        try:
            GemmSignal(world, config=SignalConfig(matmul=SMALL, reserve_sms=world.rank))
            r.append("no error")
        except RankMismatchError as e:
            r.append(str(e))
    return r


def test_ranks_that_disagree_raise(world2):
    for what in ("partition", "config"):
        for r in world2.run(_disagree, what):
            assert r[0].startswith("ranks disagree"), r


def _plan_refused_on_one_rank(world, ce):
    """Rank 1's per-call config plans a partition that does not fit the shape (its tiles are 2
    per rank of 16 x 16): that rank refuses the plan, its peers made theirs. Then the same call
    with the default config on every rank, on NaN-poisoned outputs against the reference.
    Returns (this rank's error of the first call, the second call's relative error)."""
    W = world.world_size
    if ce:
        ctx = GemmReduceScatterCE(world, GemmReduceScatterCE.elems_needed(8 * W, 20, W, 16, 16),
                                  config=SignalConfig(matmul=SMALL), timeout_s=10)
        call, ref_fn = ctx.reduce_scatter, gemm_reduce_scatter_reference
    else:
        ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL))
        call, ref_fn = ctx.all_reduce, gemm_all_reduce_reference
    try:
        g = torch.Generator().manual_seed(5 + world.rank)
        a, b = torch.randn(8 * W, 12, generator=g), torch.randn(12, 20, generator=g)
        bad = SignalConfig(matmul=SMALL, partition=(1,)) if world.rank == 1 else None
        rows = 8 if ce else 8 * W
        try:
            call(a, b, torch.full((rows, 20), float("nan")), config=bad)
            first = "no error"
        except Exception as e:
            first = f"{type(e).__name__}: {e}"
        out = call(a, b, torch.full((rows, 20), float("nan")))
        ref = ref_fn(a, b, world.group).double()
        return first, ((out.double() - ref).norm() / ref.norm()).item()
    finally:
        ctx.close()


@pytest.mark.parametrize("ce", [False, True], ids=["signal_collective", "signal_copy_engine"])
def test_plan_refused_on_one_rank_raises_on_every_rank(world2, ce):
    """A plan that one rank's config refuses (a partition that does not cover the tiles) is
    raised after the ranks compared their plans: refused before, its peers waited in that
    comparison (a host collective without a deadline) for ever."""
    (first0, err0), (first1, err1) = world2.run(_plan_refused_on_one_rank, ce, timeout=120)
    assert first1.startswith("ValueError") and "partition" in first1, first1
    assert first0.startswith("RankMismatchError") and "rank 1: refused" in first0, first0
    assert err0 < 1e-5 and err1 < 1e-5, (err0, err1)


# -- the schedule on the host ------------------------------------------------------------------
@pytest.mark.parametrize("dests", [1, 2, 4])
def test_default_partition_properties(dests):
    for rounds in list(range(1, 40)) + [512, 1024, 2048]:
        n = rounds * dests
        for programs in sorted({1, 2, 3, 5, 8, 16, 116, 132, 304, n}):
            wg = default_partition(n, programs, dests)
            wg.validate(n, dests)
            assert wg.n_groups <= 8
            wave = max(dests, programs - programs % dests)
            if n > wave:  # one wave first, unless a tiny remainder merged into it
                assert wg.sizes[0] == wave or wg.n_groups == 1, (n, programs, wg.sizes)
            assert all(s >= min(n, max(dests, wave // 2)) for s in wg.sizes[1:]) or \
                wg.n_groups == 1, (n, programs, wg.sizes)


@pytest.mark.parametrize("sizes,dests", [((4, 2), 2), ((1, 2, 3), 1), ((4, 8, 4), 4), ((6,), 3)])
def test_tile_layout(sizes, dests):
    wg = WaveGroups(sizes)
    lay = tile_layout(wg, dests)
    assert sorted(lay.slot) == list(range(wg.n_tiles))  # a permutation of the staging slots
    for g, (start, size) in enumerate(zip(wg.starts, wg.sizes)):
        ts = range(start, start + size)
        assert {lay.slot[t] for t in ts} == set(range(start, start + size))  # contiguous chunk
        for d in range(dests):  # destination d's part of the chunk is contiguous and in order
            part = [lay.slot[t] for t in ts if lay.dest[t] == d]
            assert part == list(range(start + d * size // dests, start + (d + 1) * size // dests))
    for t in range(wg.n_tiles):
        assert lay.tile_of_slot(lay.slot[t]) == t and lay.group[t] == wg.group_of(t)


def test_signal_config_counts_must_be_ints():
    """A partition's sizes, ``max_groups`` and ``reserve_sms`` are ints (not bools, floats or
    strings) and ``matmul`` a MatmulConfig: a partition of (1.5, 2.5) was read as (1, 2), and
    the others were accepted to fail, or not, at a call."""
    for bad in (dict(partition=(1.5, 2.5)), dict(partition=(2.0, 2.0)), dict(partition=("2",)),
                dict(partition=(True, 1)), dict(partition=4), dict(max_groups=1.5),
                dict(max_groups=True), dict(reserve_sms=0.5), dict(reserve_sms=True),
                dict(matmul="16x16")):
        with pytest.raises(ValueError, match="SignalConfig: "):
            SignalConfig(**bad)
    assert SignalConfig(partition=WaveGroups((2, 2))).partition == (2, 2)
    assert SignalConfig(partition=[2, 2], reserve_sms=0, max_groups=8).partition == (2, 2)


def test_wave_groups_validation():
    for bad in [(), (0, 2), (3, -1)]:
        with pytest.raises(ValueError):
            WaveGroups(bad)
    with pytest.raises(ValueError, match="sum to"):
        WaveGroups((2, 2)).validate(5)
    with pytest.raises(ValueError, match="multiples"):
        WaveGroups((3, 3)).validate(6, multiple_of=2)
    with pytest.raises(ValueError):
        default_partition(5, 4, multiple_of=2)


# -- the host sequence on streams (the CPU backend has none: a recording stand-in) -------------
class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name}.wait({other.name})")


class _Module:
    """Stands in for torch's device module: streams that log, a current-stream context."""

    def __init__(self, log):
        self.log, self.caller = log, _Stream("caller", log)
        self.current = self.caller

    def Stream(self, device=None):
        return _Stream("comm", self.log)

    def current_stream(self, device=None):
        return self.current

    def stream(self, s):
        mod = self

        class _Ctx:
            def __enter__(self):
                self.prev, mod.current = mod.current, s

            def __exit__(self, *exc):
                mod.current = self.prev

        return _Ctx()

    def is_current_stream_capturing(self):
        return False


def _sequence(world):
    from portable_overlap.ops.gemm_signal import api

    log = []
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL, partition=(2, 4)))
    mod = _Module(log)
    ctx._mod, ctx.comm_stream, ctx._comm_handle = mod, mod.Stream(), "comm"
    be = ctx.backend

    class _Backend:  # the real CPU entries, logged with the stream they were given
        name = be.name

        def stream_wait_value(self, stream, addr, value):
            log.append(f"{stream}:wait[{(addr - ctx.counters.address(0)) // 4}]>={value}")
            be.stream_wait_value(stream, addr, value)

        def stream_write_value(self, stream, addr, value):
            log.append(f"{stream}:write[{(addr - ctx.counters.address(0)) // 4}]={value}")
            be.stream_write_value(stream, addr, value)

        def synchronize(self, device):
            log.append("sync")

        def current_stream(self, device):
            return mod.current.name

    class _Logged:  # a module's functions (torch.distributed's, the library's collectives),
        # logged with the current stream
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            real = getattr(self.module, name)

            def call(*args, **kwargs):
                log.append(f"{mod.current.name}:{name}")
                return real(*args, **kwargs)
            return call

    ctx.backend = _Backend()
    real_launch = ctx.launch_plan

    def launch_plan(*args):
        gemm, reorder = real_launch(*args)

        def logged(name, k):
            def run(a):
                log.append(f"{mod.current.name}:{name}")
                k(a)
            run.programs = k.programs
            return run
        return logged("gemm", gemm), logged("reorder", reorder)

    ctx.launch_plan = launch_plan
    saved = api.dist, api.collectives
    api.dist, api.collectives = _Logged(torch.distributed), _Logged(api.collectives)
    try:
        a, b = torch.randn(12, 8), torch.randn(8, 40)  # 1 x 3 tiles per rank block: 6 tiles
        firsts = []
        for _ in range(2):
            log.clear()
            out = gemm_reduce_scatter(a, b, ctx)
            firsts.append(list(log))
        ref = gemm_reduce_scatter_reference(a, b, world.group)
        assert torch.allclose(out, ref, atol=1e-5)
    finally:
        api.dist, api.collectives = saved
        ctx.close()
    return firsts


def test_host_sequence_on_streams(world2):
    first, later = world2.run(_sequence)[0]
    # first call of a plan: the plan's check of the ranks (on the bounded signal group), no
    # value wait (the comm stream waits for the whole GEMM), then sync (a kernel on the comm
    # stream resets the counters: not in the log)
    assert first == ["caller:all_gather_object", "comm.wait(caller)", "caller:gemm",
                     "comm.wait(caller)",
                     "comm:reduce_scatter", "comm:reduce_scatter",
                     "caller.wait(comm)", "caller:reorder", "sync"], first
    # later calls: fork before the GEMM, a value wait per group on the comm stream, reset, the
    # collective, then the join before the reorder; no sync
    assert later == ["comm.wait(caller)", "caller:gemm",
                     "comm:wait[0]>=2", "comm:write[0]=0", "comm:reduce_scatter",
                     "comm:wait[1]>=4", "comm:write[1]=0", "comm:reduce_scatter",
                     "caller.wait(comm)", "caller:reorder"], later


def _phases(world):
    # the GEMM and the reorder without the collectives: an AllReduce plan reorders straight from
    # staging, so gemm() then reorder() gives this rank's own a @ b; then the same tensors
    # through the op (after reset(), its waits must see only its own tiles)
    ctx = GemmSignal(world, config=SignalConfig(matmul=SMALL, partition=(2, 4)))
    try:
        g = torch.Generator().manual_seed(5 + world.rank)
        a, b = torch.randn(24, 9, generator=g), torch.randn(9, 35, generator=g)  # 2 x 3 tiles
        out = torch.full((24, 35), float("nan"))
        p = ctx.phases("all_reduce", a, b, out)
        p["gemm"]()
        counts = ctx.counters.values()[:2].tolist()
        p["reorder"]()
        local = ((out - a @ b).norm() / (a @ b).norm()).item()
        p["reset"]()
        info = (p["n_tiles"], p["dests"], p["tile_bytes"], p["groups"].sizes, p["programs"] >= 1)
        for _ in range(2):  # the first call runs unguarded, the second waits on the counters
            out.fill_(float("nan"))
            gemm_all_reduce(a, b, ctx, out)
        ref = gemm_all_reduce_reference(a, b, world.group)
        return counts, local, info, ((out - ref).norm() / ref.norm()).item()
    finally:
        ctx.close()


def test_phases_run_the_gemm_and_reorder_apart(world2):
    for counts, local, info, err in world2.run(_phases):
        assert counts == [2, 4] and local < 1e-5 and err < 1e-5, (counts, local, err)
        assert info == (6, 1, 16 * 16 * 4, (2, 4), True), info


def test_grid_leaves_room_for_spinning_waits():
    """The persistent GEMM's grid leaves the programs a stream wait holds while it spins
    (``DeviceFacts.gate_programs``): none on H200, one CU on MI300X, where the waits are kernels."""
    import types

    from portable_overlap.backends import DeviceFacts

    def grid(facts, cfg=SignalConfig()):
        ctx = types.SimpleNamespace(world=types.SimpleNamespace(facts=facts))
        return GemmSignal.grid_programs(ctx, cfg)

    common = dict(warp_size=32, max_shared_bytes_per_sm=1, max_regs_per_sm=1, max_warps_per_sm=1)
    h200 = DeviceFacts(vendor="nvidia", name="H200", arch="sm_90", sm_count=132, **common)
    mi300 = DeviceFacts(vendor="amd", name="MI300X", arch="gfx942", sm_count=304,
                        gate_programs=1, **common)
    assert (grid(h200), grid(mi300)) == (132, 303)
    assert grid(mi300, SignalConfig(reserve_sms=16)) == 287
    with pytest.raises(ValueError, match="leaves no SM"):
        grid(mi300, SignalConfig(reserve_sms=303))
