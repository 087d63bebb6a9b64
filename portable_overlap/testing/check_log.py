"""The results of a GPU check script (tests/gpu/): each check records a line as it runs (rank 0
prints it at once, so a hang still shows how far the run got), and the script ends with the
table and one summary line over every rank, which ci/gpu.sh greps."""
from __future__ import annotations

import os


class CheckLog:
    """``record(name, ok, detail)`` per check; ``finish(world, title)`` at the end. ``width``
    pads the names in the printed lines."""

    def __init__(self, width: int = 45):
        self.width = width
        self.results: list = []  # (name, ok, detail)

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append((name, bool(ok), detail))
        if os.environ.get("RANK", "0") == "0":
            print(f"[rank 0] {'PASS' if ok else 'FAIL'}  {name:{self.width}s} {detail}",
                  flush=True)

    def finish(self, world, title: str) -> int:
        """Collective: print (rank 0) every result and ``"<title>: P passed, F failed (all
        ranks)"``, destroy the process group, and return the exit status (1 if a check failed
        on any rank)."""
        import torch.distributed as dist

        all_failed = world.all_gather_object(sum(not ok for _, ok, _ in self.results))
        if world.rank == 0:
            for name, ok, detail in self.results:
                print(f"{'PASS' if ok else 'FAIL'}  {name:{self.width}s} {detail}", flush=True)
            print(f"{title}: {sum(ok for _, ok, _ in self.results)} passed, {sum(all_failed)} "
                  f"failed (all ranks)", flush=True)
        dist.destroy_process_group()
        return 1 if sum(all_failed) else 0
