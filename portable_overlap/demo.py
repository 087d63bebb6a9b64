"""The main demo: 2-rank fused GEMV + AllReduce, checked against the torch reference and timed.

On a machine with at least ``ranks`` GPUs it starts one process per GPU (NCCL); otherwise it runs
the same kernels on CPU-emulated ranks under the Triton interpreter (correctness only: interpreter
timings say nothing about GPU speed). The context takes the library's default transport
(``"auto"`` on GPUs: its first call of each shape times the transports and keeps the fastest;
the table names the pick), and both paths are timed as the benchmarks time them
(``schedule.tuning.time_call``: plain launches, the barrier on the stream, the host's time
to issue a call counted where it is the longer).
"""
from __future__ import annotations

import os
import queue as _queue
import time

import torch

from .ops.context import check_sizes


def _shapes(on_gpu: bool, world_size: int):
    if on_gpu:  # Llama-style decode: (M, N, K) with K split over the ranks
        return [(1, 8192, 28672), (8, 4096, 14336), (32, 8192, 28672)], [torch.bfloat16]
    return [(1, 256, 96), (8, 200, 130), (33, 97, 64)], [torch.bfloat16, torch.float32]


def _demo_rank(world) -> list:
    from .ops.gemv_allreduce import GemvAllReduce, gemv_all_reduce_reference

    on_gpu = world.device.type == "cuda"
    shapes, dtypes = _shapes(on_gpu, world.world_size)
    ctx = GemvAllReduce(world, max_n=max(n for _, n, _ in shapes))
    gen = torch.Generator(device=world.device).manual_seed(2024 + world.rank)
    rows = []
    for M, N, K in shapes:
        Kl = K // world.world_size
        for dt in dtypes:
            x = torch.randn(M, Kl, generator=gen, device=world.device).to(dt)
            w = torch.randn(N, Kl, generator=gen, device=world.device).to(dt)
            out = torch.full((M, N), float("nan"), dtype=dt, device=world.device)
            ctx(x, w, out=out)
            ctx.synchronize()
            ref = gemv_all_reduce_reference(x, w, world.group)
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            outs = world.all_gather_object(out.cpu())
            same = all(torch.equal(o.view(torch.uint8), outs[0].view(torch.uint8)) for o in outs)
            fused = _time(lambda: ctx(x, w, out=out), world, on_gpu)
            seq = _time(lambda: gemv_all_reduce_reference(x, w, world.group, False), world, on_gpu)
            # (the K computed: K's shares, K rounded down to a multiple of the ranks)
            shape = f"{M}x{N}x{Kl * world.world_size}"
            rows.append((shape, str(dt).replace("torch.", ""), err, same, fused, seq,
                         ctx.choice(x, w)))
    ctx.close()
    return rows


def _time(fn, world, on_gpu: bool, iters: int = 50) -> float:
    """Median microseconds of plain launches (the slowest rank's), by the benchmark protocol."""
    from .schedule.tuning import time_call

    return time_call(fn, world, iters=iters if on_gpu else 3, warmup=3 if on_gpu else 1,
                     host_bound=True) * 1e3


def _gpu_rank(rank: int, size: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import torch.distributed as dist

    from .world import World

    world = World.from_torchrun()
    rows = _demo_rank(world)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _print(rows, where: str, ranks: int) -> bool:
    print(f"\nfused GEMV + AllReduce, {ranks} ranks on {where}: y = sum_r x_r @ W_r^T, "
          f"K split over the ranks")
    print(f"{'M x N x K':>14} {'dtype':>9} {'rel err':>9} {'same bits':>9} "
          f"{'fused us':>10} {'torch+coll us':>13}  transport")
    ok = True
    for shape, dt, err, same, fused, seq, transport in rows:
        good = err < (1e-2 if dt != "float32" else 1e-5) and same
        ok &= good
        print(f"{shape:>14} {dt:>9} {err:9.1e} {str(same):>9} {fused:10.1f} {seq:13.1f}  "
              f"{transport}{'' if good else '   <-- WRONG'}")
    if where.startswith("CPU"):
        print("(CPU-emulated: the Triton interpreter runs the real kernels; times are not GPU "
              "times)")
    print("correct on every rank" if ok else "SOME RESULTS ARE WRONG")
    return ok


def collect_rows(q, procs, limit_s: float, poll_s: float = 1.0):
    """Rank 0's rows from ``q`` once every process of ``procs`` has ended well. A rank that
    dies or raises ends the wait at once (its peers, waiting for it in NCCL, are then
    terminated) with a ``RuntimeError`` naming it, instead of the whole ``limit_s``; past
    ``limit_s`` every process is terminated and ``TimeoutError`` raised."""
    deadline = time.monotonic() + limit_s
    rows = None
    try:
        while True:
            if rows is None:
                try:
                    rows = q.get(timeout=poll_s)
                except _queue.Empty:
                    pass
            failed = [(r, p.exitcode) for r, p in enumerate(procs)
                      if p.exitcode not in (None, 0)]
            if failed:
                r, code = failed[0]
                raise RuntimeError(f"demo rank {r} exited with code {code} (its traceback is "
                                   f"above); the other ranks were stopped")
            if all(p.exitcode == 0 for p in procs):
                if rows is None:  # rank 0 may have put them just before it ended
                    try:
                        rows = q.get(timeout=poll_s)
                    except _queue.Empty:
                        raise RuntimeError("every demo rank ended, but rank 0 sent no "
                                           "rows") from None
                return rows
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo's ranks did not end within {limit_s:g} s")
            if rows is not None:
                time.sleep(min(poll_s, 0.1))
    except BaseException:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        raise
    finally:
        for p in procs:
            p.join(timeout=60)


def run_demo(force_cpu: bool = False, ranks: int = 2) -> int:
    """The demo on ``ranks`` GPUs where there are that many (and not ``force_cpu``), else on as
    many CPU-emulated ranks; 0 when every result is right, else 1."""
    # zero ranks passed the GPU test on any machine (n_gpu >= 0) and waited for rows from no
    # process until the queue's timeout
    check_sizes("demo", ranks=ranks)
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not force_cpu and n_gpu >= ranks:
        import torch.multiprocessing as mp

        from .world import _free_port

        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_gpu_rank, args=(r, ranks, port, q)) for r in range(ranks)]
        for p in procs:
            p.start()
        rows = collect_rows(q, procs, limit_s=600)
        return 0 if _print(rows, f"{ranks} GPUs ({torch.cuda.get_device_name(0)})", ranks) else 1
    from .testing.emulated import MAX_RANKS, EmulatedWorld

    if ranks > MAX_RANKS:
        raise ValueError(f"demo: {ranks} CPU-emulated ranks asked for (more than the "
                         f"{n_gpu} GPUs here); at most {MAX_RANKS} run on one machine")
    with EmulatedWorld(ranks) as ew:
        rows = ew.run(_demo_rank, timeout=900)[0]
    return 0 if _print(rows, "CPU-emulated ranks", ranks) else 1
