"""Tensor-parallel decode of Llama-style blocks with random weights, with and without the fused
GEMV + AllReduce in the two row-parallel projections (attention output and MLP down).

    torchrun --nproc-per-node 2 examples/transformer/decode.py            # GPUs, Llama-3-8B shapes
    python examples/transformer/decode.py                                 # no GPUs: emulated ranks

Each rank holds heads/world attention heads and intermediate/world MLP columns (Megatron layout):
QKV and gate/up are column-parallel (no communication), O and down are row-parallel and end in
an all-reduce of the [batch, hidden] activations, which is what the fused op replaces. The KV cache
is a fixed window of random keys/values, so every step has the same shapes (graph-friendly).
Prints per-token latency for both paths and checks that they agree.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from portable_overlap import RowParallelLinear
from portable_overlap.testing.compare import worst
from portable_overlap.cli import int_at_least
from tp_common import (LLAMA3_8B, TINY, check_dims_divide,  # examples/transformer/
                       launch, planned_on_cpu, planned_world_size, under_torchrun)


class Block(nn.Module):
    def __init__(self, world, dims, cache_len, batch, dtype, fused, ctxs=None):
        super().__init__()
        W = world.world_size
        h, kvh, d = dims["heads"] // W, dims["kv_heads"] // W, dims["head_dim"]
        self.h, self.kvh, self.d = h, kvh, d
        dev, hid = world.device, dims["hidden"]
        std = hid ** -0.5
        self.wqkv = nn.Parameter(torch.randn((h + 2 * kvh) * d, hid, device=dev, dtype=dtype) * std)
        self.w_gate_up = nn.Parameter(
            torch.randn(2 * dims["inter"] // W, hid, device=dev, dtype=dtype) * std)
        ctxs = ctxs or (None, None)
        self.wo = RowParallelLinear(dims["heads"] * d, hid, world, dtype=dtype, fused=fused,
                                    ctx=ctxs[0])
        self.down = RowParallelLinear(dims["inter"], hid, world, dtype=dtype, fused=fused,
                                      ctx=ctxs[1])
        self.k_cache = torch.randn(batch, kvh, cache_len, d, device=dev, dtype=dtype)
        self.v_cache = torch.randn(batch, kvh, cache_len, d, device=dev, dtype=dtype)

    def forward(self, x):  # x: [batch, hidden], identical on every rank
        B = x.shape[0]
        qkv = F.rms_norm(x, (x.shape[-1],)) @ self.wqkv.T
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        k_all = torch.cat([self.k_cache, k.view(B, self.kvh, 1, self.d)], dim=2)
        v_all = torch.cat([self.v_cache, v.view(B, self.kvh, 1, self.d)], dim=2)
        a = F.scaled_dot_product_attention(q.view(B, self.h, 1, self.d), k_all, v_all,
                                           enable_gqa=True)
        x = x + self.wo(a.reshape(B, self.h * self.d))
        gate, up = (F.rms_norm(x, (x.shape[-1],)) @ self.w_gate_up.T).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def build(world, dims, layers, cache_len, batch, dtype, fused, seed, ctxs=None):
    torch.manual_seed(seed + world.rank)  # each rank its own shards
    return [Block(world, dims, cache_len, batch, dtype, fused,
                  ctxs[i] if ctxs else None) for i in range(layers)]


def step(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def time_tokens(blocks, x, world, tokens, graph):
    run = lambda: step(blocks, x)  # noqa: E731
    on_gpu = world.device.type == "cuda"
    if graph and on_gpu:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = run()
        run = lambda: (g.replay(), static_out)[1]  # noqa: E731
    run()
    times = []
    for _ in range(tokens):
        world.barrier()
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = run()
        if on_gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return max(world.all_gather_object(statistics.median(times))), out


@torch.no_grad()  # inference: autograd records nothing, on either path
def run(world, args):
    dims = TINY if args.tiny or world.device.type == "cpu" else LLAMA3_8B
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    x = torch.randn(args.batch, dims["hidden"], device=world.device, dtype=dtype,
                    generator=torch.Generator(device=world.device).manual_seed(0))
    fused = build(world, dims, args.layers, args.cache, args.batch, dtype, True, 1)
    plain = build(world, dims, args.layers, args.cache, args.batch, dtype, False, 1)
    ref, got = step(plain, x), step(fused, x)
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    err = worst(world.all_gather_object(err))  # (the launcher reports rank 0's result)
    tokens = args.tokens if world.device.type == "cuda" else 3
    rows = []
    for graph in ((False, True) if world.device.type == "cuda" else (False,)):
        t_plain, _ = time_tokens(plain, x, world, tokens, graph)
        t_fused, _ = time_tokens(fused, x, world, tokens, graph)
        rows.append((graph, t_plain, t_fused))
    for b in fused:
        b.wo.ctx.close()
        b.down.ctx.close()
    return dims, err, rows


def report(world_size, args, result, device):
    dims, err, rows = result
    print(f"Llama-style decode, {args.layers} layers, hidden {dims['hidden']}, "
          f"intermediate {dims['inter']}, batch {args.batch}, KV window {args.cache}, "
          f"{world_size} ranks on {device}")
    print(f"fused vs unfused output: rel err {err:.2e}")
    print(f"{'mode':>14} {'torch+all_reduce ms/token':>26} {'fused ms/token':>15} {'speedup':>8}")
    for graph, tp, tf in rows:
        print(f"{'graph replay' if graph else 'plain launch':>14} {tp:26.3f} {tf:15.3f} "
              f"{tp / tf:8.2f}")
    if device == "cpu":
        print("(CPU-emulated ranks run the kernels in the Triton interpreter: times are not GPU times)")
    ok = err < (3e-2 if device != "cpu" else 1e-4)
    print("outputs agree" if ok else "OUTPUTS DISAGREE")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(
        description="CPU-emulated ranks (no torchrun) run the toy dimensions with at most 2 "
                    "layers and a KV window of at most 16, and time 3 tokens.")
    ap.add_argument("--layers", type=int_at_least(1), default=4,
                    help="blocks (at most 2 on emulated ranks)")
    ap.add_argument("--batch", type=int_at_least(1), default=1)
    ap.add_argument("--cache", type=int_at_least(1), default=1024,
                    help="KV window (at most 16 on emulated ranks)")
    ap.add_argument("--tokens", type=int_at_least(1), default=50,
                    help="timed decode steps (GPUs; 3 on CPU)")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions")
    args = ap.parse_args()
    if not under_torchrun():  # emulated ranks: the interpreter is slow, keep the toy small
        args.layers, args.cache = min(args.layers, 2), min(args.cache, 16)
    check_dims_divide(ap, TINY if args.tiny or planned_on_cpu() else LLAMA3_8B,
                      planned_world_size())
    return launch(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
