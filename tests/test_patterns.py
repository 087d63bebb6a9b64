"""The public API: one op per communication pattern, each with its context and transports, all
generated from the op table (ops/registry.py). Every transport of the three multi-transport
patterns against the torch reference (with bias and residual), through the Python function, the
torch.library op and its fake implementation, on 2 and 4 emulated ranks; the table itself
(every op exported, defined once); and the errors a user meets first."""
import os
import re

import pytest
import torch

import portable_overlap as po
from portable_overlap.ops.registry import SPECS
from portable_overlap.testing.patterns import GEMM_PATTERNS as PATTERNS, pattern_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_op_table_is_the_public_api():
    assert set(po.OPS) == set(SPECS) == {
        "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_to_all",
        "gemv_all_reduce", "embedding_all_to_all", "moe_dispatch", "moe_gemm_combine"}
    for name, spec in SPECS.items():
        assert callable(getattr(po, name)) and name in po.__all__
        assert getattr(po, spec.context.__name__) is spec.context
        assert spec.context.__name__ in po.__all__ and f"{name}_reference" in po.__all__
        schema = str(spec.op.default._schema)
        assert schema.startswith(f"portable_overlap::{name}(") and "int handle" in schema
        assert spec.transports, name
        for module in spec.compile_specs:  # the compile matrix reaches the op's kernels
            assert __import__(module, fromlist=["specs"]).specs
    assert not [n for n in po.__all__ if not hasattr(po, n)]


def test_library_registration_in_one_place():
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "portable_overlap")):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                for word in ("register_fake", "custom_op(", "register_autograd("):
                    if word in text:
                        found.setdefault(word, set()).add(f)
    assert found == {"register_fake": {"registry.py"}, "register_autograd(": {"registry.py"}}, \
        found


def test_wrong_context_is_a_clear_error():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(TypeError, match=r"matmul_all_reduce: ctx must be a MatmulAllReduce"):
        po.matmul_all_reduce(a, b, object())
    with pytest.raises(TypeError, match=r"gemv_all_reduce: ctx must be a GemvAllReduce"):
        po.gemv_all_reduce(a, b, "ctx")


def test_no_silent_loss_of_gradients():
    """An op without a backward refuses inputs that require grad (its result would carry none),
    before it looks at its context."""
    class _Ctx(po.MatmulAllReduce):
        def __init__(self):  # no workspace: the refusal comes first
            pass

    a, b = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="matmul_all_reduce has no backward"):
        po.matmul_all_reduce(a, b, _Ctx())


