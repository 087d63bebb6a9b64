"""``torch.inference_mode()`` around a context's construction or a shape's first call: what a
serving process does (it builds its model, or captures its graphs, under that mode). Tensors
made in the mode are inference tensors, which torch refuses to update in place outside it, so
a context must never keep one: every later call made outside the mode (a training step, a
``no_grad`` evaluation) would raise, and where the kept tensor grew on one rank only, that rank
raised alone while its peers waited."""
import pytest
import torch

import portable_overlap as po
from portable_overlap.kept import GrowingBuffer, kept_empty, kept_zeros
from portable_overlap.ops.moe_combine import MoeGemmCombine, moe_gemm_combine
from portable_overlap.ops.moe_dispatch import MoeDispatch, moe_dispatch


def test_kept_tensors_made_under_inference_mode_are_normal_tensors():
    grow = GrowingBuffer("cpu", torch.float32, zero=True)
    with torch.inference_mode():
        made = [kept_empty(5, torch.int64, "cpu"), kept_zeros((2, 3), torch.float32, "cpu"),
                grow.get(4)]
    assert [t.is_inference() for t in made] == [False, False, False]
    for t in made:  # outside the mode, in place, as the ops' host code writes them
        t.add_(1)


def _gemm_calls(world, ctx_of, op, shapes, seed):
    """``op``'s outputs for two calls (fresh random inputs) on a context ``ctx_of()`` made under
    inference mode and on one made outside it; the calls outside the mode, with autograd on."""
    g = torch.Generator().manual_seed(seed + world.rank)
    inputs = [[torch.randn(*s, generator=g) for s in shapes] for _ in range(2)]
    with torch.inference_mode():
        made_in = ctx_of()
    made_out = ctx_of()
    try:
        got = [op(*xs, made_in) for xs in inputs]
        want = [op(*xs, made_out) for xs in inputs]
    finally:
        made_in.close()
        made_out.close()
    return [bool(torch.equal(a, b)) and not a.is_inference() for a, b in zip(got, want)]


def _gemm_contexts_made_in_inference_mode(world):
    out = {}
    for transport in ("copy_engine", "signal_collective", "stores", "sequential"):
        out[f"matmul_reduce_scatter[{transport}]"] = _gemm_calls(
            world, lambda: po.MatmulReduceScatter(world, 16, 8, transport=transport),
            po.matmul_reduce_scatter, [(16, 12), (12, 8)], 1)
        out[f"matmul_all_reduce[{transport}]"] = _gemm_calls(
            world, lambda: po.MatmulAllReduce(world, 16, 8, transport=transport),
            po.matmul_all_reduce, [(16, 12), (12, 8)], 2)
    for transport in ("copy_engine", "stores"):
        out[f"all_gather_matmul[{transport}]"] = _gemm_calls(
            world, lambda: po.AllGatherMatmul(world, 8 * 16, transport=transport),
            po.all_gather_matmul, [(8, 16), (16, 8)], 3)
    return out


def test_gemm_contexts_made_under_inference_mode_serve_calls_outside_it(world2):
    """The copy-engine and host-collective transports keep buffers that the host writes in
    place at each call: made under inference mode, every call outside it raised (and
    ``signal_collective``'s peer timed out in the collective)."""
    for got in world2.run(_gemm_contexts_made_in_inference_mode):
        assert got == {k: [True, True] for k in got}, got


def _moe_calls(world, transport, in_mode):
    """Two dispatch + combine calls outside inference mode on contexts made in it (or not)."""
    W, r = world.world_size, world.rank
    S, H, E, k = 6, 16, 2, 2
    mode = torch.inference_mode() if in_mode else torch.no_grad()
    with mode:
        d = MoeDispatch(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=E,
                        dtype=torch.float32, transport=transport)
        c = MoeGemmCombine(world, max_tokens=S, top_k=k, hidden=H, experts_per_rank=E,
                           transport=transport)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(E, H, H, generator=g)
    outs = []
    try:
        for call in range(2):
            g = torch.Generator().manual_seed(10 * call + r)
            ids = torch.stack([torch.randperm(W * E, generator=g)[:k] for _ in range(S)])
            x, counts, slots = moe_dispatch(torch.randn(S, H, generator=g), ids, d)
            outs.append(moe_gemm_combine(x.clone(), w, counts.clone(), slots.clone(),
                                         torch.rand(S, k, generator=g), c))
    finally:
        d.close()
        c.close()
    return outs


