"""Tutorial 1: a remote store and a signal, back and forth between two ranks.

Ranks pair up (0 with 1, 2 with 3, ...). In one launch the pair passes a tile ROUNDS times:
the sender stores the tile straight into the partner's heap (``pol.store_remote``, zero-copy)
and adds one to the partner's arrival counter (``pol.notify``, a release); the receiver waits
for the count (``pol.wait_count``, a bounded acquire), adds one to the tile and sends it back.

    torchrun --nproc-per-node 2 docs/tutorials/01_ping_pong.py     # GPUs
    python docs/tutorials/01_ping_pong.py                          # CPU-emulated ranks

What it shows: the heap (``ws.tensor``), a counter (``ws.flags``) that accumulates over calls
(so the wait's target is ``(call - 1) * per_call + k`` and nothing is reset), and why no "free"
flag is needed here: a rank writes its partner's box only after the partner answered, which it
does after reading. It prints whether the tile came back right and the time of one round trip
against torch.distributed send/recv.
"""
import sys

import torch
import triton
import triton.language as tl

import portable_overlap.language as pol
from portable_overlap import Workspace
from portable_overlap.testing import report, run_on_ranks, time_call

ROUNDS = 16  # messages per launch (even: each rank receives ROUNDS / 2)


@triton.jit
def ping_pong_kernel(ctx, tile_ptr, box_ptr, arrived_ptr, n, ROUNDS: tl.constexpr,
                     BLOCK: tl.constexpr):
    call = pol.begin_call(ctx)
    me = pol.rank(ctx)
    partner = me ^ 1
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tile = tl.load(tile_ptr + offs, mask=mask)
    if partner < pol.num_ranks(ctx):  # with an odd world the last rank sits out
        for i in tl.static_range(ROUNDS):
            if i % 2 == me % 2:  # my turn to send
                pol.store_remote(ctx, box_ptr + offs, tile, partner, mask)
                pol.notify(ctx, arrived_ptr, partner)
            else:  # wait for the partner's message number i // 2 + 1 of this call
                target = (call - 1) * (ROUNDS // 2) + i // 2 + 1
                pol.wait_count(ctx, arrived_ptr, target, call, partner)
                tile = tl.load(box_ptr + offs, mask=mask) + 1
    tl.store(tile_ptr + offs, tile, mask=mask)
    pol.end_call(ctx, call)


def main(world, n=1024):
    dev = world.device
    ws = Workspace(world, 4 * n + 4096, timeout_s=30.0, name="ping_pong")
    box = ws.tensor((n,), torch.float32)
    arrived = ws.flags((1,), "arrived")
    x = torch.randn(n, device=dev, generator=torch.Generator(dev).manual_seed(world.rank))
    tile = x.clone()
    ws.launch(ping_pong_kernel, (1,), tile, box, arrived, n, ROUNDS=ROUNDS,
              BLOCK=triton.next_power_of_2(n))
    ws.synchronize()
    # the reference: the pair's even rank's x, plus one per hop, added one at a time as the
    # kernel does (fp32 rounds each add); the even rank receives last (ROUNDS hops)
    gathered = [torch.empty_like(x) for _ in range(world.world_size)]
    torch.distributed.all_gather(gathered, x)
    partner = world.rank ^ 1
    want = x if partner >= world.world_size else gathered[world.rank & ~1]
    for _ in range(0 if partner >= world.world_size else ROUNDS - world.rank % 2):
        want = want + 1
    ok = torch.equal(tile, want)

    def ours():
        ws.launch(ping_pong_kernel, (1,), tile, box, arrived, n, ROUNDS=ROUNDS,
                  BLOCK=triton.next_power_of_2(n))

    def torch_path():  # the same ROUNDS messages with send / recv
        if partner >= world.world_size:
            return
        t = x.clone()
        for i in range(ROUNDS):
            if i % 2 == world.rank % 2:
                torch.distributed.send(t, partner)
            else:
                torch.distributed.recv(t, partner)
                t += 1

    iters = 20 if dev.type != "cpu" else 2
    ms = {name: time_call(f, world, iters=iters, warmup=2)
          for name, f in (("portable_overlap.language", ours), ("torch send/recv", torch_path))}
    ws.close()
    return report(world, f"ping-pong of {n} floats, {ROUNDS} messages per call, "
                  f"{world.world_size} ranks ({dev.type}): tile", ok, ms,
                  rate=lambda t: f", {1e3 * t / (ROUNDS / 2):.1f} us per round trip")


if __name__ == "__main__":
    sys.exit(max(run_on_ranks(main)))
