"""The status board: host-visible words where a kernel records why a program gave up.

Each program owns a 4-word slot (code, peer, what, expected) and writes it with plain stores, so
the host reads it at any time without a device sync (pinned, mapped memory on GPUs). Ops check
it at the start of every eager call and in :meth:`StatusBoard.raise_if_failed`."""
from __future__ import annotations

from typing import Callable, Optional

from ..errors import InvalidInputError, PeerTimeoutError, RankMismatchError
from .device import STATUS_MISMATCH as _MISMATCH
from .device import STATUS_BAD_INPUT as _BAD_INPUT
from .device import STATUS_PEER_FAILED as _PEER_FAILED
from .device import STATUS_TIMEOUT as _TIMEOUT
from .device import REPORT_COUNT as _COUNT

STATUS_TIMEOUT = int(_TIMEOUT.value)
STATUS_MISMATCH = int(_MISMATCH.value)
STATUS_PEER_FAILED = int(_PEER_FAILED.value)
STATUS_BAD_INPUT = int(_BAD_INPUT.value)
_COUNT_BIT = int(_COUNT.value)


class StatusBoard:
    """A header slot (word 0 goes to 1 when any program reports) and one slot per program."""

    def __init__(self, backend, slots: int):
        self.slots = slots
        self._mem = backend.alloc_host_mapped((slots + 1) * 4 * 8)
        self._all = self._mem.tensor[: (slots + 1) * 4].view(slots + 1, 4)
        self.words = self._all[1:]
        self._header = self._all.numpy()[0]  # a numpy view: reading it costs no torch dispatch
        self.address = self._mem.device_address

    def failed(self) -> bool:
        return bool(self._header[0])

    def has(self, code: int) -> bool:
        """Whether any program reported ``code``."""
        return bool((self.words[:, 0] == code).any())

    def clear(self) -> None:
        """Forget every report (once they were raised and the ranks are still in step)."""
        self.words.zero_()
        self._header[0] = 0

    def describe(self, op: str, rank: int, what_names: dict) -> list[tuple[int, str]]:
        out = []
        for pid in self.words[:, 0].nonzero().flatten().tolist():
            code, peer, what, expected = self.words[pid].tolist()
            flag = what_names.get(what >> 32, f"flag kind {what >> 32}")
            index = what & 0xFFFFFFFF
            # a wait for this rank's own word waits for another program of the same launch,
            # which never comes where programs run one after another or the grid is not
            # resident: "rank r never arrived" would send the user after a healthy rank
            why = ("this rank's own flag: where another program of the same launch sets it, "
                   "the wait needs every program resident at once (at most ws.sm_count, "
                   "never under the CPU interpreter)" if peer == rank else
                   f"rank {peer} never arrived (did it skip this call, or crash?)")
            if code == STATUS_TIMEOUT and (expected >> _COUNT_BIT) & 1:  # pol.wait_count
                who = f"rank {peer}" if peer >= 0 else "its peers"
                if peer != rank:
                    why = "a notify never arrived (did a peer skip this call, or crash?)"
                msg = (f"{op}: rank {rank} program {pid} timed out waiting for the {flag} "
                       f"counter [{index}] to reach {expected & ((1 << _COUNT_BIT) - 1)} "
                       f"(counted by {who}); {why}")
            elif code == STATUS_TIMEOUT:
                msg = (f"{op}: rank {rank} program {pid} timed out waiting for rank {peer}'s "
                       f"{flag} flag [{index}] of call #{expected}; {why}")
            elif code == STATUS_PEER_FAILED:
                msg = (f"{op}: rank {rank} program {pid}: rank {peer} gave up on call "
                       f"#{expected & 0xFFFFFFFF} "
                       f"(its {flag} flag says so; it raises its own error) — this rank's "
                       f"output of that call is not valid")
            elif code == STATUS_MISMATCH:
                msg = (f"{op}: rank {rank}: rank {peer} called with different shapes or "
                       f"settings (its call tag {expected >> 32:#x}, this rank's "
                       f"{expected & 0xFFFFFFFF:#x})")
            elif code == STATUS_BAD_INPUT:
                # ``what`` names the check (its kind) and an index, ``expected`` the bad value
                msg = (f"{op}: rank {rank} program {pid}: invalid {flag} [{index}]: got "
                       f"{expected}" + (f" (from rank {peer})" if peer >= 0 else ""))
            else:
                msg = f"{op}: rank {rank} program {pid}: status code {code}"
            out.append((code, msg))
        return out

    def mismatches(self) -> dict:
        """``{peer: (the peer's call tag, this rank's)}`` of the programs that found a peer
        called with other shapes (one entry per peer: every program of a call has its tags)."""
        out = {}
        for pid in (self.words[:, 0] == STATUS_MISMATCH).nonzero().flatten().tolist():
            _, peer, _, tags = self.words[pid].tolist()
            out.setdefault(peer, (tags >> 32, tags & 0xFFFFFFFF))
        return out

    def own_tags(self) -> set:
        """This rank's call tags of the reports that carry one (a peer called with other
        shapes, or gave up): the calls a peer may want described."""
        out = set()
        for pid in self.words[:, 0].nonzero().flatten().tolist():
            code, _, _, word = self.words[pid].tolist()
            if code == STATUS_MISMATCH:
                out.add(word & 0xFFFFFFFF)
            elif code == STATUS_PEER_FAILED:
                out.add(word >> 32)
        return out

    def raise_if_failed(self, op: str, rank: int, what_names: dict,
                        explain: Optional[Callable[[dict], str]] = None) -> None:
        """Raise the error the programs reported, if any. A mismatch (peers called with other
        shapes) is told once, by ``explain(self.mismatches())`` when given (which ranks
        disagree and what each passed), instead of once per program."""
        if not self.failed():
            return
        # the programs that found the cause first; "a peer gave up" lines only echo a cause;
        # a line several programs report is told once
        found = sorted(self.describe(op, rank, what_names),
                       key=lambda f: f[0] == STATUS_PEER_FAILED)
        codes = {c for c, _ in found}
        head = f"{op} failed on rank {rank}:"
        if STATUS_MISMATCH in codes and explain is not None:
            head = explain(self.mismatches())
            found = [f for f in found if f[0] not in (STATUS_MISMATCH, STATUS_PEER_FAILED)]
        unique = list(dict.fromkeys(m for _, m in found))
        lines = "".join(f"\n  {m}" for m in unique[:8])
        more = f"\n  (+{len(unique) - 8} more)" if len(unique) > 8 else ""
        cls = (InvalidInputError if STATUS_BAD_INPUT in codes else
               RankMismatchError if STATUS_MISMATCH in codes else PeerTimeoutError)
        # (a peer that gave up is reported as a timeout-class error: a peer went missing)
        raise cls(f"{head}{lines}{more}")
