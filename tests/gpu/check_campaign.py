"""The fault campaign (portable_overlap.testing.campaign) on GPUs, shorter than CI's, one
process per GPU:

    torchrun --nproc-per-node 2 tests/gpu/check_campaign.py [--steps 40] [--seed N]
        [--timeout 20] [--ops name,...] [--max-dim 64] [--host-group gloo]

``--host-group gloo`` runs the host collectives (references, routing) over gloo instead of
NCCL: with it two ranks can share one GPU (NCCL refuses that), which is how the campaign runs
on a single-GPU machine.

Prints the seed, the counts and every problem; exits non-zero on one."""
import argparse
import os
import sys

from portable_overlap import World
from portable_overlap.testing.campaign import run_campaign


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    # every drawn shape compiles its kernels at its first call, on each rank as it gets there:
    # the waits (and the agreements', which default to at least 60 s) must outlast that
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    ap.add_argument("--max-dim", type=int, default=64, help="the largest dim drawn")
    ap.add_argument("--host-group", default="", help="a torch.distributed backend to use")
    args = ap.parse_args()
    if args.host_group:
        import torch.distributed as dist

        dist.init_process_group(args.host_group)
    world = World.from_env()
    seed = world.broadcast_object(args.seed or int.from_bytes(os.urandom(3), "little"))
    ops = [n for n in args.ops.split(",") if n] or None
    # NVSHMEM takes one GPU per rank: where ranks share one, its transports are left out
    leave_out = ("shmem",) if world.shares_devices() else ()
    tally = run_campaign(world, seed, args.steps, timeout_s=args.timeout, ops=ops,
                         max_dim=args.max_dim, leave_out=leave_out, agreement_s=args.timeout)
    gathered = world.all_gather_object((tally, world.device.index))
    tallies = [t for t, _ in gathered]
    problems = [p for t in tallies for p in t["wrong"] + t["late"] + t["unexpected"]]
    if world.rank == 0:
        t, gpus = tallies[0], len({gpu for _, gpu in gathered})  # (two ranks may share one)
        where = f"{gpus} GPUs" if world.device.type == "cuda" else "emulated"
        print(f"fault campaign on {world.world_size} ranks ({where}), seed {seed}: "
              f"{t['faulted']} faulted of {t['calls']} calls per rank, by fault "
              f"{t['by_fault']}; by op and transport {t['by_transport']}", flush=True)
        for op, why in sorted(t["unavailable"].items()):
            print(f"unavailable here: {op} {sorted(why)}", flush=True)
        for p in problems[:40]:
            print("FAIL", p, flush=True)
        print(f"fault campaign: {len(problems)} problems", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
