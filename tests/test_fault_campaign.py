"""The seeded fault campaign (portable_overlap.testing.campaign) on 2 and 4 emulated ranks:
valid calls of every op mixed with faults; no rank may return a wrong result, raise later than
twice its timeout, end a call in a way the campaign's table forbids, or leave a segment or file
descriptor behind. The seed is printed; ``PO_CAMPAIGN_SEED`` replays one."""
import os

import pytest

from portable_overlap.testing.campaign import leftovers, run_campaign

#: steps per world size: together at least 200 faulted calls per run (fault rate 0.6)
STEPS = {2: 200, 4: 140}


def _campaign(world, seed, steps):
    tally = run_campaign(world, seed, steps)
    tally["leftovers"] = leftovers()
    return tally


def test_fault_campaign(world):
    seed = int(os.environ.get("PO_CAMPAIGN_SEED", 0)) or int.from_bytes(os.urandom(3), "little")
    steps = STEPS[world.size]
    print(f"fault campaign: {world.size} ranks, seed {seed}, {steps} steps")
    tallies = world.run(_campaign, seed, steps, timeout=1500)
    faulted = tallies[0]["faulted"]
    print(f"fault campaign: seed {seed}: {faulted} faulted of {tallies[0]['calls']} calls per "
          f"rank, by fault {tallies[0]['by_fault']}")
    problems = []
    for rank, t in enumerate(tallies):
        problems += t["wrong"] + t["late"] + t["unexpected"]
        problems += [f"rank {rank}: left behind {x}" for x in t["leftovers"]]
    assert not problems, f"seed {seed}:\n" + "\n".join(problems[:40])
    assert faulted >= 0.4 * steps
