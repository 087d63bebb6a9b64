"""Call tags: what a call's flags carry so that ranks called differently are caught, and how a
tag is told back in plain words when they are.

A tag is a 31-bit hash of the fields that must agree across ranks (shapes, dtype, tiling, grid).
A kernel that finds a peer's tag different from its own records both tags; the host then turns
each tag back into the fields it was made from: its own from this process's record
(:func:`shape_tag` keeps one per tag), the peer's from the peer, which publishes its own
description in the process group's key-value store when it raises for the same call.
"""
from __future__ import annotations

import datetime
import functools
import zlib
from typing import Optional

from ..shmem.device import TAG_MASK

#: how many tags this process remembers the fields of (the newest ones)
_KEEP = 1 << 16
_fields: dict = {}
#: how long a rank that found a mismatch waits for a peer's description of its call (seconds);
#: the peer publishes it when it raises for the same call, usually within milliseconds
DESCRIBE_WAIT_S = 5.0
_KEY = "portable_overlap/call_tag/{:08x}"


@functools.lru_cache(maxsize=1024)
def shape_tag(*fields, **named) -> int:
    """The tag a call's flags carry (shmem.device): a hash of what must agree across ranks
    (shapes, dtype, tiling, grid), so a peer called or planned differently is caught. Fields
    given by name are named in the error that reports a mismatch (``x=(M, K)`` reads "x [M, K]").
    Cached: the per-call paths ask for it on every call."""
    tag = zlib.crc32(repr((fields, sorted(named.items()))).encode()) & TAG_MASK
    if len(_fields) >= _KEEP:
        _fields.pop(next(iter(_fields)))
    _fields[tag] = (fields, named)
    return tag


def tag_with(tag: int, **more) -> int:
    """The tag of the fields ``tag`` was made from (by :func:`shape_tag` in this process) with
    the named fields ``more`` added: a per-call variant of a plan's tag (a call's flags then
    carry what that call adds, and a mismatch names it). ``tag`` itself where this process
    no longer holds its fields."""
    got = _fields.get(tag)
    if got is None:
        return tag
    fields, named = got
    return shape_tag(*fields, **{**named, **more})


def _plain(value) -> str:
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, str):
        return value.replace("torch.", "")
    return str(value)


def describe_tag(tag: int, op: Optional[str] = None) -> Optional[str]:
    """The fields ``tag`` was made from in this process, in plain words (``op`` itself left
    out), or None if this process never made it (or forgot it)."""
    got = _fields.get(tag)
    if got is None:
        return None
    fields, named = got
    words = [_plain(f) for f in fields if f != op]
    words += [f"{k} {_plain(v)}" if isinstance(v, (tuple, list)) else f"{k}={_plain(v)}"
              for k, v in named.items()]
    return ", ".join(words) if words else "no arguments"


def _store(world):
    """The process group's key-value store, or None (no process group: nothing to ask)."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def publish(world, tag: int, op: Optional[str] = None) -> None:
    """Make this process's description of ``tag`` readable by the peers (best effort: an error
    report must not fail on it)."""
    text = describe_tag(tag, op)
    store = _store(world)
    if text is None or store is None:
        return
    try:
        store.set(_KEY.format(tag), text)
    except Exception:
        pass


def fetch(world, tag: int, wait_s: float, op: Optional[str] = None) -> Optional[str]:
    """The description of ``tag``: this process's own, else what a peer published, waiting up
    to ``wait_s`` seconds for it; None if none came."""
    text = describe_tag(tag, op)
    if text is not None:
        return text
    store = _store(world)
    if store is None:
        return None
    key = _KEY.format(tag)
    try:
        store.wait([key], datetime.timedelta(seconds=max(wait_s, 0.001)))
        return store.get(key).decode()
    except Exception:
        return None


def mismatch_message(op: str, rank: int, own: Optional[str], peers: dict,
                     differ: Optional[list] = None) -> str:
    """One message for ranks that called ``op`` with different arguments: ``own`` is this
    rank's description, ``peers`` maps each disagreeing rank to its description (None: it did
    not arrive); ``differ`` names the fields that differ, where known."""
    ranks = sorted([rank, *peers])
    names = ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
    lines = [f"{op}: ranks {names} called it with different shapes or settings (this rank is "
             f"{rank}):"]
    for r in ranks:
        text = own if r == rank else peers[r]
        if text is None:
            text = ("(its arguments could not be read here)" if r == rank else
                    "(its arguments did not reach this rank in time)")
        lines.append(f"  rank {r}: {text}")
    if differ:
        lines.append(f"  they differ in: {', '.join(differ)}")
    return "\n".join(lines)


def explain_mismatch(world, op: str, rank: int, pairs: dict, wait_s: float) -> str:
    """The message for the kernel-found mismatches ``pairs`` (peer rank -> (its tag, this
    rank's tag)). Publishes this rank's own description first, so a peer explaining the same
    call finds it."""
    own_tag = next(iter(pairs.values()))[1]  # one call: one tag on this rank
    publish(world, own_tag, op)
    own = describe_tag(own_tag, op)
    peers = {q: fetch(world, theirs, wait_s, op) for q, (theirs, _) in sorted(pairs.items())}
    return mismatch_message(op, rank, own, peers, differing(own, list(peers.values())))


def differing(own: Optional[str], others: list) -> list:
    """The named fields whose values differ between the description ``own`` and any of
    ``others`` (descriptions, None where unknown), a field named in one known description and
    not in the other included (a per-call field such as ``records_grad``, given where set)."""
    mine = dict(_split(own))
    out = []
    for text in others:
        theirs = dict(_split(text))
        if own is None or text is None:
            continue
        out += [k for k in dict.fromkeys([*mine, *theirs])
                if mine.get(k) != theirs.get(k) and k not in out]
    return out


def _split(text: Optional[str]) -> list:
    """``[(name, value)]`` of a description's named fields (``name=value`` / ``name [..]``)."""
    if not text:
        return []
    out = []
    for part in _parts(text):
        for sep in ("=", " "):
            if sep in part:
                k, v = part.split(sep, 1)
                if k.isidentifier():
                    out.append((k, v))
                break
    return out


def _parts(text: str) -> list:
    """A description split at its top-level commas (not those inside brackets)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[({") - (ch in "])}")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts
