"""torch.compile over the ops on CPU-emulated ranks: the MoE layer's parts (``expert_swiglu``,
``moe_dispatch_swiglu``, ``moe_layer``) are torch.library ops with fake implementations, so the
whole ``ExpertParallelMoE`` forward compiles as one graph in each of its three schedules and
matches the torch path; an op called with an option a functional op cannot take (``out=``)
runs as a graph break, not traced into its launch."""
import pytest
import torch

from portable_overlap import ExpertParallelMoE, GemvAllReduce, gemv_all_reduce
from portable_overlap import gemv_all_reduce_reference
from portable_overlap.ops.moe_combine import MoeGemmCombine
from portable_overlap.ops.moe_dispatch import MoeDispatch
from portable_overlap.ops.moe_experts import expert_swiglu, expert_swiglu_reference
from portable_overlap.ops.registry import PARTS, SPECS
from portable_overlap.testing.routing import route


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _module(world, form):
    """The layer in schedule ``form`` compiled with fullgraph=True, two calls of different token
    counts, against the torch path with the same weights (fresh tokens per call)."""
    torch._dynamo.reset()
    H, I, E, k = 24, 20, 2 * world.world_size, 3
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32)
    if form:
        setattr(fused, form, True)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32, fused=False)
    layer = torch.compile(fused, fullgraph=True, backend="aot_eager")
    errs = []
    try:
        with torch.no_grad():
            for call, S in enumerate((7, 5 + world.rank)):
                g = torch.Generator().manual_seed(31 * call + world.rank)
                tokens = torch.randn(S, H, generator=g)
                y = layer(tokens)
                fused.synchronize()
                errs.append(_rel(y, ref(tokens)))
    finally:
        fused.close()
    return errs


@pytest.mark.parametrize("form", [None, "fuse_dispatch", "one_launch"],
                         ids=["staged", "fuse_dispatch", "one_launch"])
def test_moe_module_compiles_as_one_graph(world2, form):
    for errs in world2.run(_module, form):
        assert all(e < 1e-5 for e in errs), errs


def _module_token_counts(world, form):
    """The layer in schedule ``form`` compiled with ``dynamic=True``, fullgraph, called with
    four token counts: the graphs dynamo made, and each call's error against the torch path."""
    torch._dynamo.reset()
    H, I, E, k = 16, 12, 2 * world.world_size, 2
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32)
    if form:
        setattr(fused, form, True)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32, fused=False)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = torch.compile(fused, fullgraph=True, dynamic=True, backend=counting)
    errs = []
    try:
        with torch.no_grad():
            for S in (3, 5, 8, 6):
                tokens = torch.randn(S, H, generator=torch.Generator().manual_seed(S + world.rank))
                y = layer(tokens)
                fused.synchronize()
                errs.append(_rel(y, ref(tokens)))
    finally:
        fused.close()
    return len(graphs), errs


@pytest.mark.parametrize("form", [None, "fuse_dispatch", "one_launch"],
                         ids=["staged", "fuse_dispatch", "one_launch"])
def test_moe_module_compiles_once_for_every_token_count(world2, form):
    """The layer passed its tiles' estimate (a float of the token count) into the ops: traced,
    a constant guarded on the count, so one graph per count, and torch.compile's limit failed a
    fullgraph layer at the 9th count. One graph serves every count now."""
    for graphs, errs in world2.run(_module_token_counts, form):
        assert graphs == 1, graphs
        assert all(e < 1e-5 for e in errs), errs


