"""The ``"torch_fused"`` transport (ops/torch_fused.py) on the CPU: where it may run
(``unavailable_reason``, ``PatternContext.unavailable``), the ``BackendUnavailable`` it raises on
the CPU-emulated backend when named (as ``transport=``, in ``candidates=``, as a workspace) and
``"auto"``'s default candidates there.

torch registers its fused ops for GPU tensors only, so the transport's own code (input checks,
``out=``, bias and residual, the shards' order, the workspace it sizes, its place among
``"auto"``'s candidates) runs here with torch's reference implementations of the two GEMM ops
(``_fused_all_gather_matmul_fallback``, ``_fused_matmul_reduce_scatter_fallback``: gather or
reduce-scatter by the process group, then the product) registered as their CPU kernels, the
availability check passed over and torch's workspace allocation recorded instead of made; for
GEMV + AllReduce, ``one_shot_all_reduce_out`` as the process group's all_reduce of a copy, and
``symm_mem.empty`` / ``rendezvous`` as a plain tensor and a record.
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
PATTERN_CONTEXTS = (po.AllGatherMatmul, po.MatmulReduceScatter, po.GemvAllReduce)


def _stub_world(backend: str, world_size: int, local_world_size: int, shared: bool = False):
    return types.SimpleNamespace(backend=types.SimpleNamespace(name=backend),
                                 world_size=world_size, local_world_size=local_world_size,
                                 shares_devices=lambda: shared)


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
    assert why and "more than one host" in why and "16 ranks in the job, 8 on this one" in why
    # two ranks on one GPU: torch's allocator refuses overlapping devices at its rendezvous
    why = torch_fused.unavailable_reason(_stub_world("gpu", 2, 2, shared=True))
    assert why and "ranks share a GPU" in why, why
    assert torch_fused.unavailable_reason(_stub_world("gpu", 1, 1, shared=True)) is None
    # every other transport runs wherever the backend does
    cpu = _stub_world("cpu", 2, 2)
    assert transport_unavailable(cpu, "torch_fused") == torch_fused.unavailable_reason(cpu)
    assert all(transport_unavailable(cpu, t) is None
               for make in PATTERN_CONTEXTS for t in make.TRANSPORTS if t != "torch_fused")


def test_each_op_needs_its_own_torch_ops(monkeypatch):
    """GEMV + AllReduce needs torch's one_shot_all_reduce_out, the GEMM patterns their fused
    ops: a torch without one of them leaves only that op's transport out."""
    gpu = _stub_world("gpu", 4, 4)
    assert torch_fused.TORCH_OPS["gemv_all_reduce"] == ("one_shot_all_reduce_out",)
    assert torch_fused.unavailable_reason(gpu, "gemv_all_reduce") is None
    monkeypatch.setitem(torch_fused.TORCH_OPS, "gemv_all_reduce", ("no_such_one_shot",))
    why = torch_fused.unavailable_reason(gpu, "gemv_all_reduce")
    assert why and why.endswith("has no torch.ops.symm_mem.no_such_one_shot"), why
    assert torch_fused.unavailable_reason(gpu, "matmul_reduce_scatter") is None
    assert torch_fused.unavailable_reason(gpu) == why  # every op's, without one named
    assert transport_unavailable(gpu, "torch_fused", "gemv_all_reduce") == why
    assert po.GemvAllReduce.unavailable(gpu) == {"torch_fused": why}
    assert po.AllGatherMatmul.unavailable(gpu) == {}


def test_gemv_workspace_refuses_options(world2):
    for msg in world2.run(_gemv_options):
        assert msg == ("gemv_all_reduce: the 'torch_fused' transport takes no options; got "
                       "['config']"), msg


def _gemv_options(world):
    from portable_overlap.ops.torch_fused import TorchFusedGemv

    try:  # options are refused before the availability check: the CPU says so too
        TorchFusedGemv(world, "gemv_all_reduce", 8, config=po.GemvConfig()).close()
    except ValueError as e:
        return str(e)
    return None


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

    from portable_overlap.ops.torch_fused import TorchFusedGemv

    found = {}
    makers = {
        "all_gather_matmul": lambda **kw: po.AllGatherMatmul(world, 64, **kw),
        "matmul_reduce_scatter": lambda **kw: po.MatmulReduceScatter(world, 8, 8, **kw),
        "gemv_all_reduce": lambda **kw: po.GemvAllReduce(world, 8, **kw),
        "workspace ag": lambda **kw: TorchFusedAllGatherMatmul(world, "all_gather_matmul", 64),
        "workspace rs": lambda **kw: TorchFusedMatmul(world, "matmul_reduce_scatter", 8, 8),
        "workspace gemv": lambda **kw: TorchFusedGemv(world, "gemv_all_reduce", 8),
    }
    for name, make in makers.items():
        try:
            make(transport="torch_fused").close()
            found[name] = None
        except BackendUnavailable as e:
            found[name] = str(e)
    for name in OP_NAMES:
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


