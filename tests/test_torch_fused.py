"""The ``"torch_fused"`` transport (ops/torch_fused.py) on the CPU: where it may run
(``unavailable_reason``, ``PatternContext.unavailable``), the ``BackendUnavailable`` it raises on
the CPU-emulated backend when named (as ``transport=``, in ``candidates=``, as a workspace) and
``"auto"``'s default candidates there.

torch registers its fused ops for GPU tensors only, so the transport's own code (input checks,
``out=``, bias and residual, the shards' order, the workspace it sizes, its place among
``"auto"``'s candidates) runs here with torch's reference implementations of the two ops
(``_fused_all_gather_matmul_fallback``, ``_fused_matmul_reduce_scatter_fallback``: gather or
reduce-scatter by the process group, then the product) registered as their CPU kernels, the
availability check passed over and torch's workspace allocation recorded instead of made.
tests/gpu/check_torch_fused.py runs the real ops on GPUs."""
import types

import pytest
import torch

import portable_overlap as po
from portable_overlap.errors import BackendUnavailable
from portable_overlap.ops import planner, torch_fused
from portable_overlap.ops.gemm_signal import SignalConfig
from portable_overlap.ops.pattern import transport_unavailable
from portable_overlap.schedule import tuning
from portable_overlap.testing.compare import rel_err
from portable_overlap.testing.patterns import GEMM_PATTERNS, pattern_inputs

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PATTERN_CONTEXTS = (po.AllGatherMatmul, po.MatmulReduceScatter)


def _stub_world(backend: str, world_size: int, local_world_size: int):
    return types.SimpleNamespace(backend=types.SimpleNamespace(name=backend),
                                 world_size=world_size, local_world_size=local_world_size)


# -- where it runs (one process) ------------------------------------------------------------------
def test_a_real_transport_but_not_the_default():
    for make in PATTERN_CONTEXTS:
        assert "torch_fused" in make.TRANSPORTS and make.TRANSPORTS[0] != "torch_fused"
        assert make.TRANSPORTS[-1] == "sequential"  # timed last, the baseline
    assert "torch_fused" not in po.MatmulAllReduce.TRANSPORTS  # torch has no such fused op
    assert "torch_fused" not in po.MatmulAllToAll.TRANSPORTS


def test_where_it_may_run():
    why = torch_fused.unavailable_reason(_stub_world("cpu", 2, 2))
    assert why and "CPU-emulated backend" in why and "GPU tensors only" in why
    assert torch_fused.unavailable_reason(_stub_world("gpu", 1, 1)) is None  # a world of one
    assert torch_fused.unavailable_reason(_stub_world("gpu", 8, 8)) is None
    why = torch_fused.unavailable_reason(_stub_world("gpu", 16, 8))
    assert why and "more than one host" in why and "16 ranks, 8 on this one" in why
    # every other transport runs wherever the backend does
    cpu = _stub_world("cpu", 2, 2)
    assert transport_unavailable(cpu, "torch_fused") == torch_fused.unavailable_reason(cpu)
    assert all(transport_unavailable(cpu, t) is None
               for make in PATTERN_CONTEXTS for t in make.TRANSPORTS if t != "torch_fused")


def test_not_where_torch_symmetric_memory_is_bound_to_nvshmem(monkeypatch):
    """torch's fused ops allocate a workspace per process group, which torch's NVSHMEM backend
    refuses: after a transport='shmem' context (which selects it) they are unavailable, with the
    reason, not a RuntimeError from inside torch."""
    import torch.distributed._symmetric_memory as symm_mem

    world = _stub_world("gpu", 4, 4)
    world.device = torch.device("cpu")
    monkeypatch.setattr(symm_mem, "get_backend", lambda device: "NVSHMEM", raising=False)
    why = torch_fused.unavailable_reason(world)
    assert why and "NVSHMEM" in why and "cannot share a process" in why
    monkeypatch.setattr(symm_mem, "get_backend", lambda device: "CUDA", raising=False)
    assert torch_fused.unavailable_reason(world) is None


