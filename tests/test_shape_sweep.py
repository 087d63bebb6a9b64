"""The randomized shape sweep (portable_overlap.testing.sweep) on 2, 3 and 4 emulated ranks: every
op through every transport that runs here, at drawn shapes, dtypes and layouts, against the
torch reference; and a check that a wrong result fails the sweep. Fixed seeds by default;
``PO_SWEEP_SEED=N`` runs seed N instead and ``PO_SWEEP_STEPS=S`` takes S steps per world."""
import os

import pytest

from portable_overlap.testing.sweep import run_sweep, summary

#: (seed, steps) per world size: about 85 s of CPU time for the file on two cores, world
#: start-ups included (the interpreter runs every kernel; a call takes 0.2 to 2 s of a rank's
#: time, more with more ranks)
RUNS = {2: (11, 10), 3: (23, 6), 4: (37, 4)}
#: the contexts' timeout: a wait must outlast a peer's whole call under the interpreter
TIMEOUT_S = 60.0


def _sweep(world, seed, steps):
    return run_sweep(world, seed, steps, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shape_sweep(size, request):
    world = request.getfixturevalue(f"world{size}")
    seed, steps = RUNS[size]
    seed = int(os.environ.get("PO_SWEEP_SEED", 0)) or seed
    steps = int(os.environ.get("PO_SWEEP_STEPS", 0)) or steps
    reports = world.run(_sweep, seed, steps, timeout=600)
    print(summary(reports))
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, f"seed {seed}, {steps} steps, {size} ranks:\n" + "\n".join(failures)
    assert all(len(r["steps"]) == steps for r in reports)


class _OffByABit:
    """Moves one element of the first non-empty result rank 1 gets by far more than any
    tolerance (a fresh copy on each rank: the state lives in the rank's process)."""

    def __init__(self):
        self.step = None

    def __call__(self, step, rank, result):
        t = result[0] if isinstance(result, tuple) else result
        if rank != 1 or self.step is not None or not t.numel():
            return result
        self.step = step
        t = t.clone()
        t.view(-1)[t.numel() // 2] += 0.5 + t.abs().max()
        return (t,) + tuple(result[1:]) if isinstance(result, tuple) else t


def _tampered(world):
    return run_sweep(world, 5, 4, ops=["matmul_all_reduce", "gemv_all_reduce"],
                     refuse_rate=0.0, timeout_s=TIMEOUT_S, tamper=_OffByABit())


def test_the_sweep_finds_a_wrong_result(world2):
    r0, r1 = world2.run(_tampered, timeout=300)
    assert not r0["failures"], r0["failures"]
    returned = [s for s in r1["steps"] if s["outcome"] == "returned" and s["err"] is not None]
    assert returned, r1["steps"]
    assert len(r1["failures"]) == 1, r1["failures"]
    failure, step = r1["failures"][0], next(s for s in r1["steps"] if s["why"])
    assert f"seed 5 step {step['step']} rank 1 of 2" in failure, failure
    assert "max error" in failure and f"{step['op']}[{step['transport']}]" in failure, failure