def _parts_opcheck(world):
    """opcheck (schema, fake tensors) of the three parts, on one set of contexts; every rank
    makes the same calls, so the collective calls stay matched."""
    W, El, H, I, k, S = world.world_size, 2, 16, 12, 2, 5
    g = torch.Generator().manual_seed(5 + world.rank)
    d = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                    dtype=torch.float32)
    c = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=El,
                       timeout_s=d.timeout_s)
    tokens = torch.randn(S, H, generator=g)
    ids = route("balanced", S, El * W, k, W, g)
    weights = torch.softmax(torch.randn(S, k, generator=g), -1)
    wg, wu = (torch.randn(El, H, I, generator=g) / H ** 0.5 for _ in range(2))
    wd = torch.randn(El, I, H, generator=g) / I ** 0.5
    counts = torch.tensor([[3, 1]] * W, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), H, generator=g)
    ops = torch.ops.portable_overlap
    checks = {
        "expert_swiglu": (ops.expert_swiglu.default, (x, wg, wu, counts, 2.0)),
        "moe_dispatch_swiglu": (ops.moe_dispatch_swiglu.default,
                                (tokens, ids, wg, wu, d.handle, None, None)),
        "moe_layer": (ops.moe_layer.default,
                      (tokens, ids, weights, wg, wu, wd, d.handle, c.handle, None, None)),
    }
    out = {}
    try:
        for name, (op, args) in checks.items():
            out[name] = torch.library.opcheck(op, args,
                                              test_utils=("test_schema", "test_faketensor"))
        # and the op's result is the eager function's
        h = ops.expert_swiglu(x, wg, wu, counts)
        out["expert_swiglu_value"] = _rel(h, expert_swiglu_reference(x, wg, wu, counts))
    finally:
        d.close()
        c.close()
    return out


def test_parts_schema_and_fake(world2):
    assert set(PARTS) == {"expert_swiglu", "moe_dispatch_swiglu", "moe_layer",
                          "embedding_all_to_all_backward"}
    assert not set(PARTS) & set(SPECS)
    for out in world2.run(_parts_opcheck):
        assert out.pop("expert_swiglu_value") < 1e-5
        for name, res in out.items():
            assert all(v == "SUCCESS" for v in res.values()), (name, res)


def _out_option(world):
    """``out=`` under torch.compile: the call leaves the graph (torch.compiler.disable) and
    writes ``out``; before, dynamo traced into the launch and failed."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(world.rank)
    x, w = torch.randn(2, 64, generator=g), torch.randn(48, 64, generator=g)
    ctx = GemvAllReduce(world, max_n=48)
    buf = torch.full((2, 48), float("nan"))
    try:
        y = torch.compile(lambda a: gemv_all_reduce(a, w, ctx, out=buf) + 1,
                          backend="aot_eager")(x)
        ref = gemv_all_reduce_reference(x, w, world.group)
        errs = [_rel(y, ref + 1), _rel(buf, ref)]
    finally:
        ctx.close()
    E, H, I = 2, 16, 8
    xs = torch.randn(10, H, generator=g)
    wg, wu = torch.randn(E, H, I, generator=g), torch.randn(E, H, I, generator=g)
    counts = torch.tensor([[3, 2], [4, 1]], dtype=torch.int32)
    out = torch.full((10, I), float("nan"))
    torch._dynamo.reset()
    h = torch.compile(lambda a: expert_swiglu(a, wg, wu, counts, out=out) * 2,
                      backend="aot_eager")(xs)
    ref = expert_swiglu_reference(xs, wg, wu, counts)
    return errs + [_rel(h, 2 * ref), _rel(out, ref)]


def test_out_option_is_a_graph_break(world2):
    for errs in world2.run(_out_option):
        assert all(e < 1e-5 for e in errs), errs


def test_parts_refuse_grad():
    """A part has no backward: called where autograd would record it, it raises."""
    x = torch.randn(4, 8, requires_grad=True)
    wg = wu = torch.randn(1, 8, 4)
    with pytest.raises(RuntimeError, match="expert_swiglu has no backward"):
        expert_swiglu(x, wg, wu, torch.tensor([[4]], dtype=torch.int32))


def test_raw_parts_refuse_grad():
    """The raw torch op of a part (``torch.ops.portable_overlap.expert_swiglu``) gave a result
    that required grad and a backward that left the inputs without a gradient, where the
    Python function refused: it refuses too, eagerly and under torch.compile."""
    x = torch.randn(4, 8, requires_grad=True)
    wg, wu = torch.randn(1, 8, 4), torch.randn(1, 8, 4)
    counts = torch.tensor([[4]], dtype=torch.int32)
    op = torch.ops.portable_overlap.expert_swiglu
    with pytest.raises(RuntimeError, match="expert_swiglu has no backward"):
        op(x, wg, wu, counts)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="expert_swiglu has no backward"):
        torch.compile(lambda a: op(a, wg, wu, counts) * 2, backend="aot_eager")(x)


def _raw_op_with_grad_compiled(world):
    """The raw ``gemv_all_reduce`` op compiled over an input that requires grad: what the
    compiled call raised; then a call without grad, against the reference."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(world.rank)
    w = torch.randn(8, 16, generator=g)
    ctx = GemvAllReduce(world, max_n=16, transport="stores")
    try:
        x = torch.randn(2, 16, generator=g, requires_grad=True)
        f = torch.compile(lambda a: torch.ops.portable_overlap.gemv_all_reduce(a, w, ctx.handle)
                          * 2, backend="aot_eager")
        try:
            f(x).sum().backward()
            err = None if x.grad is None else "a gradient"
        except Exception as e:  # noqa: BLE001  (the test reads the message)
            err = str(e)
        world.barrier()
        with torch.no_grad():
            y = f(x)
        return err, _rel(y, 2 * gemv_all_reduce_reference(x.detach(), w, world.group))
    finally:
        ctx.close()