def test_candidates_with_and_without_it():
    T = po.MatmulReduceScatter.TRANSPORTS
    without = tuple(t for t in T if t != "torch_fused")
    # a default candidate where it can run (its calls agree first: planner.UNBOUNDED)
    assert planner.check_candidates("op", T, None, {}) == T
    assert planner.check_candidates("op", T, None) == T
    assert planner.check_candidates("op", T, None, {"torch_fused": "no GPU"}) == without
    assert planner.check_candidates("op", T, T, {}) == T
    assert planner.check_candidates("op", T, ["sequential", "torch_fused"], {}) == (
        "torch_fused", "sequential")
    with pytest.raises(BackendUnavailable, match=r"op: candidates names 'torch_fused', which "
                                                 r"cannot run here: no GPU"):
        planner.check_candidates("op", T, ["sequential", "torch_fused"], {"torch_fused": "no GPU"})
    with pytest.raises(ValueError, match="candidates must be"):  # unknown names first
        planner.check_candidates("op", T, ["nccl"], {"torch_fused": "no GPU"})


# -- on the CPU-emulated backend ------------------------------------------------------------------
def _refusals(world):
    from portable_overlap.ops.torch_fused import TorchFusedAllGatherMatmul, TorchFusedMatmul

    found = {}
    makers = {
        "all_gather_matmul": lambda **kw: po.AllGatherMatmul(world, 64, **kw),
        "matmul_reduce_scatter": lambda **kw: po.MatmulReduceScatter(world, 8, 8, **kw),
        "workspace ag": lambda **kw: TorchFusedAllGatherMatmul(world, "all_gather_matmul", 64),
        "workspace rs": lambda **kw: TorchFusedMatmul(world, "matmul_reduce_scatter", 8, 8),
    }
    for name, make in makers.items():
        try:
            make(transport="torch_fused").close()
            found[name] = None
        except BackendUnavailable as e:
            found[name] = str(e)
    for name in ("all_gather_matmul", "matmul_reduce_scatter"):
        make = makers[name]
        try:
            make(transport="auto", candidates=("torch_fused", "sequential")).close()
            found[f"{name} candidates"] = None
        except BackendUnavailable as e:
            found[f"{name} candidates"] = str(e)
        ctx = make(transport="auto")
        found[f"{name} default"] = (ctx.planner.candidates, sorted(ctx.planner.impls))
        ctx.close()
    found["unavailable"] = {m.__name__: m.unavailable(world) for m in PATTERN_CONTEXTS}
    found["available"] = {m.__name__: m.available(world) for m in PATTERN_CONTEXTS}
    return found


def test_unavailable_on_the_emulated_backend(world2):
    for found in world2.run(_refusals):
        for name in ("all_gather_matmul", "matmul_reduce_scatter"):
            assert found[name] == (f"{name}: transport 'torch_fused' cannot run here: the "
                                   f"CPU-emulated backend: torch registers its symm_mem fused "
                                   f"ops for GPU tensors only"), found[name]
            msg = found[f"{name} candidates"]
            assert msg and msg.startswith(f"{name}: candidates names 'torch_fused', which cannot "
                                          f"run here: the CPU-emulated backend"), msg
            cands, made = found[f"{name} default"]
            assert "torch_fused" not in cands and "torch_fused" not in made
            assert "sequential" in cands
        for key in ("workspace ag", "workspace rs"):
            assert found[key] and "cannot run here: the CPU-emulated backend" in found[key]
        for make in PATTERN_CONTEXTS:
            assert set(found["unavailable"][make.__name__]) == {"torch_fused"}
            assert found["available"][make.__name__] == tuple(
                t for t in make.TRANSPORTS if t != "torch_fused")


