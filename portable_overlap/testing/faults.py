"""Fault injection for tests of the fused ops: calls that some ranks skip."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

from ..errors import PeerTimeoutError


def call_while_peers_skip(world, make_ctx: Callable[[], object], call: Callable[[object], object],
                          caller: int = 0) -> str:
    """Collective: every rank makes a context (``make_ctx()``, with a short timeout), rank
    ``caller`` makes one ``call(ctx)`` that the other ranks skip, every rank closes the context.
    Returns, on ``caller``, the text of the ``PeerTimeoutError`` the call raised (``"no error"``
    if none did, ``"late: ..."`` if it came after twice the context's timeout); ``"ok"`` on the
    others. The error must name the rank that never came and the flag it was waited on for."""
    ctx = make_ctx()
    result = "ok"
    if world.rank == caller:
        t0 = time.monotonic()
        try:
            call(ctx)
            ctx.synchronize()
            result = "no error"
        except PeerTimeoutError as e:
            took = time.monotonic() - t0
            result = (str(e) if took <= 2 * ctx.timeout_s else
                      f"late: raised after {took:.2f} s, timeout_s={ctx.timeout_s}: {e}")
    ctx.close()
    return result


def error_of_one_call(make_ctx: Callable[[], object], call: Callable[[object], object]) -> str:
    """Collective: every rank makes a context, makes its own ``call(ctx)`` (the ranks' calls
    disagree on purpose: other shapes, other layouts), synchronizes and closes. Returns the
    name of the library error it raised (``"RankMismatchError"``, ``"PeerTimeoutError"``...),
    or ``"no error"``."""
    from ..errors import PortableOverlapError

    ctx = make_ctx()
    try:
        call(ctx)
        ctx.synchronize()
        result = "no error"
    except PortableOverlapError as e:
        result = type(e).__name__
    ctx.close()
    return result


def outcomes(ctx, calls: dict, within_s: float = 20.0) -> dict:
    """Each of ``calls`` (name -> a call on ``ctx``) made in turn, with ``ctx`` synchronized
    after it: name -> ``(error type name, message)``, ``("no error", "")`` for a call that
    returned. Every call (an error included) must end within ``within_s`` seconds: a call one
    rank refuses must fail its peers at once, not at their timeout."""
    found = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            ctx.synchronize()
            found[name] = ("no error", "")
        except Exception as e:
            found[name] = (type(e).__name__, str(e))
        elapsed = time.monotonic() - t0
        if elapsed >= within_s:
            raise AssertionError(f"{name}: took {elapsed:.1f} s (more than {within_s} s)")
    return found


def not_refused_together(refuser: dict, peer: dict, names, reason: str) -> list:
    """The calls among ``names`` (keys of two ranks' :func:`outcomes`) that one rank refused
    but its peer did not fail with it: the refusing rank must raise ``RuntimeError`` whose text
    holds ``reason``, the peer a ``PeerTimeoutError`` saying the refuser gave up. Empty when
    every such call was refused on both ranks."""
    return [n for n in names
            if not (refuser[n][0] == "RuntimeError" and reason in refuser[n][1]
                    and peer[n][0] == "PeerTimeoutError" and "gave up" in peer[n][1])]


def late_and_refused(world, ctx, calls, late: tuple, refused: tuple,
                     delay_s: float = 1.0, links_of: Optional[Callable] = None) -> list:
    """Collective: the calls of ``calls`` made in turn on ``ctx``, each synchronized; rank
    ``late[0]`` makes call ``late[1]`` ``delay_s`` late, and rank ``refused[0]`` makes the calls
    whose index is in ``refused[1]`` with bad input (refused on the host). ``calls[i](bad)``
    makes call ``i`` (with bad input when ``bad``) and returns a function that gives the
    relative error of its result once synchronized. Returns each call's outcome (``"no
    error"`` or the name of the exception it raised) and then the last call's relative error.
    With ``links_of`` (``ctx`` -> its copy-engine links) the late call's copies into the
    refusing rank land last (:func:`copies_last`), as a GPU's copy engine may land them.

    The scenario of the late-stores bug class: the peers fail a refused call before a late
    rank's stores of it landed, and a store transport must not let those stores land inside
    the next call's buffers (``OverlapContext.late_stores_guard``)."""
    found, error = [], None
    for i, call in enumerate(calls):
        is_late = (world.rank, i) == tuple(late)
        if is_late:
            time.sleep(delay_s)
        try:
            with (copies_last(links_of(ctx), refused[0]) if is_late and links_of is not None
                  else contextlib.nullcontext()):
                error = call(world.rank == refused[0] and i in refused[1])
            ctx.synchronize()
            found.append("no error")
        except Exception as e:
            error = None
            found.append(type(e).__name__)
    found.append(error() if error is not None else float("nan"))
    return found


def late_and_refused_per_shape(world, make_ctx: Callable[[], object], shapes, call: Callable,
                               late: tuple, refused: tuple, delay_s: float = 1.0,
                               links_of: Optional[Callable] = None) -> list:
    """:func:`late_and_refused` with one call per entry of ``shapes`` (a shape, or whatever
    call ``i`` needs, e.g. inputs made before: collective references would hold the ranks in
    step) on the context ``make_ctx()`` makes (closed at the end, whatever happens):
    ``call(ctx, i, shape, bad)`` makes call ``i`` and returns the function that gives its
    relative error."""
    ctx = make_ctx()
    try:
        return late_and_refused(
            world, ctx, [lambda bad, i=i, s=s: call(ctx, i, s, bad) for i, s in enumerate(shapes)],
            late, refused, delay_s, links_of)
    finally:
        ctx.close()


@contextlib.contextmanager
def copies_last(links, peer: int, delay_s: float = 1.0):
    """While open, the copies that ``links`` (``transports.copy_engine.CopyEngineLinks``) makes
    into rank ``peer`` (``put``: the copy and its ready flag) wait until the call joins its
    lanes (``rejoin``) and land ``delay_s`` after that: a copy engine that serves that lane
    last. Under the interpreter every copy runs when it is queued; this lets a test put a late
    rank's copies of a call after what its peers already did once they were done with it, as
    on a GPU, where the caller's stream is not ordered after the lanes until ``rejoin``."""
    held = []
    put, rejoin = links.put, links.rejoin

    def hold(d, *args, **kwargs):
        if d == peer:
            held.append((d, args, kwargs))
        else:
            put(d, *args, **kwargs)

    def release_held():
        if held:
            time.sleep(delay_s)
        for d, args, kwargs in held:
            put(d, *args, **kwargs)
        held.clear()
        rejoin()

    links.put, links.rejoin = hold, release_held
    try:
        yield
    finally:
        del links.put, links.rejoin


def construction_outcome(make: Callable[[], object]) -> tuple:
    """Build an object with ``make`` (a module or context whose construction is collective)
    and close it: ``("no error", "", 0.0)``, or the error's class name, message and the
    seconds it took to arrive (a peer that waits in a set-up shows as a slow error)."""
    t0 = time.monotonic()
    try:
        make().close()
        return ("no error", "", 0.0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)



def copy_errors(obj) -> list:
    """What ``copy.deepcopy(obj)`` and ``pickle.dumps(obj)`` raise: each ``TypeError``'s
    message, or ``"no error"`` (a fused layer must refuse both by name)."""
    import copy
    import pickle

    found = []
    for copier in (copy.deepcopy, pickle.dumps):
        try:
            copier(obj)
            found.append("no error")
        except TypeError as e:
            found.append(str(e))
    return found