def test_raw_op_without_backward_refuses_grad_under_compile(world2):
    """Compiled, the raw op of an op without a backward ran its forward with grad mode off (the
    eager refusal never saw the input that requires grad): the result required grad and the
    backward gave the input no gradient, with a warning only. The compile raises now, on every
    rank, and the context goes on."""
    for err, rel in world2.run(_raw_op_with_grad_compiled):
        assert err is not None and "gemv_all_reduce has no backward" in err, err
        assert rel < 1e-5, rel


def _embedding_second_derivative(world):
    """A Hessian-vector product through ``embedding_all_to_all`` (loss 0.5 * sum(y**2)): what
    the second ``autograd.grad`` raised, and the first-order gradient taken with
    create_graph=True against the reference's."""
    from portable_overlap.ops.embedding_alltoall import (EmbeddingAllToAll, embedding_all_to_all,
                                                         embedding_all_to_all_reference)

    rows, D, splits = [7, 5, 9], 4, [2, 3]
    ctx = EmbeddingAllToAll(world, rows, D, max_local_batch=3, transport="stores")
    try:
        weight, lengths, idx = _lookups(ctx, splits, 40 + world.rank)
        weight = weight[:, :D].contiguous()
        firsts = []
        for ref in (False, True):
            w = weight.clone().requires_grad_()
            y = (embedding_all_to_all_reference(w, lengths, idx, None, ctx.plan, world.rank,
                                                splits, group=world.group) if ref else
                 embedding_all_to_all(w, lengths, idx, ctx, batch_splits=splits))
            g, = torch.autograd.grad(0.5 * (y * y).sum(), (w,), create_graph=not ref)
            firsts.append(g.detach())
            if not ref:
                try:
                    torch.autograd.grad(g.sum(), (w,))
                    err = None
                except RuntimeError as e:
                    err = str(e)
        return err, _rel(firsts[0], firsts[1])
    finally:
        ctx.close()


def test_embedding_second_derivative_raises(world2):
    """A double backward through the embedding op came out as zeros (its backward's op had no
    autograd formula; a warning only): it raises, and the first derivative taken with
    create_graph=True is still right."""
    for err, rel in world2.run(_embedding_second_derivative):
        assert err is not None and "embedding_all_to_all_backward is not differentiable" in err
        assert rel < 1e-5, rel


