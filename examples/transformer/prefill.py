"""Tensor + sequence-parallel prefill of Llama-style blocks with random weights, with and without
the fused collectives in the four projections of every block.

    torchrun --nproc-per-node 2 examples/transformer/prefill.py [--seq 8192] [--layers 4] [--graph]
        [--transport copy_engine|stores|torch_fused|sequential|auto]
    python examples/transformer/prefill.py          # no GPUs: toy shapes on 2 emulated ranks

Layout (Megatron tensor parallelism with sequence parallelism), W ranks, S prompt tokens:

- between the projections, rank r holds rows ``[r*S/W, (r+1)*S/W)`` of the residual stream
  ``[S, hidden]``; RMSNorm and the residual adds act on that shard alone;
- QKV and MLP gate/up are ``ColumnParallelLinear``: all-gather of the normed shard, then the GEMM
  with this rank's columns, giving all S rows of this rank's ``heads/W`` query heads and
  ``kv_heads/W`` key/value heads (of ``intermediate/W`` gate and up columns); fused, the gather
  runs under the GEMM (``all_gather_matmul``);
- causal attention over this rank's heads (all S rows: no communication);
- O and MLP down are ``RowParallelLinear(reduce="reduce_scatter")``: each rank multiplies its
  K-slice, the products are summed over ranks and rank r keeps its row block; fused, the
  reduce-scatter runs under the GEMM (``matmul_reduce_scatter``).

``--transport`` picks both fused ops' transport: ``copy_engine`` (cuBLAS pieces, copy engines
move them), ``stores`` (one persistent kernel stores to every peer at once; one launch per
call, so no host-bound eager layers: on 4 H200s it is the faster of the two,
``docs/scaling.md``), ``torch_fused`` (torch's own fused ops), ``sequential`` or ``auto`` (each
call shape timed over the transports at its first call; the warm-up forward does it). Without
it the contexts take the library's default: ``auto`` on GPUs, ``copy_engine`` on emulated
ranks.

Each rank's shard of a column-parallel weight is read as [q | k | v] (or [gate | up]) of its own
heads (columns), as Megatron lays them out; with random weights any layout is one. No rotary
embedding: it acts per head and changes no communication. The two paths share the weights; the
script checks that their outputs agree and prints per-layer latency (CUDA events on GPUs).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from portable_overlap import (AllGatherMatmul, ColumnParallelLinear, MatmulReduceScatter,
                              RowParallelLinear)
from portable_overlap.cli import int_at_least
from portable_overlap.testing.compare import worst
from tp_common import (LLAMA3_8B, TINY, check_dims_divide,  # examples/transformer/
                       launch, planned_on_cpu, planned_world_size, under_torchrun)


class Block(nn.Module):
    """One Llama block on the sequence shard ``x`` [S/W, hidden] -> [S/W, hidden]."""

    def __init__(self, world, dims, seq, dtype, fused, ag_ctx=None, rs_ctx=None):
        super().__init__()
        W, dev, hid = world.world_size, world.device, dims["hidden"]
        self.h, self.kvh, self.d = dims["heads"] // W, dims["kv_heads"] // W, dims["head_dim"]
        qkv_out = (dims["heads"] + 2 * dims["kv_heads"]) * self.d
        col = dict(max_rows=seq // W, dtype=dtype, fused=fused, ctx=ag_ctx)
        row = dict(reduce="reduce_scatter", max_rows=seq, dtype=dtype, fused=fused,
                   reduce_ctx=rs_ctx)
        self.norm1 = nn.RMSNorm(hid, eps=1e-5, device=dev, dtype=dtype)
        self.qkv = ColumnParallelLinear(hid, qkv_out, world, **col)
        self.wo = RowParallelLinear(dims["heads"] * self.d, hid, world, **row)
        self.norm2 = nn.RMSNorm(hid, eps=1e-5, device=dev, dtype=dtype)
        self.gate_up = ColumnParallelLinear(hid, 2 * dims["inter"], world, **col)
        self.down = RowParallelLinear(dims["inter"], hid, world, **row)

    def forward(self, x):
        qkv = self.qkv(self.norm1(x))  # [S, (h + 2 kvh) d]: every row, this rank's heads
        S, h, kvh, d = qkv.shape[0], self.h, self.kvh, self.d
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        heads = lambda t, n: t.view(1, S, n, d).transpose(1, 2)  # noqa: E731  [1, n, S, d]
        a = F.scaled_dot_product_attention(heads(q, h), heads(k, kvh), heads(v, kvh),
                                           is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(S, h * d))  # back to this rank's row block
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def forward(blocks, x, on_gpu):
    """The blocks in order; returns the output and each block's time in ms (CUDA events on
    GPUs, so no host sync between blocks)."""
    if on_gpu:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(blocks) + 1)]
        ev[0].record()
        for b, e in zip(blocks, ev[1:]):
            x = b(x)
            e.record()
        torch.cuda.synchronize()
        return x, [ev[i].elapsed_time(ev[i + 1]) for i in range(len(blocks))]
    times = []
    for b in blocks:
        t = time.perf_counter()
        x = b(x)
        times.append((time.perf_counter() - t) * 1e3)
    return x, times


def time_layers(blocks, x, world, iters):
    """Per-layer median over ``iters`` forwards (a barrier before each), slowest rank's."""
    on_gpu = world.device.type == "cuda"
    runs = []
    for _ in range(iters):
        world.barrier()
        if on_gpu:
            torch.cuda.synchronize()
        runs.append(forward(blocks, x, on_gpu)[1])
    med = [statistics.median(t) for t in zip(*runs)]
    return [max(ms) for ms in zip(*world.all_gather_object(med))]


