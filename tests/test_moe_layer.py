"""The experts' gated grouped GEMM (expert_swiglu) and the whole expert-parallel MoE layer on
CPU-emulated ranks: the fused layer (dispatch, gated GEMMs, GEMM + combine, no host sync)
against the torch path with the same weights."""
import pytest
import torch

from portable_overlap.ops.matmul import MatmulConfig
from portable_overlap.ops.moe_experts import expert_swiglu, expert_swiglu_reference

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _swiglu(world, dtype, gather):
    """Odd H and I (edge tiles), empty segments, more rows in x than the counts name (their
    outputs stay poisoned), a non-contiguous x, a single-segment layout; row tiles per source
    or gathered over the sources (tiles mixing sources, a source with none of an expert's
    rows)."""
    errs = []
    for seed, (W, E, H, I, extra) in enumerate(((2, 3, 24, 20, 5), (1, 1, 17, 33, 0),
                                                (4, 2, 16, 16, 9))):
        g = torch.Generator().manual_seed(10 * seed + world.rank)
        counts = torch.randint(0, 9, (W, E), generator=g, dtype=torch.int32)
        counts.view(-1)[0] = 0
        R = int(counts.sum())
        x = torch.randn(R + extra, 2 * H, generator=g)[:, ::2].to(dtype)  # row stride 2H
        wg = (torch.randn(E, H, I, generator=g) / H ** 0.5).to(dtype)
        wu = (torch.randn(E, H, I, generator=g) / H ** 0.5).to(dtype)
        out = torch.full((R + extra, I), float("nan"), dtype=dtype)
        expert_swiglu(x, wg, wu, counts, out, config=SMALL if seed else None, gather=gather)
        ref = expert_swiglu_reference(x, wg, wu, counts)
        assert torch.isnan(out[R:]).all(), "rows past counts.sum() were written"
        errs.append(((out[:R].double() - ref.double()).norm()
                     / ref.double().norm().clamp_min(1e-30)).item() if R else 0.0)
    return errs


@pytest.mark.parametrize("gather", [False, True], ids=["per_source", "gathered"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_expert_swiglu_matches_reference(world2, dtype, gather):
    for errs in world2.run(_swiglu, dtype, gather):
        assert all(e < TOL[dtype] for e in errs), errs


def _swiglu_bad(world):
    x, w, c = torch.randn(6, 8), torch.randn(2, 8, 4), torch.tensor([[3, 3]], dtype=torch.int32)
    msgs = []
    for args, kw in [((x.double(), w, w, c), {}), ((x, w, w[:1], c), {}),
                     ((x, w, w, c.long()), {}), ((x, w, w, c[:, :1]), {}),
                     ((x[:, :4], w, w, c), {}), ((x, w, w, c), {"rows_per_segment": -1}),
                     ((x, w, w, c), {"rows_per_segment": float("nan")})]:
        try:
            expert_swiglu(*args, **kw)
            msgs.append(None)
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    return msgs


def test_expert_swiglu_bad_input(world2):
    for msgs in world2.run(_swiglu_bad):
        assert all(m and m.startswith("expert_swiglu") for m in msgs), msgs


def _layer(world, capacity):
    """The fused layer against the torch path (same weights), four calls with different token
    counts per rank (one rank with none in a call); outputs poisoned by fresh tensors."""
    from portable_overlap import ExpertParallelMoE

    H, I, E, k = 24, 20, 2 * world.world_size, 3
    fused = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32,
                              capacity=capacity)
    ref = ExpertParallelMoE(world, H, I, E, k, max_tokens=9, dtype=torch.float32, fused=False)
    errs = []
    try:
        with torch.no_grad():
            for call in range(4):
                g = torch.Generator().manual_seed(7 * call + world.rank)
                S = (3 + 2 * call + world.rank) % 10 if call != 2 or world.rank else 0
                tokens = torch.randn(S, H, generator=g)
                y = fused(tokens)
                fused.synchronize()
                y_ref = ref(tokens)
                errs.append(((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30)).item()
                            if S else float(y.numel()))
    finally:
        fused.close()
    return errs


@pytest.mark.parametrize("capacity", [None, 40], ids=["default_capacity", "capacity40"])
def test_fused_layer_matches_torch_path(world, capacity):
    for errs in world.run(_layer, capacity):
        assert all(e < 1e-5 for e in errs), errs


def _grads(world, fused, tokens_grad):
    """Backward of the layer (fused or torch forward) against autograd of the dense layer on
    all ranks' tokens and experts: gradients of the tokens, of this rank's experts and of the
    router (summed over the ranks). Token counts differ per rank, one rank has none in the
    second call, and the tokens take no gradient when ``tokens_grad`` is False."""
    from portable_overlap import ExpertParallelMoE
    from portable_overlap.modules.moe_backward import dense_layer_reference

    W, r = world.world_size, world.rank
    H, I, E, k = 12, 10, 2 * W, 2
    layer = ExpertParallelMoE(world, H, I, E, k, max_tokens=7, dtype=torch.float32,
                              fused=fused)
    errs = []
    try:
        for call in range(2):
            g = torch.Generator().manual_seed(31 * call + r)
            S = 0 if call == 1 and r == W - 1 else 3 + (r + call) % 5
            tokens = torch.randn(S, H, generator=g).requires_grad_(tokens_grad)
            dout = torch.randn(S, H, generator=g)
            for p in layer.parameters():
                p.grad = None
            y = layer(tokens)
            if fused:
                layer.synchronize()
            y.backward(dout)
            mine = {"tokens": tokens.detach(), "dout": dout,
                    "dtokens": tokens.grad if tokens_grad else None,
                    **{n: p.detach() for n, p in layer.named_parameters()},
                    **{"d" + n: p.grad for n, p in layer.named_parameters()}}
            every = world.all_gather_object(mine)
            T = torch.cat([m["tokens"] for m in every]).requires_grad_(tokens_grad)
            ws = [torch.cat([m[n] for m in every]).requires_grad_()
                  for n in ("w_gate", "w_up", "w_down")]
            router = mine["router"].clone().requires_grad_()
            out = dense_layer_reference(T, router, *ws, k)
            (out * torch.cat([m["dout"] for m in every])).sum().backward()
            lo = sum(m["tokens"].shape[0] for m in every[:r])
            El = E // W
            pairs = [(mine["d" + n], w.grad[r * El:(r + 1) * El])
                     for n, w in zip(("w_gate", "w_up", "w_down"), ws)]
            pairs.append((sum(m["drouter"] for m in every), router.grad))
            if tokens_grad and S:
                pairs.append((mine["dtokens"], T.grad[lo:lo + S]))
            assert (mine["dtokens"] is None) == (not tokens_grad)
            errs.append(max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                            for a, b in pairs))
    finally:
        layer.close()
    return errs


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch_path"])
def test_layer_backward_matches_dense_autograd(world, fused):
    for errs in world.run(_grads, fused, True):
        assert all(e < 1e-4 for e in errs), errs


def test_layer_backward_without_token_gradients(world2):
    for errs in world2.run(_grads, True, False):
        assert all(e < 1e-4 for e in errs), errs


def test_layer_on_eight_ranks(world8):
    """The fused layer against the torch path, and its backward against dense autograd, on 8
    ranks (16 experts, 2 per rank; a rank without tokens in a call)."""
    for errs in world8.run(_layer, None, timeout=900):
        assert all(e < 1e-5 for e in errs), errs
    for errs in world8.run(_grads, True, True, timeout=900):
        assert all(e < 1e-4 for e in errs), errs
