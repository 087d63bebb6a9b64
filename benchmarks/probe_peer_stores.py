"""Probe: how fast can a few programs of one kernel push this rank's shard into every peer's
heap, the transfer of AllGather + GEMM's ``"stores"`` transport? On 4 H200s its senders reached
210-250 GB/s out of each GPU at 8 to 32 programs, short of NCCL's all-gather (286 GB/s bus)
and of the ~300 GB/s that 1.15x torch's fused op needs on 8 GPUs (docs/scaling.md).

Every rank copies its shard ``a`` [m, K] (bf16) into rows ``rank*m ..`` of the gather buffer in
every peer's heap, all ranks at once (the pattern of the op), with P programs, two ways:

- ``flat``: what the op's senders do (``allgather_gemm/kernel.py::_send``): a program takes
  (chunk, peer) units and moves each chunk as one flat range, ``BLOCK`` elements loaded into
  registers and stored to the peer per step;
- ``tma``: the same units through tensor descriptors: a [BR, BK] box is read from ``a`` into
  shared memory and written to the peer's buffer by the Tensor Memory Accelerator, a bulk
  store that leaves the program free to issue the next box instead of holding every byte in
  its store queue until the link takes it.

Prediction: flat stores are bound by the bytes one SM keeps in flight over NVLink (~10 GB/s
per program at 16 KiB per step and ~1.5 us of latency), so flat grows with P up to the link;
TMA bulk stores keep more in flight per SM and should reach >= 280 GB/s at P <= 16.

Each variant is checked (every rank compares the rows each peer stored with that peer's shard,
rebuilt from its seed) and then timed: CUDA events, a barrier before each of ``--iters``
launches, the slowest rank's median. Egress = (W-1) * m * K * 2 bytes / time.

    torchrun --nproc-per-node 4 -m benchmarks.probe_peer_stores --out DIR

Writes DIR/probe_peer_stores.json; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from benchmarks.rows import git_commit
from portable_overlap import World, collectives
from portable_overlap.shmem.heap import SymmetricHeap


@triton.jit
def _push_units(a_ptr, dst_bases, pid, P, rank, world, m, K, chunk_rows, n_chunks,
                BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Program ``pid`` of ``P`` senders: units pid, pid + P, ... of (chunk, peer), chunk-major
    (every peer gets chunk 0 first); each unit one flat copy of the chunk's rows, ``STAGES``
    loads in flight (the software pipeliner turns them into cp.async when STAGES > 1)."""
    n_units = n_chunks * (world - 1)
    lanes = tl.arange(0, BLOCK)
    for u in range(pid, n_units, P):
        c = u // (world - 1)
        d = (rank + 1 + u % (world - 1)) % world
        lo = c * chunk_rows
        n = (tl.minimum(lo + chunk_rows, m) - lo).to(tl.int64) * K
        src = a_ptr + tl.multiple_of(lo.to(tl.int64) * K, 8)  # K % 8 == 0: 16-byte vectors
        dst = tl.load(dst_bases + d).to(tl.pointer_type(tl.bfloat16)) \
            + tl.multiple_of((rank.to(tl.int64) * m + lo) * K, 8)
        for off in tl.range(0, n, BLOCK, num_stages=STAGES):
            idx = off + lanes
            keep = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=keep), mask=keep)