def time_graph(blocks, x, world, iters):
    """All the blocks captured in one CUDA graph (both paths' ops are graph-safe: the fused
    contexts keep their epochs on the device, NCCL calls are captured): the median of ``iters``
    replays, slowest rank's, in ms. Without the host's launch cost, which grows with the number
    of pieces and peers in the copy-engine ops (about 2.5 ms per call on 4 ranks)."""
    def run_blocks():
        y = x
        for b in blocks:
            y = b(y)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_blocks()  # warm-up outside the capture (plans, workspaces)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_blocks()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        world.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return max(world.all_gather_object(statistics.median(times)))


def run(world, args):
    W, r = world.world_size, world.rank
    on_gpu = world.device.type == "cuda"
    dims = TINY if args.tiny or not on_gpu else LLAMA3_8B
    if args.seq % W or dims["heads"] % W or dims["kv_heads"] % W:
        raise ValueError(f"--seq {args.seq}, heads {dims['heads']} and kv_heads "
                         f"{dims['kv_heads']} must divide by the world size {W}")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    S, hid = args.seq, dims["hidden"]
    # shared by every layer (the calls come in the same order on every rank, one at a time):
    # one gather buffer for QKV and gate/up (both read [S/W, hidden]), one reduce workspace for O
    # and down (both write [S, hidden] before the scatter)
    ag_ctx = AllGatherMatmul(world, max_shard_elems=S // W * hid, transport=args.transport)
    rs_ctx = MatmulReduceScatter(world, S, hid, transport=args.transport)
    torch.manual_seed(1 + r)  # each rank its own shards of the weights
    fused = [Block(world, dims, S, dtype, True, ag_ctx, rs_ctx) for _ in range(args.layers)]
    plain = [Block(world, dims, S, dtype, False) for _ in range(args.layers)]
    for f, p in zip(fused, plain):
        p.load_state_dict(f.state_dict())
    g = torch.Generator(device=world.device).manual_seed(0)  # the same prompt everywhere
    x = torch.randn(S, hid, device=world.device, dtype=dtype, generator=g)
    x = x[r * S // W:(r + 1) * S // W]
    with torch.no_grad():
        ref, _ = forward(plain, x, on_gpu)  # the first calls also warm up (compiles, plans)
        got, _ = forward(fused, x, on_gpu)
        diff = (got.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        diff, scale = (worst(v) for v in zip(*world.all_gather_object((diff, scale))))
        iters = args.iters if on_gpu else 2
        t_plain = time_layers(plain, x, world, iters)
        t_fused = time_layers(fused, x, world, iters)
        graphs = ((time_graph(plain, x, world, iters), time_graph(fused, x, world, iters))
                  if on_gpu and args.graph else None)
    ag_ctx.close()
    rs_ctx.close()
    return dims, diff, scale, t_plain, t_fused, graphs, ag_ctx.transport


def report(world_size, args, result, device):
    dims, diff, scale, t_plain, t_fused, graphs, transport = result
    print(f"Llama-style prefill, {args.layers} layers, hidden {dims['hidden']}, heads "
          f"{dims['heads']} (kv {dims['kv_heads']}), intermediate {dims['inter']}, "
          f"{args.seq} tokens, {world_size} ranks on {device} (tensor + sequence parallel), "
          f"fused ops over transport {transport!r}")
    # bf16: one rounding of the reduced outputs differs between the paths (~0.4% of a value),
    # carried through the layers; fp32 differs only in the order of the K-split sums
    tol = 5e-2 if device != "cpu" else 1e-4
    print(f"fused vs reference output: max abs diff {diff:.3e} (max |output| {scale:.3e}; "
          f"tolerance {tol:g} x max |output|)")
    print(f"{'layer':>6} {'reference ms':>13} {'fused ms':>9} {'speedup':>8}")
    for i, (tp, tf) in enumerate(zip(t_plain, t_fused)):
        print(f"{i:>6} {tp:13.3f} {tf:9.3f} {tp / tf:8.2f}")
    tp, tf = sum(t_plain), sum(t_fused)
    print(f"{'all':>6} {tp:13.3f} {tf:9.3f} {tp / tf:8.2f}   (tokens/s: reference "
          f"{args.seq / tp * 1e3:,.0f}, fused {args.seq / tf * 1e3:,.0f})")
    if graphs:
        gp, gf = graphs
        print(f"{'graph':>6} {gp:13.3f} {gf:9.3f} {gp / gf:8.2f}   (all layers in one CUDA graph, "
              f"replayed; tokens/s: reference {args.seq / gp * 1e3:,.0f}, fused "
              f"{args.seq / gf * 1e3:,.0f})")
    if device == "cpu":
        print("(CPU-emulated ranks run the kernels in the Triton interpreter: times are not GPU "
              "times)")
    ok = diff <= tol * scale
    print("outputs agree" if ok else "OUTPUTS DISAGREE")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(
        description="CPU-emulated ranks (no torchrun) run the toy dimensions with at most 2 "
                    "layers and 16 prompt tokens, and time 2 forwards.")
    ap.add_argument("--layers", type=int_at_least(1), default=4,
                    help="blocks (at most 2 on emulated ranks)")
    ap.add_argument("--seq", type=int_at_least(1), default=8192,
                    help="prompt tokens, a multiple of the ranks (at most 16 on emulated ranks)")
    ap.add_argument("--iters", type=int_at_least(1), default=20,
                    help="timed forwards (GPUs; 2 on CPU)")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions")
    ap.add_argument("--graph", action="store_true",
                    help="also time all layers captured in one CUDA graph (GPUs)")
    ap.add_argument("--transport", default=None,
                    choices=("copy_engine", "stores", "torch_fused", "sequential", "auto"),
                    help="the transport of both fused ops (AllGather + GEMM, GEMM + "
                         "ReduceScatter; default: the library's, auto on GPUs; torch_fused "
                         "needs GPUs)")
    args = ap.parse_args()
    if args.transport == "torch_fused" and planned_on_cpu():
        # (else every rank raised BackendUnavailable with a traceback, exit code 1: the code
        # of a wrong result)
        ap.error("argument --transport: 'torch_fused' needs GPUs (torch's symm_mem fused ops "
                 "take GPU tensors only) and these ranks run on CPU; choose another transport")
    if not under_torchrun():  # emulated ranks: the interpreter is slow, keep the toy small
        args.layers, args.seq = min(args.layers, 2), min(args.seq, 16)
    W = planned_world_size()
    if args.seq % W:  # (else every rank raised it with a traceback, exit code 1)
        ap.error(f"argument --seq: {args.seq} tokens must divide by the world size {W} "
                 f"(each rank holds seq / world of them)")
    check_dims_divide(ap, TINY if args.tiny or planned_on_cpu() else LLAMA3_8B, W)
    return launch(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
