"""The seeded fault campaign (portable_overlap.testing.campaign) on 2 and 4 emulated ranks:
valid calls of every op through every transport that runs here, at drawn shapes, mixed with
faults; no rank may return a wrong result, raise later than twice its timeout, end a call in a
way the campaign's table forbids, or leave a segment or file descriptor behind. The seed is
printed; ``PO_CAMPAIGN_SEED`` replays one."""
import os

import pytest

import portable_overlap as po
from portable_overlap.testing.campaign import call_clock, late_errors, leftovers, run_campaign

#: steps per world size: about 195 faulted calls per run together (fault rate 0.65; a fault
#: with nothing to act on, such as another shape where no size is left to change, is a valid
#: call), so that no run falls short of 0.4 of its steps
STEPS = {2: 200, 4: 120}
#: the contexts' timeout per world size: under the interpreter a valid call takes up to 0.5 s
#: of a rank's CPU time on 4 ranks (0.9 s of wall time with four ranks on two cores), and a
#: wait must outlast a peer's whole call; with 1 s a busy peer was taken for a lost one. The
#: agreements of "auto" and the agreeing transports wait as long (the interpreter compiles
#: nothing for a new shape, which their 60 s floor leaves time for on a GPU)
TIMEOUT_S = {1: 1.0, 2: 1.5, 4: 3.0}


def _campaign(world, seed, steps):
    t = TIMEOUT_S[world.world_size]
    tally = run_campaign(world, seed, steps, timeout_s=t, agreement_s=t)
    tally["leftovers"] = leftovers()
    return tally


def test_fault_campaign(world, request):
    seed = int(os.environ.get("PO_CAMPAIGN_SEED", 0)) or int.from_bytes(os.urandom(3), "little")
    steps = STEPS[world.size]
    print(f"fault campaign: {world.size} ranks, seed {seed}, {steps} steps")
    tallies = world.run(_campaign, seed, steps, timeout=540)
    faulted = tallies[0]["faulted"]
    print(f"fault campaign: seed {seed}: {faulted} faulted of {tallies[0]['calls']} calls per "
          f"rank, by fault {tallies[0]['by_fault']}, by op and transport "
          f"{tallies[0]['by_transport']}")
    summary = getattr(request.config, "po_campaign", [])
    summary.append(f"{world.size} ranks, seed {seed}: {faulted} faulted calls of "
                   f"{tallies[0]['calls']} per rank; {tallies[0]['by_fault']}")
    request.config.po_campaign = summary
    problems = []
    for rank, t in enumerate(tallies):
        problems += t["wrong"] + t["late"] + t["unexpected"]
        problems += [f"rank {rank}: left behind {x}" for x in t["leftovers"]]
    assert not problems, f"seed {seed}:\n" + "\n".join(problems[:40])
    assert faulted >= 0.4 * steps
    # every op of po.OPS is drawn (8 ops over 120-200 steps)
    reached = {k.split("[")[0] for k in tallies[0]["by_transport"]}
    assert reached == set(po.OPS), (seed, sorted(set(po.OPS) - reached))


def test_late_errors_take_the_work_from_the_whole_run():
    """A timeout is late past twice its bound plus twice the longest valid call of its op,
    wherever in the run that call came: at an op's first call (no valid call before it) the
    call's own work under the interpreter is not taken for a late error (8 ranks on 2 cores:
    55 s for a 15 s bound, behind 20 s of the call's own tiles)."""
    first = ("step 5 gemv_all_reduce[one_shot]", ("gemv_all_reduce", "one_shot"), 55.0, 15.0, "m")
    assert late_errors([first], {}) and "after 55.00 s" in late_errors([first], {})[0]
    # a valid call later in the run of the same op (any transport) measures the work
    assert late_errors([first], {"gemv_all_reduce": 12.0}) == []
    assert late_errors([first], {("gemv_all_reduce", "one_shot"): 12.0}) == []
    # another op's work excuses nothing, and a timeout past even that bound is late
    assert len(late_errors([first], {"moe_dispatch": 60.0})) == 1
    assert len(late_errors([first], {"gemv_all_reduce": 5.0})) == 1
    assert late_errors([first[:2] + (30.0,) + first[3:]], {}) == []


