"""GPU checks of the public device API (portable_overlap.language) and Workspace, under torchrun
(any number of ranks, one included: a rank's peer at rotation step 1 is then itself):

    torchrun --nproc-per-node 2 tests/gpu/check_language.py

The calls of the CPU tests (portable_overlap.testing.language_calls) on the GPU: a ping ring
over back-to-back calls, an all-gather by puts, counters + barrier + remote loads, a 3-D grid's
numbering, a flag nobody sets (PeerTimeoutError naming it, within its timeout, then a broken
workspace), a peer that gives up, a kernel that skips end_call; then a launch captured in a
CUDA graph, replayed with fresh data (the call counter advances on the device), every
tutorial's main(), a ring of zero-copy gets (``pol.get``), and rings of puts and of gets through
the SHMEM library (``Workspace(shmem=True)``: ``pol.shmem_put`` + ``pol.shmem_quiet`` +
``pol.signal``; ``pol.signal`` + ``pol.shmem_get``; SKIP with the reason where no library is
usable). Exit code 1 if a check failed on any rank. (Not collected by pytest.)
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
import time
import traceback

import torch

from portable_overlap import World, Workspace
from portable_overlap.language.host import calls_counted
from portable_overlap.shmem.providers import ShmemUnavailable
from portable_overlap.shmem.providers.device import LIBRARY
from portable_overlap.testing import language_calls as calls
from portable_overlap.testing.check_log import CheckLog

LOG = CheckLog(44)


def run_check(world, name, fn, verdict):
    t0 = time.perf_counter()
    try:
        bad = verdict(world.all_gather_object(fn(world)))
    except Exception as e:
        bad = [f"{type(e).__name__}: {str(e)[:300]}"]
        traceback.print_exc()
    LOG.record(name, not bad, f"{time.perf_counter() - t0:.2f} s " + "; ".join(bad)[:300])


def graph_replay(world):
    """The ping ring's launch captured once and replayed with fresh data: each replay is a
    new call (the device counts), and the received data is the peer's of that replay."""
    dev, W, r, n = world.device, world.world_size, world.rank, 1000
    ws = Workspace(world, 1 << 16, timeout_s=20.0, name="ping_graph")
    inbox = ws.tensor((n,), torch.float32)
    ready, free = ws.flags((W,), "ready"), ws.flags((W,), "free")
    x = torch.zeros(2 * n, device=dev)
    ok = torch.zeros(1, dtype=torch.int32, device=dev)
    launch = lambda: ws.launch(calls._ping_kernel, (1,), x, inbox, ready, free, ok, n, BLOCK=1024)  # noqa
    launch()  # compiles and loads outside the capture
    ws.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    got = []
    for i in range(5):
        x[:n].copy_(torch.randn(n, device=dev, generator=torch.Generator(dev).manual_seed(
            100 * i + r)))
        x[n:].fill_(float("nan"))
        g.replay()
        got.append((x[:n].cpu(), x[n:].cpu(), int(ok)))
    torch.cuda.synchronize()
    done = calls_counted(ws.ctx)
    ws.close()
    return got, done


def shmem_ring(world, pull=False) -> None:
    """Rank r puts fresh data to r+1 through the SHMEM library over 3 back-to-back calls (with
    ``pull``, r+1 gets it from r's buffer), against what the peer sent; SKIP where no library is
    usable or the world has one rank (every rank raises the same ShmemUnavailable, before
    anything is allocated)."""
    name = (f"shmem {'gets' if pull else 'puts'} "
            f"({'ROC_SHMEM' if LIBRARY == 'rocshmem' else 'NVSHMEM'}) ring of 3 calls")
    t0 = time.perf_counter()
    try:
        out = world.all_gather_object(calls.ring(world, 4099, 3, shmem=True, pull=pull))
    except ShmemUnavailable as e:
        LOG.skip(name, str(e)[:500])
        return
    except Exception as e:
        traceback.print_exc()
        LOG.record(name, False, f"{type(e).__name__}: {str(e)[:300]}")
        return
    bad = calls.check_ping(out, 3)
    LOG.record(name, not bad, f"{time.perf_counter() - t0:.2f} s " + "; ".join(bad)[:300])


def tutorials(world):
    """Every tutorial's main() on this world; its return codes."""
    codes = {}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in sorted(glob.glob(os.path.join(root, "docs", "tutorials", "[0-9]*.py"))):
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        codes[os.path.basename(path)] = mod.main(world)
    return codes


def main() -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = World.from_env()
    torch.manual_seed(0)
    run_check(world, "ping ring, 3 calls, n=37 and 4099", lambda w: [calls.ping(w, 37, 3),
                                                                     calls.ping(w, 4099, 3)],
              lambda out: calls.check_ping([o[0] for o in out], 3)
              + calls.check_ping([o[1] for o in out], 3))
    run_check(world, "all-gather by puts, n=45 / 100003", lambda w: [calls.gather(w, 45, 2),
                                                                    calls.gather(w, 100003, 2)],
              lambda out: calls.check_gather([o[0] for o in out])
              + calls.check_gather([o[1] for o in out]))
    run_check(world, "counters, barrier, remote loads", lambda w: calls.count(w, 3),
              calls.check_count)
    run_check(world, "3-D grid numbering", calls.grid, calls.check_grid)
    t0 = time.perf_counter()
    run_check(world, "flag nobody sets -> PeerTimeoutError", calls.lonely, calls.check_lonely)
    LOG.record("  ... raised within timeout + 10 s", time.perf_counter() - t0 < 0.5 + 10.0,
               f"{time.perf_counter() - t0:.2f} s for timeout 0.5 s")
    if world.world_size > 1:
        run_check(world, "peer gives up, workspace goes on", calls.quitter, calls.check_quitter)
    if world.world_size > 2:
        run_check(world, "wait_peers: the peer that gave up, not the late one",
                  calls.quitter_among_late, calls.check_quitter_among_late)
    if world.world_size > 1:
        run_check(world, "flags of another tag -> RankMismatchError", calls.tagged,
                  calls.check_tagged)
    run_check(world, "kernel without end_call is caught", calls.no_end, calls.check_no_end)
    run_check(world, "graph replay: 5 replays, new data", graph_replay,
              # one eager call, then five replays: the device counted six
              lambda out: calls.check_ping([(got, done - 1) for got, done in out], 5))
    run_check(world, "pull ring (zero-copy gets), 3 calls, n=4099",
              lambda w: calls.ring(w, 4099, 3, shmem=False, pull=True),
              lambda out: calls.check_ping(out, 3))
    run_check(world, "tutorials (main of each)", tutorials,
              lambda out: [f"rank {r}: {codes}" for r, codes in enumerate(out)
                           if any(codes.values())])
    shmem_ring(world)
    shmem_ring(world, pull=True)
    return LOG.finish(world, "language checks")


if __name__ == "__main__":
    sys.exit(main())