@triton.jit(do_not_specialize=["rank"])  # rank 1 would be a constant without it
def flat_push_kernel(a_ptr, dst_bases, rank, world, m, K, chunk_rows, n_chunks,
                     BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Every program a sender (``_push_units``)."""
    _push_units(a_ptr, dst_bases, tl.program_id(0), tl.num_programs(0), rank, world, m, K,
                chunk_rows, n_chunks, BLOCK, STAGES)


@triton.jit
def _pause(ns):
    """Sleep about ``ns`` nanoseconds (a poll's back-off); nothing under the interpreter."""
    return tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r", [ns],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["rank", "want"])
def flat_push_polled_kernel(a_ptr, dst_bases, done_ptr, want, rank, world, m, K, chunk_rows,
                            n_chunks, senders, BLOCK: tl.constexpr, POLL: tl.constexpr):
    """The first ``senders`` programs as ``flat_push_kernel``; every other program polls a
    local word until all senders are done (``done_ptr`` reaches ``want``), as the op's compute
    programs poll their rows' ready flags while the rows arrive. POLL 0: an acquire atomic
    at system scope per poll (the op's ``wait_flag``); 1: the same with a 256 ns sleep
    between polls; 2: a volatile load per poll."""
    pid = tl.program_id(0)
    if pid < senders:
        _push_units(a_ptr, dst_bases, pid, senders, rank, world, m, K, chunk_rows, n_chunks,
                    BLOCK, 1)
        tl.debug_barrier()
        tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")
    else:
        v = tl.atomic_add(done_ptr, 0, sem="acquire", scope="sys")
        spins = 0
        while (v < want) & (spins < 50_000_000):
            if POLL == 1:
                _pause(256)
            if POLL == 2:
                v = tl.load(done_ptr, volatile=True)
            else:
                v = tl.atomic_add(done_ptr, 0, sem="acquire", scope="sys")
            spins += 1


@triton.jit(do_not_specialize=["rank"])  # rank 1 would be a constant without it
def tma_push_kernel(a_ptr, dst_bases, rank, world, m, K, chunk_rows, n_chunks,
                    BR: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """Program p serves peer p % (W-1) (P a multiple of W-1), the chunks p // (W-1), ...;
    one descriptor per side, made once per program; the program's boxes [BR, BK] in one
    loop, ``STAGES`` box loads in flight (chunk_rows a multiple of BR)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    peers = world - 1
    d = (rank + 1 + pid % peers) % world
    src = tl.make_tensor_descriptor(a_ptr, [m, K], [K, 1], [BR, BK])
    base = tl.load(dst_bases + d).to(tl.pointer_type(tl.bfloat16)) + rank.to(tl.int64) * m * K
    dst = tl.make_tensor_descriptor(base, [m, K], [K, 1], [BR, BK])
    first, step = pid // peers, P // peers
    mine = tl.maximum(n_chunks - first + step - 1, 0) // step  # chunks first, first+step, ...
    kb = tl.cdiv(K, BK)
    per_chunk = (chunk_rows // BR) * kb
    for i in tl.range(0, mine * per_chunk, num_stages=STAGES):
        c = first + (i // per_chunk) * step
        j = i % per_chunk
        r0 = c * chunk_rows + (j // kb) * BR  # rows past m: the TMA clips them
        k0 = (j % kb) * BK
        dst.store([r0, k0], src.load([r0, k0]))


def shard(rank: int, m: int, K: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(77 + rank)
    return torch.randn(m, K, generator=g, device=device).to(torch.bfloat16)


VARIANTS = {"flat": dict(BLOCK=8192, STAGES=1),
            "flat+poll": dict(BLOCK=8192, POLL=0), "flat+poll_sleep": dict(BLOCK=8192, POLL=1),
            "flat+poll_load": dict(BLOCK=8192, POLL=2),
            "tma": dict(BR=64, BK=128, STAGES=1), "tma_big": dict(BR=128, BK=256, STAGES=1),
            "tma_pipe": dict(BR=64, BK=128, STAGES=3),
            "tma_pipe_wide": dict(BR=64, BK=256, STAGES=3)}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_ms(dev, launch) -> float:
    """One launch's time: CUDA events on a GPU, the host clock around it on the CPU."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        launch()
        return (time.perf_counter() - t0) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    launch()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def probe(world, shapes, programs, variants, chunk_rows: int, iters: int) -> list:
    """Every variant at every program count and shape, checked then timed (module docstring);
    collective. Returns the rows (the same on every rank)."""
    W, r, dev = world.world_size, world.rank, world.device
    if dev.type == "cuda":  # device-side descriptors take their 128 bytes from this allocator
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                     device=dev))
    heap = SymmetricHeap(world, max(W * m * K * 2 for m, K in shapes) + (1 << 20))
    gather_all = heap.alloc((max(W * m * K for m, K in shapes),), torch.bfloat16)
    dst_bases = torch.tensor([heap.peer_address(gather_all, q) if q != r else 0
                              for q in range(W)], dtype=torch.int64, device=dev)
    # the op's grid: one program per processor (the pollers take the ones senders leave)
    grid = (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda"
            else 8)
    rows = []
    try:
        for m, K in shapes:
            a = shard(r, m, K, dev)
            gather = gather_all[:W * m * K].view(W * m, K)
            n_chunks = triton.cdiv(m, chunk_rows)
            for name in variants:
                meta = VARIANTS[name]
                kern = (tma_push_kernel if name.startswith("tma") else
                        flat_push_polled_kernel if "poll" in name else flat_push_kernel)
                if kern is tma_push_kernel and chunk_rows % meta["BR"]:
                    raise ValueError(f"{name}: chunk_rows {chunk_rows} is not a multiple of "
                                     f"its box's {meta['BR']} rows")
                for P in programs:
                    if kern is tma_push_kernel and P % (W - 1):
                        P += (W - 1) - P % (W - 1)

                    def launch():
                        if kern is flat_push_polled_kernel:  # senders, and pollers on the rest
                            launches[0] += 1
                            kern[(grid,)](a, dst_bases, done, P * launches[0], r, W, m, K,
                                          chunk_rows, n_chunks, P, num_warps=8, **meta)
                            return
                        kern[(P,)](a, dst_bases, r, W, m, K, chunk_rows, n_chunks,
                                   num_warps=8, **meta)
                    done = torch.zeros(1, dtype=torch.int32, device=dev)
                    launches = [0]
                    gather.fill_(float("nan"))
                    _sync(dev)
                    world.barrier()
                    err = ""
                    try:  # every rank reaches the barrier below, whatever happens here
                        launch()
                        _sync(dev)
                    except Exception as e:  # a variant that does not compile or run here
                        err = f"{type(e).__name__}: {e}"[:300]
                    world.barrier()
                    if not err and any(not torch.equal(gather[q * m:(q + 1) * m],
                                                       shard(q, m, K, dev))
                                       for q in range(W) if q != r):
                        bad = [(q, int(gather[q * m:(q + 1) * m].isnan().sum()),
                                float((gather[q * m:(q + 1) * m].float()
                                       - shard(q, m, K, dev).float()).abs().nan_to_num(-1).max()))
                               for q in range(W) if q != r]
                        err = f"wrong rows (peer, NaNs, max diff): {bad}"
                    errs = world.all_gather_object(err)
                    ms = []
                    if not any(errs):  # all ranks time, or none
                        for _ in range(iters):
                            _sync(dev)
                            world.barrier()
                            ms.append(_time_ms(dev, launch))
                    rank_ms = world.all_gather_object(statistics.median(ms) if ms else 0.0)
                    t = max(rank_ms)
                    good = not any(errs) and t > 0
                    gbs = (W - 1) * m * K * 2 / (t * 1e-3) / 1e9 if good else float("nan")
                    row = dict(m=m, K=K, variant=name, programs=P, world=W, ok=good,
                               median_ms=round(t, 4), egress_GBps=round(gbs, 1),
                               error="; ".join(f"rank {q}: {x}" for q, x in enumerate(errs) if x),
                               rank_ms=[round(x, 4) for x in rank_ms])
                    rows.append(row)
                    if r == 0:
                        print(row, flush=True)
            if dev.type == "cuda":  # NCCL's all-gather of the same shards, for the bus rate
                full = torch.empty(W * m, K, dtype=torch.bfloat16, device=dev)
                ms = []
                for _ in range(iters):
                    _sync(dev)
                    world.barrier()
                    ms.append(_time_ms(dev, lambda: collectives.all_gather(full, a)))
                t = max(world.all_gather_object(statistics.median(ms)))
                rows.append(dict(m=m, K=K, variant="nccl_all_gather", programs=0, world=W,
                                 ok=True, median_ms=round(t, 4),
                                 egress_GBps=round((W - 1) * m * K * 2 / (t * 1e-3) / 1e9, 1),
                                 error=""))
    finally:
        heap.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mk", default="2048x8192,1024x8192", help="shard shapes m x K")
    ap.add_argument("--programs", default="6,12,24,33,48,66,132")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--chunk-rows", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    world = World.from_env()
    torch.cuda.set_device(world.device)
    rows = probe(world, [tuple(int(x) for x in s.split("x")) for s in args.mk.split(",")],
                 [int(x) for x in args.programs.split(",")], args.variants.split(","),
                 args.chunk_rows, args.iters)
    if world.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_peer_stores.json"), "w") as f:
            json.dump(dict(commit=git_commit(), device=torch.cuda.get_device_name(world.device),
                           rows=rows), f, indent=1)
        print(f"{'m x K':>11} {'variant':>16} {'P':>4} {'ok':>3} {'ms':>8} {'GB/s out':>9}")
        for x in rows:
            print(f"{x['m']:>5}x{x['K']:<5} {x['variant']:>16} {x['programs']:>4} "
                  f"{'yes' if x['ok'] else 'NO':>3} {x['median_ms']:>8.4f} "
                  f"{x['egress_GBps']:>9.1f} {x['error'][:80]}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