def _moe_contexts_made_in_inference_mode(world):
    out = {}
    for transport in ("sequential", "stores"):
        got, want = _moe_calls(world, transport, True), _moe_calls(world, transport, False)
        out[transport] = [bool(torch.equal(a, b)) for a, b in zip(got, want)]
    return out


def test_moe_contexts_made_under_inference_mode_serve_calls_outside_it(world2):
    for got in world2.run(_moe_contexts_made_in_inference_mode):
        assert got == {"sequential": [True, True], "stores": [True, True]}, got


def _embedding_first_call_in_inference_mode(world, transport, table_ranks):
    """A layer whose first call of a batch size (which makes its bag offsets' buffer) runs
    under inference mode, then training, ``no_grad`` and inference calls, each against the
    reference path's layer (same seed) on the same inputs; then the weight gradients."""
    rows, D = [10, 7, 12, 5], 8
    layers = [po.ShardedEmbeddingBagCollection(world, rows, D, max_local_batch=32,
                                               table_ranks=table_ranks, fused=fused,
                                               transport=transport, timeout_s=10.0)
              for fused in (True, False)]
    local = layers[0].local_tables
    out = []
    try:
        for step, (B, mode) in enumerate([(8, "inference"), (8, "train"), (17, "inference"),
                                          (17, "train"), (17, "no_grad"), (8, "train")]):
            g = torch.Generator().manual_seed(100 * step)  # the global batch: every rank alike
            lengths = torch.randint(1, 4, (len(rows) * B,), generator=g)
            idx = [torch.randint(0, rows[t], (int(lengths[t * B:(t + 1) * B].sum()),),
                                 generator=g) for t in range(len(rows))]
            lengths = torch.cat([lengths[t * B:(t + 1) * B] for t in local])
            idx = torch.cat([idx[t] for t in local])
            splits = [B - B // 2, B // 2]
            ys = []
            for layer in layers:
                if mode == "train":
                    y = layer(lengths, idx, batch_splits=splits)
                    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
                    y = y.detach()
                else:
                    with torch.inference_mode() if mode == "inference" else torch.no_grad():
                        y = layer(lengths, idx, batch_splits=splits)
                ys.append(y.clone())
            out.append((B, mode, float((ys[0] - ys[1]).abs().max())))
        grad = float((layers[0].weight.grad - layers[1].weight.grad).abs().max())
    finally:
        for layer in layers:
            layer.close()
    return out, grad


@pytest.mark.parametrize("transport", ["stores", "sequential"])
@pytest.mark.parametrize("table_ranks", [[0, 1, 0, 1], [0, 0, 0, 1]], ids=["even", "uneven"])
def test_embedding_first_call_under_inference_mode_then_training(world2, transport,
                                                                 table_ranks):
    """The bag offsets' buffer made in an inference call made every later call outside the
    mode raise; with uneven tables it grows on one rank only, which then raised alone (its
    peer: ``PeerTimeoutError``; named ``"sequential"``: gloo aborted the process)."""
    for calls, grad in world2.run(_embedding_first_call_in_inference_mode, transport,
                                  table_ranks):
        assert [c[:2] for c in calls] == [(8, "inference"), (8, "train"), (17, "inference"),
                                          (17, "train"), (17, "no_grad"), (8, "train")]
        assert max(c[2] for c in calls) < 1e-5, calls
        assert grad < 1e-5, grad