def _embedding_training_step(world, transport, weighted):
    """A training step of the sharded embedding through ``embedding_all_to_all`` compiled with
    fullgraph=True, per-index weights too, against the reference: (forward, weight gradient,
    per-index weights' gradient) relative errors."""
    from portable_overlap.ops.embedding_alltoall import (EmbeddingAllToAll, embedding_all_to_all,
                                                         embedding_all_to_all_reference)

    torch._dynamo.reset()
    rows, D, splits = [7, 5, 9, 4], 8, [3, 2]
    B = sum(splits)
    ctx = EmbeddingAllToAll(world, rows, D, max_local_batch=3, transport=transport)
    g = torch.Generator().manual_seed(21 + world.rank)
    lengths = torch.randint(0, 3, (ctx.n_loc * B,), generator=g)
    idx = torch.cat([torch.randint(0, rows[t], (int(lengths[j * B:(j + 1) * B].sum()),),
                                   generator=g) for j, t in enumerate(ctx.local_tables)])
    weight = torch.randn(ctx.weight_rows, D, generator=g)
    psw = torch.rand(idx.numel(), generator=g) + 0.5 if weighted else None
    dy = torch.randn(ctx.output_shape(splits), generator=g)
    grads = []
    try:
        for fn in (torch.compile(lambda w, p: embedding_all_to_all(w, lengths, idx, ctx, p,
                                                                   batch_splits=splits),
                                 fullgraph=True, backend="aot_eager"),
                   lambda w, p: embedding_all_to_all_reference(w, lengths, idx, p, ctx.plan,
                                                               world.rank, splits,
                                                               group=world.group)):
            w = weight.clone().requires_grad_()
            p = psw.clone().requires_grad_() if weighted else None
            y = fn(w, p)
            (y * dy).sum().backward()
            grads.append((y.detach(), w.grad, p.grad if weighted else None))
    finally:
        ctx.close()
    (y, gw, gp), (y_ref, gw_ref, gp_ref) = grads
    return _rel(y, y_ref), _rel(gw, gw_ref), _rel(gp, gp_ref) if weighted else 0.0


@pytest.mark.parametrize("transport", ["stores", "sequential"])
def test_embedding_backward_compiles(world2, transport):
    # the op's backward (the reverse All-to-All, the rows' gradients) traced inline with fake
    # tensors failed the compile ("Please convert all Tensors to FakeTensors"): it is an op
    for errs in world2.run(_embedding_training_step, transport, True):
        assert all(e < 1e-5 for e in errs), errs


def _embedding_batch_sizes(world, explicit):
    """``embedding_all_to_all`` compiled with ``dynamic=True`` and fullgraph, trained over four
    batch sizes (``explicit``: ``batch_splits`` passed, else the default even split): the graphs
    dynamo made, and each step's errors (output, weight gradient) against the reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from portable_overlap.ops.embedding_alltoall import (EmbeddingAllToAll, embedding_all_to_all,
                                                         embedding_all_to_all_reference)

    torch._dynamo.reset()
    W = world.world_size
    ctx = EmbeddingAllToAll(world, [7, 5, 3], 5, max_local_batch=5, transport="stores")
    count = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda w, ln, i, s: embedding_all_to_all(
        w, ln, i, ctx, batch_splits=s if explicit else None), backend=count, dynamic=True,
        fullgraph=True)
    errs = []
    try:
        for per in (2, 3, 5, 4):
            splits = [per] * W
            weight, lengths, idx = _lookups(ctx, splits, 10 * per + world.rank)
            grads = []
            for fn in (f, lambda w, ln, i, s: embedding_all_to_all_reference(
                    w, ln, i, None, ctx.plan, world.rank, s, group=world.group)):
                w = weight.clone().requires_grad_()
                # the weight's rows are the plan's, fixed: left dynamic, dynamo's duck sizing
                # tied them to the indices' count where the two happened to be equal
                torch._dynamo.mark_static(w, 0)
                y = fn(w, lengths, idx, splits)
                (y * torch.arange(y.numel()).view(y.shape).sin()).sum().backward()
                grads.append((y.detach(), w.grad))
            errs.append((_rel(grads[0][0], grads[1][0]), _rel(grads[0][1], grads[1][1])))
    finally:
        ctx.close()
    return count.frame_count, errs


@pytest.mark.parametrize("explicit", [False, True], ids=["even_split", "batch_splits"])
def test_embedding_compiles_once_for_every_batch_size(world2, explicit):
    """The batch split was fixed into the graph (``int()`` / ``operator.index`` of the traced
    counts; the default split's ``divmod`` refused a SymInt and left the graph): one graph per
    batch size, and torch.compile's limit failed a fullgraph step at the 9th. One graph serves
    every batch size now (the op's ``batch_splits`` are SymInts)."""
    for graphs, errs in world2.run(_embedding_batch_sizes, explicit):
        assert graphs == 1, graphs
        assert all(e < 1e-5 for pair in errs for e in pair), errs


def _lookups(ctx, splits, seed):
    """(weight, lengths, indices) of one call of the embedding context ``ctx`` (dimension 5),
    fresh random values from ``seed``: 1-2 rows per bag, ``splits`` samples per rank."""
    g = torch.Generator().manual_seed(seed)
    n = sum(splits)
    weight = torch.randn(ctx.weight_rows, 5, generator=g)
    lengths = torch.randint(1, 3, (ctx.n_loc * n,), generator=g)
    idx = [torch.randint(0, ctx.plan.table_rows[t], (int(lengths[j * n:(j + 1) * n].sum()),),
                         generator=g) for j, t in enumerate(ctx.local_tables)]
    return weight, lengths, torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)


def _embedding_refused_under_compile(world):
    """The public embedding_all_to_all compiled, its batch_splits refused on the last rank
    only (one entry too many), then a good call with fresh inputs: each call's error, and the
    second call's error against the torch reference."""
    import portable_overlap as po
    from portable_overlap.testing.language_calls import error_of_one_call

    W, r = world.world_size, world.rank
    torch._dynamo.reset()
    ctx = po.EmbeddingAllToAll(world, [7, 5, 3], 5, 3, transport="stores", timeout_s=20.0)
    f = torch.compile(lambda w, lengths, idx, s: po.embedding_all_to_all(
        w, lengths, idx, ctx, batch_splits=s), backend="aot_eager")
    splits = [1 + q % 2 for q in range(W)]

    def inputs(seed):
        return _lookups(ctx, splits, seed)

    try:
        bad = splits + [1] if r == W - 1 else splits
        first = error_of_one_call(lambda: (f(*inputs(r), bad), ctx.synchronize()))
        world.barrier()
        weight, lengths, idx = inputs(10 + r)
        y = f(weight, lengths, idx, splits)
        ctx.synchronize()
        ref = po.embedding_all_to_all_reference(weight, lengths, idx, None, ctx.plan, r, splits,
                                                "sum", world.group)
        return first, _rel(y, ref)
    finally:
        ctx.close()


def test_embedding_refused_on_one_rank_under_compile(world2):
    """A call of the compiled public op that its checks refuse runs the context outside the
    graph (as the eager call does): traced into by dynamo, the refusing rank died of a
    segfault. The refusing rank raises its ValueError, its peer hears it gave up, and the
    next call is right."""
    for r, (first, err) in enumerate(world2.run(_embedding_refused_under_compile)):
        if r == 1:
            assert first is not None and first[0] == "ValueError" and "batch_splits" in first[1]
        else:
            assert first is not None and "gave up" in first[1], first
        assert err < 1e-5, (r, err)


def _direct_calls(world, backend, fullgraph):
    """Contexts called directly (``ctx(a, b)``, not the op's function) in compiled functions:
    three calls each (new values, then a new shape), against the torch reference; the
    contexts are left usable (an eager call after them is right)."""
    import portable_overlap as po
    from portable_overlap.ops.gemm_signal import gemm_reduce_scatter_reference

    W, r = world.world_size, world.rank
    torch._dynamo.reset()
    rs = po.MatmulReduceScatter(world, 8 * W, 16, transport="stores", timeout_s=20.0)
    gemv = GemvAllReduce(world, max_n=32, transport="stores", timeout_s=20.0)
    emb = po.EmbeddingAllToAll(world, [7, 5, 3], 5, 3, transport="stores", timeout_s=20.0)
    splits = [1 + q % 2 for q in range(W)]

    def mats(seed, rows, cols, inner):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(rows, inner, generator=g), torch.randn(inner, cols, generator=g)

    def lookups(seed):
        return _lookups(emb, splits, seed)

    cases = [
        (lambda a, b: rs(a, b) * 2,
         lambda a, b: 2 * gemm_reduce_scatter_reference(a, b, world.group),
         [mats(1 + r, 2 * W, 8, 5), mats(11 + r, 2 * W, 8, 5), mats(21 + r, 4 * W, 6, 3)]),
        (lambda x, w: gemv(x, w) + 1,  # (x [M, K], w [N, K])
         lambda x, w: gemv_all_reduce_reference(x, w, world.group) + 1,
         [(a, b.T.contiguous()) for a, b in (mats(2 + r, 2, 8, 16), mats(12 + r, 2, 8, 16),
                                             mats(22 + r, 3, 12, 8))]),
        (lambda w, lengths, idx: emb(w, lengths, idx, batch_splits=splits) - 1,
         lambda w, lengths, idx: po.embedding_all_to_all_reference(
             w, lengths, idx, None, emb.plan, r, splits, "sum", world.group) - 1,
         [lookups(3 + r), lookups(13 + r), lookups(23 + r)]),
    ]
    errs = []
    try:
        with torch.no_grad():
            for fn, ref, calls in cases:
                compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph)
                for args in calls:
                    errs.append(_rel(compiled(*args), ref(*args)))
                errs.append(_rel(fn(*calls[0]), ref(*calls[0])))  # eager, after
    finally:
        for ctx in (rs, gemv, emb):
            ctx.close()
    return errs