# -- the transport's own code, with torch's reference implementations as CPU kernels -------------
class _TorchOnCpu:
    """In a rank: torch's reference implementations of the two ops registered as their CPU
    kernels, the availability check passed over, and torch's workspace allocation recorded (the
    sizes asked for) instead of made."""

    def __init__(self):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem, self.sizes = symm_mem, []
        self.lib = torch.library.Library("symm_mem", "IMPL")
        self.lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback,
                      "CPU")
        self.lib.impl("fused_matmul_reduce_scatter",
                      symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
        self.saved = (torch_fused.unavailable_reason, symm_mem.get_symm_mem_workspace)
        torch_fused.unavailable_reason = lambda world: None
        symm_mem.get_symm_mem_workspace = lambda group, min_size: self.sizes.append(
            (group, min_size))

    def close(self):
        torch_fused.unavailable_reason, self.symm_mem.get_symm_mem_workspace = self.saved
        self.lib._destroy()


def _ag_inputs(world, m, K, N, dtype, seed):
    g = torch.Generator().manual_seed(100 * seed + world.rank)
    a = torch.randn(m, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=torch.Generator().manual_seed(seed)).to(dtype)  # same on all
    return a, b


def _results(world, dtype):
    """Both patterns on ``"torch_fused"`` against the references: odd shapes, ``out`` poisoned
    or not given, bias and residual; the workspace sizes asked for."""
    W = world.world_size
    found = []
    on_cpu = _TorchOnCpu()
    try:
        with po.AllGatherMatmul(world, 7 * 13, transport="torch_fused") as ctx:
            for seed, (m, K, N) in enumerate([(7, 13, 5), (1, 3, 9), (3, 1, 2)]):
                a, b = _ag_inputs(world, m, K, N, dtype, seed)
                ref = po.all_gather_matmul_reference(a, b, world.group)
                out = torch.full((W * m, N), float("nan"), dtype=dtype)
                y = po.all_gather_matmul(a, b, ctx, out)
                y2 = po.all_gather_matmul(a, b, ctx)  # torch's own result tensor
                found.append(("all_gather_matmul", (m, K, N), y is out, rel_err(out, ref),
                              rel_err(y2, ref), tuple(y2.shape), y2.is_contiguous()))
        ag_sizes = list(on_cpu.sizes)
        rs = GEMM_PATTERNS["matmul_reduce_scatter"]
        with po.MatmulReduceScatter(world, 5 * W, 11, transport="torch_fused") as ctx:
            for seed, (M, N, K) in enumerate([(5 * W, 11, 3 + world.rank), (W, 1, 2),
                                              (3 * W, 7, 1)]):
                g = torch.Generator().manual_seed(10 * seed + world.rank)
                a, b, bias, res = pattern_inputs(g, M, N, K, M // W, dtype)
                out = torch.full((M // W, N), float("nan"), dtype=dtype)
                y = po.matmul_reduce_scatter(a, b, ctx, out, bias=bias, residual=res)
                y2 = po.matmul_reduce_scatter(a, b, ctx)
                found.append(("matmul_reduce_scatter", (M, N, K), y is out,
                              rel_err(out, rs[1](a, b, world.group, bias, res)),
                              rel_err(y2, rs[1](a, b, world.group, None, None)),
                              tuple(y2.shape), y2.is_contiguous()))
        return found, ag_sizes, on_cpu.sizes[len(ag_sizes):]
    finally:
        on_cpu.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_results_match_the_references(world2, dtype):
    W = 2
    for found, ag_sizes, rs_sizes in world2.run(_results, dtype):
        assert len(found) == 6
        for name, shape, into_out, err, err2, shape2, contiguous in found:
            assert into_out and err < TOL[dtype] and err2 < TOL[dtype], (name, shape, err, err2)
            rows = W * shape[0] if name == "all_gather_matmul" else shape[0] // W
            assert shape2 == (rows, shape[1 if name == "matmul_reduce_scatter" else 2])
            assert contiguous
        # sized for the largest call, in the widest dtype: W shards of max_shard_elems (AG);
        # two [ceil(max_m / W), max_n] chunks (RS)
        assert [s for _, s in ag_sizes] == [W * 7 * 13 * 4]
        assert [s for _, s in rs_sizes] == [2 * 5 * 11 * 4]


def _errors(world):
    """The same bad calls on ``"torch_fused"`` and ``"sequential"`` (every rank passes the same,
    so every rank refuses): the exception types and messages of each."""
    W = world.world_size
    on_cpu = _TorchOnCpu()
    found = {}
    try:
        a, b = torch.randn(3, 4), torch.randn(4, 5)
        ag_calls = {
            "dtypes differ": lambda ctx: po.all_gather_matmul(a, b.double(), ctx),
            "shapes": lambda ctx: po.all_gather_matmul(a, torch.randn(3, 5), ctx),
            "too large": lambda ctx: po.all_gather_matmul(torch.randn(5, 4), b, ctx),
            "a not contiguous": lambda ctx: po.all_gather_matmul(torch.randn(4, 3).t(), b, ctx),
            "out shape": lambda ctx: po.all_gather_matmul(a, b, ctx, torch.empty(3, 5)),
            "out dtype": lambda ctx: po.all_gather_matmul(a, b, ctx,
                                                          torch.empty(W * 3, 5).double()),
            "schedule": lambda ctx: po.all_gather_matmul(a, b, ctx,
                                                         schedule="uniform-fused-1d"),
        }
        M = 2 * W
        a2, b2 = torch.randn(M, 4), torch.randn(4, 5)
        rs_calls = {
            "dtypes differ": lambda ctx: po.matmul_reduce_scatter(a2.half(), b2, ctx),
            "shapes": lambda ctx: po.matmul_reduce_scatter(a2, torch.randn(3, 5), ctx),
            "rows not split": lambda ctx: po.matmul_reduce_scatter(torch.randn(M + 1, 4), b2,
                                                                   ctx),
            "too large": lambda ctx: po.matmul_reduce_scatter(torch.randn(2 * M, 4), b2, ctx),
            "out shape": lambda ctx: po.matmul_reduce_scatter(a2, b2, ctx, torch.empty(M, 5)),
            "bias": lambda ctx: po.matmul_reduce_scatter(a2, b2, ctx, bias=torch.randn(4)),
            "residual": lambda ctx: po.matmul_reduce_scatter(a2, b2, ctx,
                                                             residual=torch.randn(M, 5)),
            "per-call option": lambda ctx: po.matmul_reduce_scatter(a2, b2, ctx,
                                                                    config=SignalConfig()),
        }
        for transport in ("torch_fused", "sequential"):
            for name, make, calls in (
                    ("all_gather_matmul", lambda t: po.AllGatherMatmul(world, 12, transport=t),
                     ag_calls),
                    ("matmul_reduce_scatter",
                     lambda t: po.MatmulReduceScatter(world, M, 5, transport=t), rs_calls)):
                with make(transport) as ctx:
                    for label, call in calls.items():
                        try:
                            call(ctx)
                            found[(transport, name, label)] = None
                        except Exception as e:  # noqa: BLE001  (the kind is the finding)
                            found[(transport, name, label)] = (type(e).__name__, str(e))
                    ctx.synchronize()  # still usable: every rank refused the same calls
                    found[(transport, name, "after")] = rel_err(
                        call_ok(name, ctx, world), ref_ok(name, world))
        return found
    finally:
        on_cpu.close()


def _ok_inputs(name, world):
    g = torch.Generator().manual_seed(7)  # the same on every rank: the sums are W * one
    if name == "all_gather_matmul":
        return torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    return torch.randn(2 * world.world_size, 4, generator=g), torch.randn(4, 5, generator=g)


def call_ok(name, ctx, world):
    return getattr(po, name)(*_ok_inputs(name, world), ctx)


def ref_ok(name, world):
    a, b = _ok_inputs(name, world)
    if name == "all_gather_matmul":
        return po.all_gather_matmul_reference(a, b, world.group)
    return po.matmul_reduce_scatter_reference(a, b, world.group)


def test_bad_input_errors_are_the_other_transports(world2):
    for found in world2.run(_errors):
        labels = {k[1:] for k in found if k[0] == "torch_fused"}
        assert labels == {k[1:] for k in found if k[0] == "sequential"}
        for name, label in sorted(labels):
            got, want = found[("torch_fused", name, label)], found[("sequential", name, label)]
            if label == "after":
                assert got < 1e-5 and want < 1e-5
                continue
            assert got is not None, (name, label)
            assert got[0] == want[0], (name, label, got, want)  # the same kind
            assert got[1].startswith(f"{name}: "), got  # naming the op
            if label not in ("schedule", "per-call option"):  # those name the transport
                assert got[1] == want[1], (name, label, got, want)
            else:
                assert "'torch_fused' transport" in got[1], got


class _Steered:
    """Stands in for ``tuning.time_call`` (``with fake:``): runs the timed call once and says
    "torch_fused" is the fastest, the same on every rank; ``ran``: the transports it ran."""

    def __init__(self, ctx):
        self.ran, run = [], ctx._run

        def recording(transport, impl, *args):
            self.ran.append(transport)
            return run(transport, impl, *args)

        ctx._run = recording

    def __call__(self, fn, world, *, iters, warmup, graph):
        fn()
        return 0.5 if self.ran[-1] == "torch_fused" else 2.0

    def __enter__(self):
        self.real, tuning.time_call = tuning.time_call, self
        return self

    def __exit__(self, *exc):
        tuning.time_call = self.real


def _auto(world):
    """``"auto"`` with torch_fused among its candidates (named, and by default where it can
    run), the pick steered to it (a correct result into the poisoned out), per-call options it
    does not take keeping the call off it, and an ``out`` one rank's input checks refuse on
    a key decided for it: every rank raises in that call (torch's barriers would wait for ever
    for the refusing rank), and the next call is right."""
    W = world.world_size
    on_cpu = _TorchOnCpu()
    found = {}
    try:
        ctx = po.MatmulReduceScatter(world, 4 * W, 6, transport="auto", iters=1, warmup=0,
                                     candidates=po.MatmulReduceScatter.TRANSPORTS)
        fake = _Steered(ctx)
        try:
            found["rs candidates"] = ctx.planner.candidates
            g = torch.Generator().manual_seed(world.rank)
            a, b, bias, res = pattern_inputs(g, 4 * W, 6, 3, 4, torch.float32)
            out = torch.full((4, 6), float("nan"))
            with fake:
                po.matmul_reduce_scatter(a, b, ctx, out, bias=bias, residual=res)
                found["rs pick"] = ctx.choice(a, b, bias, res)
                found["rs err"] = rel_err(out, GEMM_PATTERNS["matmul_reduce_scatter"][1](
                    a, b, world.group, bias, res))
                found["rs timed"] = sorted(set(fake.ran))
                po.matmul_reduce_scatter(a, b, ctx, config=SignalConfig())
                found["rs with config"] = ctx.choice(a, b, config=SignalConfig())
        finally:
            ctx.close()
        ctx = po.AllGatherMatmul(world, 64, transport="auto", iters=1, warmup=0)
        fake = _Steered(ctx)
        try:
            found["ag candidates"] = ctx.planner.candidates
            a, b = _ag_inputs(world, 5, 3, 7, torch.float32, 1)
            out = torch.full((W * 5, 7), float("nan"))
            with fake:
                po.all_gather_matmul(a, b, ctx, out)
                found["ag pick"] = ctx.choice(a, b)
                found["ag err"] = rel_err(out, po.all_gather_matmul_reference(a, b, world.group))
                po.all_gather_matmul(a, b, ctx, schedule="hetero-unfused-1d")
                found["ag with schedule"] = ctx.choice(a, b, schedule="hetero-unfused-1d")
            try:
                po.all_gather_matmul(a, b, ctx, torch.empty(1, 7) if world.rank == 1 else out)
                found["ag bad out"] = "no error"
            except Exception as e:
                found["ag bad out"] = type(e).__name__
            out.fill_(float("nan"))
            po.all_gather_matmul(a, b, ctx, out)
            found["ag after"] = rel_err(out, po.all_gather_matmul_reference(a, b, world.group))
        finally:
            ctx.close()
        return found
    finally:
        on_cpu.close()


def test_auto_picks_it_where_it_runs(world2):
    for rank, found in enumerate(world2.run(_auto, timeout=600)):
        assert found["rs candidates"] == po.MatmulReduceScatter.TRANSPORTS
        assert found["ag candidates"] == po.AllGatherMatmul.TRANSPORTS
        assert found["rs pick"] == "torch_fused" and found["rs err"] < 1e-5
        assert found["rs timed"] == sorted(po.MatmulReduceScatter.TRANSPORTS)
        assert found["rs with config"] in ("signal_collective", "signal_copy_engine")
        assert found["ag pick"] == "torch_fused" and found["ag err"] < 1e-5
        assert found["ag with schedule"] == "copy_engine"
        assert found["ag bad out"] == ("ValueError" if rank == 1 else "RankMismatchError")
        assert found["ag after"] < 1e-5
