"""The results of a GPU check script (tests/gpu/): each check records a line as it runs (rank 0
prints it at once, so a hang still shows how far the run got), and the script ends with the
table and one summary line over every rank, which ci/gpu.sh greps."""
from __future__ import annotations

import os


class CheckLog:
    """``record(name, ok, detail)`` per check, ``skip(name, why)`` for one this machine cannot
    run (neither passed nor failed); ``finish(world, title)`` at the end. ``width`` pads the
    names in the printed lines; ``prefix`` goes before every name recorded while it is set (the
    same checks run on another context)."""

    def __init__(self, width: int = 45):
        self.width = width
        self.prefix = ""
        self.results: list = []  # (name, ok: True / False / None for skipped, detail)

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        self._add(name, bool(ok), detail)

    def skip(self, name: str, why: str) -> None:
        self._add(name, None, why)

    def _add(self, name: str, ok, detail: str) -> None:
        name = self.prefix + name
        self.results.append((name, ok, detail))
        if os.environ.get("RANK", "0") == "0":
            print(f"[rank 0] {_verdict(ok)}  {name:{self.width}s} {detail}", flush=True)

    def finish(self, world, title: str) -> int:
        """Collective: print (rank 0) every result and ``"<title>: P passed, F failed (all
        ranks)"``, destroy the process group, and return the exit status (1 if a check failed
        on any rank)."""
        import torch.distributed as dist

        all_failed = world.all_gather_object(sum(ok is False for _, ok, _ in self.results))
        if world.rank == 0:
            for name, ok, detail in self.results:
                print(f"{_verdict(ok)}  {name:{self.width}s} {detail}", flush=True)
            skipped = sum(ok is None for _, ok, _ in self.results)
            print(f"{title}: {sum(ok is True for _, ok, _ in self.results)} passed, "
                  f"{sum(all_failed)} failed (all ranks)"
                  + (f", {skipped} skipped" if skipped else ""), flush=True)
        dist.destroy_process_group()
        return 1 if sum(all_failed) else 0


def _verdict(ok) -> str:
    return "SKIP" if ok is None else "PASS" if ok else "FAIL"