def _patterns(world, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    W, r = world.world_size, world.rank
    M, N, K = 4 * W, 12, 8  # (uneven K shards: the transports' own tests)
    results = []
    for name, (make, ref_fn, rows) in PATTERNS.items():
        fn, op = getattr(po, name), getattr(torch.ops.portable_overlap, name)
        for transport in make.available(world):  # torch_fused: GPUs only (test_torch_fused.py)
            g = torch.Generator().manual_seed(10 * r + len(results))
            a, b, bias, res = pattern_inputs(g, M, N, K, rows(M, W), dtype)
            ctx = make(world, M, N, transport=transport, timeout_s=30.0)
            try:
                out = torch.full((rows(M, W), N), float("nan"), dtype=dtype)
                fn(a, b, ctx, out, bias=bias, residual=res)
                via_op = op(a, b, ctx.handle, bias, None)
                ctx.synchronize()
                ref = ref_fn(a, b, world.group, bias, res).double()
                ref_op = ref_fn(a, b, world.group, bias, None).double()
                with FakeTensorMode() as mode:
                    fake = op(mode.from_tensor(a), mode.from_tensor(b), ctx.handle)
                results.append((name, transport,
                                ((out.double() - ref).norm() / ref.norm()).item(),
                                ((via_op.double() - ref_op).norm() / ref_op.norm()).item(),
                                tuple(fake.shape) == tuple(out.shape), repr(ctx)))
            finally:
                ctx.close()
    return results, sum(len(make.available(world)) for make, _, _ in PATTERNS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_transport_of_every_pattern(world, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for results, available in world.run(_patterns, dtype):
        assert len(results) == available >= sum(len(m.TRANSPORTS) - 1 for m, _, _ in
                                                PATTERNS.values())
        for name, transport, err, err_op, fake_ok, text in results:
            assert err < tol and err_op < tol, (name, transport, err, err_op)
            assert fake_ok and f"transport={transport!r}" in text, (name, transport, text)


def _oversized(world):
    """A result with more rows than ``max_m`` but fewer elements than ``max_m * max_n``: every
    transport refuses it alike (some size their buffers by element count), on every rank
    (rank 1 alone in the second call, where the waits are bounded), and the next call works."""
    W, r = world.world_size, world.rank
    max_m, max_n, K = 4 * W, 12, 8
    found = []
    for name, (make, ref_fn, rows) in PATTERNS.items():
        fn = getattr(po, name)
        for transport in make.available(world):
            ctx = make(world, max_m, max_n, transport=transport, timeout_s=60.0)
            g = torch.Generator().manual_seed(5 + r)
            try:
                big = pattern_inputs(g, 2 * max_m, max_n // 2, K, rows(2 * max_m, W),
                                     torch.float32)
                fine = pattern_inputs(g, max_m, max_n, K, rows(max_m, W), torch.float32)
                got = []
                # one rank alone only where the waits are bounded: a collective library's
                # peer of a refusing rank waits until the group's timeout
                alone = transport in ("stores", "copy_engine")
                for x in (big, big if r == 1 or not alone else fine):
                    try:
                        fn(x[0], x[1], ctx)
                        ctx.synchronize()
                        got.append(("no error", ""))
                    except Exception as e:
                        got.append((type(e).__name__, str(e)))
                ref = ref_fn(fine[0], fine[1], world.group, None, None).double()
                out = fn(fine[0], fine[1], ctx).double()
                found.append((name, transport, got, ((out - ref).norm() / ref.norm()).item()))
            finally:
                ctx.close()
    return found


def test_a_result_past_max_m_or_max_n_is_refused_by_every_transport(world2):
    mine, peer = world2.run(_oversized, timeout=400)
    assert mine and len(mine) == len(peer)
    for (name, transport, got, err), (_, _, got1, err1) in zip(mine, peer):
        for g in (got[0], got1[0], got1[1]):
            assert g[0] == "ValueError" and "exceeds this context's max_m x max_n" in g[1], \
                (name, transport, got, got1)
        if transport in ("stores", "copy_engine"):  # rank 0's valid call fails at once
            assert got[1][0] == "PeerTimeoutError" and "gave up" in got[1][1], \
                (name, transport, got)
        assert err < 1e-5 and err1 < 1e-5, (name, transport, err, err1)


def _bad_contexts(world):
    msgs = []
    for make in (lambda: po.MatmulAllReduce(world, 8, 8, transport="nccl"),
                 lambda: po.MatmulAllReduce(world, 0, 8),
                 lambda: po.MatmulAllToAll(world, 8, 8, transport="signal_copy_engine"),
                 lambda: po.MatmulReduceScatter(world, 8, 8, transport="copy_engine", pieces=0),
                 lambda: po.GemvAllReduce(world, 8, transport="copy_engine"),
                 lambda: po.AllGatherMatmul(world, 8, transport="shmem"),
                 lambda: po.MatmulReduceScatter(world, 8, 8, pieces=4)):
        try:
            make().close()
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
    return msgs


def test_bad_transport_and_sizes(world2):
    for msgs in world2.run(_bad_contexts):
        assert all(msgs), msgs
        assert re.search(r"transport must be one of \('copy_engine', 'stores', "
                         r"'signal_collective', 'sequential'\)", msgs[0]), msgs[0]
        assert "max_m" in msgs[1] and "signal_copy_engine" in msgs[2] and "pieces" in msgs[3]
        assert "gemv_all_reduce: transport" in msgs[4]
        assert "all_gather_matmul: transport" in msgs[5]
        assert "pieces is an option of a named transport: name it" in msgs[6], msgs[6]


def _defaults(world):
    made = []
    for make in (lambda: po.MatmulAllReduce(world, 8, 8), lambda: po.GemvAllReduce(world, 8),
                 lambda: po.AllGatherMatmul(world, 8, candidates=("sequential",))):
        ctx = make()
        made.append(ctx.transport)
        ctx.close()
    return made


def test_default_transport(world2):
    """No ``transport=``: the first transport on emulated ranks, ``"auto"`` where one of its
    options is given; ``"auto"`` on a GPU world (the rule itself, with a stand-in world)."""
    for made in world2.run(_defaults):
        assert made == ["copy_engine", "stores", "auto"], made
    gpu = type("GpuWorld", (), {"backend": type("Backend", (), {"name": "cuda"})})()
    patterns = [s.context for s in SPECS.values() if hasattr(s.context, "default_transport")]
    assert len(patterns) == 8, patterns
    for context in patterns:
        assert context.default_transport(gpu) == "auto", context
        assert context.default_transport(gpu, {"graph": True}) == "auto"
        with pytest.raises(ValueError, match="config is an option of a named transport"):
            context.default_transport(gpu, {"config": None})


def _own_k(world, name):
    """Two calls of op ``name`` per transport (every one that can run here, and ``"auto"``),
    each rank with a K of its own, bias and residual given: relative errors against the
    reference (NaN-poisoned outputs), or the error's type; and any candidate ``"auto"`` left
    out of a decision because it raised."""
    from portable_overlap.testing.compare import rel_err

    make, ref_fn, rows = PATTERNS[name]
    W, r = world.world_size, world.rank
    M, N = 4 * W, 12
    found = {}
    for transport in make.available(world) + ("auto",):
        ctx = make(world, M, N, transport=transport, timeout_s=30.0)
        got = []
        try:
            for i, K in enumerate((8 + 5 * r, 11 - 4 * r)):
                g = torch.Generator().manual_seed(10 * i + r)
                a, b, bias, res = pattern_inputs(g, M, N, K, rows(M, W), torch.float32)
                out = torch.full((rows(M, W), N), float("nan"))
                try:
                    getattr(po, name)(a, b, ctx, out, bias=bias, residual=res)
                    ctx.synchronize()
                    got.append(rel_err(out, ref_fn(a, b, world.group, bias, res)))
                except po.PortableOverlapError as e:
                    got.append(type(e).__name__)
            got += [d["failed"] for d in ctx.decisions.values() if d.get("failed")]
        finally:
            ctx.close()
        found[transport] = got
    return found


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_each_rank_may_have_its_own_k(world2, name):
    """The GEMM patterns' K is local to each rank's product (a reduction's K shard, or the
    All-to-All's own GEMM; only [M, N] results move): every transport and ``"auto"`` accept
    ranks whose K differs, so switching the transport changes only the speed."""
    for found in world2.run(_own_k, name, timeout=400):
        assert set(found) >= {"sequential", "stores", "copy_engine", "auto"}, found
        for transport, got in found.items():
            assert len(got) == 2 and all(isinstance(e, float) and e < 1e-5 for e in got), \
                (name, transport, got)
