"""Probe (one GPU or more, under torchrun): what a context's calls made on different streams do
when nothing orders them, against the same calls ordered by the context
(``ContextBase._follow_stream``). Per round: a GEMV + AllReduce call on stream s1 (a long one,
8 x 8192 x 14336), a short one on s2 and one on the default stream, queued back to back; the
outputs against torch. ``--unordered`` replaces ``_follow_stream`` by a no-op, as the contexts
were before it. Prints, per transport, the rounds whose results were wrong, the errors raised
and the worst relative error.

    timeout 300 torchrun --nproc-per-node 1 -m benchmarks.probe_unordered_streams --unordered
"""
from __future__ import annotations

import argparse

import torch

from portable_overlap import GemvAllReduce, PortableOverlapError, World, gemv_all_reduce_reference
from portable_overlap.ops.context import ContextBase
from portable_overlap.testing.streams import calls_on_three_streams

SHAPES = (((8, 14336), (8192, 14336)), ((1, 4096), (8192, 4096)), ((32, 2048), (8192, 2048)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--unordered", action="store_true",
                   help="calls on other streams are not ordered by the context")
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args()
    if args.unordered:
        ContextBase._follow_stream = lambda self: None
    world = World.from_env()
    gen = torch.Generator(device=world.device).manual_seed(1 + world.rank)
    for transport in ("stores", "one_shot"):
        ctx = GemvAllReduce(world, max_n=8192, transport=transport, timeout_s=5.0)
        try:
            wrong, errors, worst = calls_on_three_streams(
                ctx, lambda x, w: ctx(x, w), lambda x, w: gemv_all_reduce_reference(
                    x, w, world.group), SHAPES, gen, args.rounds)
        finally:
            try:
                ctx.close()
            except PortableOverlapError:
                pass
        if world.rank == 0:
            print(f"{'unordered' if args.unordered else 'ordered'} {transport}: "
                  f"{wrong} of {args.rounds} rounds wrong, errors {errors}, "
                  f"worst rel_err {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
