"""Tutorial 2: an all-gather written with puts and per-chunk flags.

Every rank holds a shard ``x`` of ``n`` elements; after the call every rank's ``gathered``
(a heap tensor ``[world, n]``) holds every rank's shard, rank q's in row q. Each rank pushes its
shard in chunks into row ``me`` of every peer's ``gathered`` (``pol.put``) and raises a flag per
(source, chunk) there (``pol.signal``); then it waits for the chunks that come to it.

    torchrun --nproc-per-node 2 docs/tutorials/02_all_gather.py    # GPUs
    python docs/tutorials/02_all_gather.py                         # CPU-emulated ranks

What it shows:
- **Rotation.** At step s a rank sends to ``pol.peer_at(s, me, world)``: at every step each
  rank has one sender and one receiver, so every link carries one stream at a time.
- **Who waits for whom.** Program p sends a fixed set of (step, chunk) items and then waits
  for the same items sent to it, which the peers' program p sends. So no program waits for a
  program of its own launch (the rule that keeps a kernel correct when programs run one after
  another, as in the CPU interpreter, or when the grid is larger than the GPU).
- **Reuse across calls.** A rank may not overwrite a peer's ``gathered`` before the peer has
  used the previous call's. Each call begins with every rank telling its peers "I am in call
  c" (``pol.announce_call``, flag ``free``): its stream ran everything queued before this
  launch, including the code that read the last result. Senders wait for that flag
  (``pol.wait_free``) before their first store.
It prints whether every rank gathered the right data and the time against torch's
``all_gather_into_tensor`` (NCCL on GPUs).
"""
import sys

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import Workspace
from portable_overlap.testing import report, run_on_ranks, time_call

MAX_CHUNKS = tl.constexpr(256)  # flags per source rank (a constexpr: the kernel reads it)


@triton.jit
def all_gather_kernel(ctx, x_ptr, gathered_ptr, ready_ptr, free_ptr, n, chunks,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    world = pol.num_ranks(ctx)
    p = pol.program()
    P = pol.num_programs()
    if p == 0:  # "my gathered buffer is free for this call": tell every peer
        pol.announce_call(ctx, free_ptr, call)
    items = (world - 1) * chunks
    for i in range(p, items, P):  # send: item i is (step, chunk)
        q = pol.peer_at(1 + i // chunks, me, world)
        c = i % chunks
        pol.wait_free(ctx, free_ptr, q, call)
        start = c * CHUNK
        pol.put(ctx, gathered_ptr + me * n + start, x_ptr + start, tl.minimum(CHUNK, n - start),
                q, BLOCK)
        pol.signal(ctx, ready_ptr + me * MAX_CHUNKS + c, q, call)
    for c in range(p, chunks, P):  # this rank's own row: a local copy
        start = c * CHUNK
        pol.put(ctx, gathered_ptr + me * n + start, x_ptr + start, tl.minimum(CHUNK, n - start),
                me, BLOCK)
    for i in range(p, items, P):  # receive: the same items, sent to me by the peers' program p
        src = pol.peer_at(world - 1 - i // chunks, me, world)
        pol.wait(ctx, ready_ptr + src * MAX_CHUNKS + i % chunks, call, src)
    pol.end_call(ctx, call)


def main(world, n=None):
    dev = world.device
    W = world.world_size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = n or (8 << 20 if dev.type == "cuda" else 3000)  # elements per rank
    chunk = max(1024, triton.cdiv(n, MAX_CHUNKS.value))
    chunks = triton.cdiv(n, chunk)
    nbytes = Workspace.bytes_for(((W, n), dtype), ((W, MAX_CHUNKS.value), torch.int64),
                                 ((W,), torch.int64))
    ws = Workspace(world, nbytes, timeout_s=30.0, name="all_gather")
    gathered = ws.tensor((W, n), dtype)
    ready = ws.flags((W, MAX_CHUNKS.value), "ready")
    free = ws.flags((W,), "free")
    programs = min(ws.sm_count, max(W - 1, 1) * chunks)  # (one rank: its own copy)
    g = torch.Generator(dev).manual_seed(world.rank)
    x = torch.randn(n, device=dev, generator=g).to(dtype)

    def ours():
        ws.launch(all_gather_kernel, (programs,), x, gathered, ready, free, n, chunks,
                  CHUNK=chunk, BLOCK=1024)

    out = torch.empty(W * n, device=dev, dtype=dtype)

    dist = torch.distributed  # (all_gather_single is the newer name of the same collective)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def torch_path():
        gather_into(out, x)

    ok = True
    for _ in range(3):  # fresh data each call; the result is read before the next call
        x.copy_(torch.randn(n, device=dev, generator=g).to(dtype))
        gathered.fill_(float("nan"))  # this rank's own row too
        ours()
        torch_path()
        ok &= torch.equal(gathered.flatten(), out)
    ws.synchronize()
    gpu = dev.type == "cuda"
    ms = {name: time_call(f, world, iters=50 if gpu else 2, warmup=3, graph=gpu)
          for name, f in (("portable_overlap.language", ours), ("torch all_gather", torch_path))}
    ws.close()
    return report(world, f"all-gather of {n} {dtype} per rank over {W} ranks ({dev.type}): "
                  f"gathered", ok, ms, graph=gpu,
                  rate=(lambda t: f", {(W - 1) * n * dtype.itemsize / t / 1e6:.0f} GB/s in per "
                        f"rank") if gpu else None)


if __name__ == "__main__":
    sys.exit(max(run_on_ranks(main)))