def test_calls_are_judged_on_the_clock_the_waits_are_bounded_by():
    """Under the interpreter a wait's bound is the rank's CPU time (backends/device_clock.py):
    with 8 emulated ranks on 2 cores, 7 ranks spinning for a missing peer stretch a 15 s bound
    to 75-140 s of wall time. The campaign judges those calls on CPU time there, on GPUs on
    the wall clock."""
    import time
    import types

    cpu = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    gpu = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    assert call_clock(cpu) == ("CPU", time.process_time)
    assert call_clock(gpu) == ("wall", time.monotonic)
    [msg] = late_errors([("w", ("op", "t"), 40.0, 15.0, "m")], {}, "CPU")
    assert "40.00 s of CPU time" in msg


def _die_mid_call(world, victim, timeout_s):
    """Every rank makes a valid call (on a context of its own, to time the work); then
    ``victim`` kills itself (SIGKILL) from inside its next call, after its kernel's first
    program started (the interpreter runs the kernel in this thread: a timer ends the process
    part-way through). The others report how that call ended and how long it took."""
    import signal
    import threading
    import time

    import torch

    from portable_overlap import GemvAllReduce, PortableOverlapError

    g = torch.Generator().manual_seed(world.rank)
    x, w = torch.randn(4, 64, generator=g), torch.randn(256, 64, generator=g)
    warm = GemvAllReduce(world, max_n=256, timeout_s=120.0)  # the ranks may come seconds apart
    t0 = time.monotonic()
    warm(x, w)
    work = time.monotonic() - t0
    warm.close()
    ctx = GemvAllReduce(world, max_n=256, timeout_s=timeout_s)
    if world.rank == victim:
        threading.Timer(work / 3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        ctx(x, w)
        outcome = "returned"
    except PortableOverlapError as e:
        outcome = f"{type(e).__name__}: {e}"
    if world.rank == victim:
        time.sleep(60)  # the timer ends this process
    return outcome, time.monotonic() - t0, work


def test_rank_killed_mid_call_gives_a_bounded_error_and_leaks_nothing():
    from portable_overlap.testing import EmulatedWorld, WorkerHang

    timeout_s = 1.0
    ew = EmulatedWorld(2)
    try:
        with pytest.raises(WorkerHang, match=r"ranks \[1\] died") as info:
            ew.run(_die_mid_call, 1, timeout_s, timeout=120)
        status, answer = info.value.answers[0]  # the survivor answered: it did not hang
        assert status == "ok", answer
        outcome, took, work = answer
        # killed before its partials left, the survivor times out; killed after, it may finish
        assert outcome == "returned" or outcome.startswith("PeerTimeoutError"), outcome
        # bounded by the deadline and the call's own work, with room for a loaded host (its
        # interpreter's work then varies by half between calls); a hang would be the
        # victim's 60 s
        assert took <= 2 * timeout_s + 3 * work + 2, (took, work, outcome)
    finally:
        ew.close(force=True)
    # the segments are anonymous: nothing of either process outlives it
    shm = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    assert not [f for f in shm for pid in ew.pids if f.startswith(f"portable_overlap_{pid}_")]


@pytest.mark.emulated(ranks=1)
def test_fault_campaign_on_one_rank(monkeypatch):
    """A world of one has no peer to disagree with: the campaign draws no 'other shape' fault
    there (on one H100 such a call returned its own shape's right result, which the table
    counted as wrong), and everything else holds as on more ranks."""
    from portable_overlap.testing import run_on_ranks

    monkeypatch.delenv("RANK", raising=False)
    seed = int(os.environ.get("PO_CAMPAIGN_SEED", 0)) or int.from_bytes(os.urandom(3), "little")
    [t] = run_on_ranks(_campaign, seed, 30, ranks=1)
    assert "other_shape" not in t["by_fault"], (seed, t["by_fault"])
    problems = t["wrong"] + t["late"] + t["unexpected"] + t["leftovers"]
    assert not problems, f"seed {seed}:\n" + "\n".join(map(str, problems[:40]))