@pytest.mark.parametrize("backend,fullgraph", [("eager", False), ("aot_eager", True)])
def test_context_called_directly_under_compile(world2, backend, fullgraph):
    """A context called directly in a compiled function runs its op (one opaque node, a
    whole graph with fullgraph=True). Traced into, its first call raised an InterpreterError
    (the launch on fake tensors) and left the context broken for good (fullgraph=False), or
    failed the compile at the call's lock (fullgraph=True)."""
    for errs in world2.run(_direct_calls, backend, fullgraph):
        assert len(errs) == 12 and all(e < 1e-5 for e in errs), errs


def _workspace_and_refusal(world):
    """Under torch.compile (aot_eager): a pattern's workspace called directly, then the op's
    function with an input that requires grad (refused), then a good call."""
    from portable_overlap.testing.language_calls import error_of_one_call

    torch._dynamo.reset()
    ctx = GemvAllReduce(world, max_n=32, transport="stores", timeout_s=20.0)
    g = torch.Generator().manual_seed(world.rank)
    x, w = torch.randn(2, 16, generator=g), torch.randn(8, 16, generator=g)
    try:
        y = torch.compile(lambda a, b: ctx.impl(a, b) * 2, backend="aot_eager")(x, w)
        errs = [_rel(y, 2 * gemv_all_reduce_reference(x, w, world.group))]
        f = torch.compile(lambda a, b: gemv_all_reduce(a, b, ctx) * 2, backend="aot_eager")
        refused = error_of_one_call(lambda: f(x.clone().requires_grad_(), w))
        with torch.no_grad():
            errs.append(_rel(f(x, w), 2 * gemv_all_reduce_reference(x, w, world.group)))
    finally:
        ctx.close()
    return refused, errs


def test_workspace_call_and_grad_refusal_under_compile(world2):
    """The workspace's call runs eagerly (a graph break), and the refusal of an input that
    requires grad raises its own error and leaves the context in step: traced, the refusal's
    flag kernels ran on fake tensors and both ranks died of a segfault."""
    for refused, errs in world2.run(_workspace_and_refusal):
        assert refused is not None and "has no backward" in refused[1], refused
        assert all(e < 1e-5 for e in errs), errs