OP_NAMES = ("all_gather_matmul", "matmul_reduce_scatter", "gemv_all_reduce")


def test_unavailable_on_the_emulated_backend(world2):
    for found in world2.run(_refusals):
        for name in OP_NAMES:
            assert found[name] == (f"{name}: transport 'torch_fused' cannot run here: the "
                                   f"CPU-emulated backend: torch registers its symm_mem fused "
                                   f"ops for GPU tensors only"), found[name]
            msg = found[f"{name} candidates"]
            assert msg and msg.startswith(f"{name}: candidates names 'torch_fused', which cannot "
                                          f"run here: the CPU-emulated backend"), msg
            cands, made = found[f"{name} default"]
            assert "torch_fused" not in cands and "torch_fused" not in made
            assert "sequential" in cands
        for key in ("workspace ag", "workspace rs", "workspace gemv"):
            assert found[key] and "cannot run here: the CPU-emulated backend" in found[key]
        for make in PATTERN_CONTEXTS:
            assert set(found["unavailable"][make.__name__]) == {"torch_fused"}
            assert found["available"][make.__name__] == tuple(
                t for t in make.TRANSPORTS if t != "torch_fused")


# -- the transport's own code, with torch's reference implementations as CPU kernels -------------
class _TorchOnCpu:
    """In a rank: torch's reference implementations of the two GEMM ops registered as their CPU
    kernels, the availability check passed over, and torch's workspace allocation recorded (the
    sizes asked for) instead of made. For GEMV: ``one_shot_all_reduce_out`` as the process
    group's all_reduce of a copy of its input (``one_shots``: each call's input length, input
    address, storage offset and output address), ``symm_mem.empty`` as ``torch.empty`` and
    ``rendezvous`` recorded (``rendezvous``: the tensor's address and length, the group)."""

    def __init__(self):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem, self.sizes, self.one_shots, self.rendezvous = symm_mem, [], [], []
        self.lib = torch.library.Library("symm_mem", "IMPL")
        self.lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback,
                      "CPU")
        self.lib.impl("fused_matmul_reduce_scatter",
                      symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
        self.lib.impl("one_shot_all_reduce_out", self._one_shot, "CPU")
        self.saved = (torch_fused.unavailable_reason, symm_mem.get_symm_mem_workspace,
                      symm_mem.empty, symm_mem.rendezvous)
        torch_fused.unavailable_reason = lambda world, op=None: None
        symm_mem.get_symm_mem_workspace = lambda group, min_size: self.sizes.append(
            (group, min_size))
        symm_mem.empty = lambda *size, dtype=None, device=None: torch.empty(
            *size, dtype=dtype, device=device)
        symm_mem.rendezvous = lambda t, group: self.rendezvous.append(
            (t.data_ptr(), t.numel(), group))

    def _one_shot(self, inp, reduce_op, group_name, out):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        assert reduce_op == "sum" and inp.shape == out.shape and inp.dtype == out.dtype
        self.one_shots.append((inp.numel(), inp.data_ptr(), inp.storage_offset(),
                               out.data_ptr()))
        out.copy_(inp)
        dist.all_reduce(out, group=_resolve_process_group(group_name))
        return out

    def close(self):
        (torch_fused.unavailable_reason, self.symm_mem.get_symm_mem_workspace,
         self.symm_mem.empty, self.symm_mem.rendezvous) = self.saved
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

    def __call__(self, fn, world, *, iters, warmup, graph, host_bound=False):
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
            found["ag bad out"], found["ag after"] = _bad_out_then_right(
                world, lambda o: po.all_gather_matmul(a, b, ctx, o), out, torch.empty(1, 7),
                lambda: po.all_gather_matmul_reference(a, b, world.group))
        finally:
            ctx.close()
        return found
    finally:
        on_cpu.close()


def _bad_out_then_right(world, call, out, bad, ref):
    """``call(bad)`` on rank 1 (``call(out)`` elsewhere), then ``call(out)`` on every rank
    into a poisoned ``out``: (the first call's error type or "no error", the second's
    relative error against ``ref()``)."""
    try:
        call(bad if world.rank == 1 else out)
        first = "no error"
    except Exception as e:
        first = type(e).__name__
    out.fill_(float("nan"))
    call(out)
    return first, rel_err(out, ref())


def test_auto_picks_it_where_it_runs(world2):
    for rank, found in enumerate(world2.run(_auto, timeout=540)):
        assert found["rs candidates"] == po.MatmulReduceScatter.TRANSPORTS
        assert found["ag candidates"] == po.AllGatherMatmul.TRANSPORTS
        assert found["rs pick"] == "torch_fused" and found["rs err"] < 1e-5
        assert found["rs timed"] == sorted(po.MatmulReduceScatter.TRANSPORTS)
        assert found["rs with config"] in ("signal_collective", "signal_copy_engine")
        assert found["ag pick"] == "torch_fused" and found["ag err"] < 1e-5
        assert found["ag with schedule"] == "copy_engine"
        assert found["ag bad out"] == ("ValueError" if rank == 1 else "RankMismatchError")
        assert found["ag after"] < 1e-5


# -- GEMV + AllReduce on "torch_fused", with the CPU stand-ins of _TorchOnCpu ---------------------
def _gemv_inputs(world, M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(100 * seed + world.rank)
    return torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


def _gemv(world):
    """``"torch_fused"`` and ``"sequential"`` on the same calls: their results (bit for bit:
    both multiply in the input dtype and reduce with the process group here), which calls reached
    torch's one-shot op and how (its input a view at offset 0 of the rendezvoused buffer, the
    length rounded to 16 bytes, straight into ``out`` or through the staging buffer), the
    checks-only mode, and the errors of bad calls."""
    from portable_overlap.ops.torch_fused import TorchFusedGemv

    on_cpu = _TorchOnCpu()
    found = {"results": []}
    try:
        tf = po.GemvAllReduce(world, 40, transport="torch_fused")
        seq = po.GemvAllReduce(world, 40, transport="sequential")
        try:
            impl = tf.impl
            found["impl"] = type(impl) is TorchFusedGemv
            found["rendezvous"] = [(n, g == impl.group_name) for _, n, g in on_cpu.rendezvous]
            base = on_cpu.rendezvous[0][0]
            for seed, (M, N, K, dtype, how) in enumerate([
                    (2, 8, 5, torch.float32, "out"),  # 16 floats: straight into out
                    (1, 40, 3, torch.bfloat16, "out"),  # 40 bf16: 80 bytes, straight
                    (3, 7, 4, torch.float32, "out"),  # 21 floats: rounded to 24, staged
                    (1, 5, 6, torch.bfloat16, "none"),  # rounded to 8, a new tensor
                    (2, 8, 3, torch.float32, "offset"),  # out not 16-byte aligned: staged
                    (33, 3, 2, torch.float16, "out"),  # fp16: the process group's all_reduce
            ]):
                x, w = _gemv_inputs(world, M, N, K, dtype, seed)
                calls = len(on_cpu.one_shots)
                if how == "none":
                    y = po.gemv_all_reduce(x, w, tf)
                else:
                    room = torch.full((M * N + 1,), float("nan"), dtype=dtype)
                    out = room[1:].view(M, N) if how == "offset" else room[:M * N].view(M, N)
                    y = po.gemv_all_reduce(x, w, tf, out)
                    assert y is out
                ref = po.gemv_all_reduce(x, w, seq)
                shots = on_cpu.one_shots[calls:]
                found["results"].append((
                    (M, N, K, str(dtype), how), torch.equal(y, ref), tuple(y.shape),
                    y.is_contiguous(),
                    [(n, p == base, off, p_out == y.data_ptr()) for n, p, off, p_out in shots]))
            # checks only (what "auto" runs before an agreement): nothing launched
            x, w = _gemv_inputs(world, 2, 8, 5, torch.float32, 9)
            out = torch.full((2, 8), float("nan"))
            calls = len(on_cpu.one_shots)
            impl.checking_only = True
            try:
                found["check only"] = (impl(x, w, out) is out, bool(out.isnan().all()),
                                       impl(x, w) is None, len(on_cpu.one_shots) == calls)
            finally:
                impl.checking_only = False
            bad = {
                "w dtype": lambda c: po.gemv_all_reduce(x, w.double(), c),
                "N > max_n": lambda c: po.gemv_all_reduce(x, torch.randn(41, 5), c),
                "M > 64": lambda c: po.gemv_all_reduce(torch.randn(65, 5), w, c),
                "K differs": lambda c: po.gemv_all_reduce(x, torch.randn(8, 4), c),
                "out shape": lambda c: po.gemv_all_reduce(x, w, c, torch.empty(2, 7)),
                "out is x": lambda c: po.gemv_all_reduce(x, torch.randn(5, 5), c, x),
                "config": lambda c: po.gemv_all_reduce(x, w, c, config=po.GemvConfig()),
            }
            for label, call in bad.items():
                for name, ctx in (("torch_fused", tf), ("sequential", seq)):
                    try:
                        call(ctx)
                        found[(label, name)] = None
                    except Exception as e:  # noqa: BLE001  (the kind is the finding)
                        found[(label, name)] = (type(e).__name__, str(e))
            found["after"] = torch.equal(po.gemv_all_reduce(x, w, tf), po.gemv_all_reduce(x, w,
                                                                                          seq))
        finally:
            tf.close()
            seq.close()
        return found
    finally:
        on_cpu.close()


def test_gemv_matches_sequential(world2):
    for found in world2.run(_gemv):
        assert found["impl"] and found["rendezvous"] == [(64 * 40 * 4, True)]
        want = {  # (length, from the buffer, offset 0, straight into the result) per one-shot
            (2, 8, 5, "torch.float32", "out"): [(16, True, 0, True)],
            (1, 40, 3, "torch.bfloat16", "out"): [(40, True, 0, True)],
            (3, 7, 4, "torch.float32", "out"): [(24, True, 0, False)],
            (1, 5, 6, "torch.bfloat16", "none"): [(8, True, 0, True)],
            (2, 8, 3, "torch.float32", "offset"): [(16, True, 0, False)],
            (33, 3, 2, "torch.float16", "out"): [],
        }
        assert len(found["results"]) == len(want)
        for case, same, shape, contiguous, shots in found["results"]:
            assert same and shape == case[:2] and contiguous, case
            assert shots == want[case], (case, shots)
        assert found["check only"] == (True, True, True, True)
        for label in ("w dtype", "N > max_n", "M > 64", "K differs", "out shape", "out is x",
                      "config"):
            got, ref = found[(label, "torch_fused")], found[(label, "sequential")]
            assert got is not None and got[0] == ref[0], (label, got, ref)
            assert got[1].startswith("gemv_all_reduce: "), got
            if label == "config":  # each names its own transport
                assert "'torch_fused' transport takes no options" in got[1], got
            else:
                assert got[1] == ref[1], (label, got, ref)
        assert found["after"]


def _gemv_auto(world):
    """``"auto"`` with torch_fused a candidate (steered to it), a per-call ``config`` keeping the
    call off it, and an ``out`` one rank's input checks refuse on a key decided for it: every
    rank raises in that call (torch's barriers would wait for ever), and the next is right."""
    on_cpu = _TorchOnCpu()
    found = {}
    try:
        ctx = po.GemvAllReduce(world, 16, transport="auto", iters=1, warmup=0,
                               candidates=("torch_fused", "sequential"))
        fake = _Steered(ctx)
        try:
            found["candidates"] = ctx.planner.candidates
            x, w = _gemv_inputs(world, 3, 16, 5, torch.float32, 1)
            ref = po.gemv_all_reduce_reference(x, w, world.group)
            out = torch.full((3, 16), float("nan"))
            with fake:
                po.gemv_all_reduce(x, w, ctx, out)
            found["pick"] = ctx.choice(x, w)
            found["err"] = rel_err(out, ref)
            found["timed"] = sorted(set(fake.ran))
            found["bad out"], found["after"] = _bad_out_then_right(
                world, lambda o: po.gemv_all_reduce(x, w, ctx, o), out, torch.empty(1, 16),
                lambda: ref)
        finally:
            ctx.close()
        return found
    finally:
        on_cpu.close()


def test_gemv_auto_picks_it_where_it_runs(world2):
    for rank, found in enumerate(world2.run(_gemv_auto, timeout=300)):
        assert found["candidates"] == ("torch_fused", "sequential")
        assert found["pick"] == "torch_fused" and found["err"] < 1e-5, found
        assert found["timed"] == ["sequential", "torch_fused"]
        assert found["bad out"] == ("ValueError" if rank == 1 else "RankMismatchError"), found
        assert found["after"] < 1e-5
