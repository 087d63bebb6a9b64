"""The randomized shape sweep (portable_overlap.testing.sweep) on 2, 3 and 4 emulated ranks: every
op through every transport that runs here, at drawn shapes, dtypes and layouts, against the
torch reference; and a check that a wrong result fails the sweep. Fixed seeds by default;
``PO_SWEEP_SEED=N`` runs seed N instead and ``PO_SWEEP_STEPS=S`` takes S steps per world."""
import os

import pytest

from portable_overlap.testing.sweep import run_sweep, summary

#: (seed, steps) per world size: about 35 s of CPU time for the three together on two cores
#: (the interpreter runs every kernel; a call takes 0.2 to 2 s of a rank's time)
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


def _off_by_a_bit(step, rank, result):
    """One element of rank 1's result at step 1, moved by far more than any tolerance."""
    if step == 1 and rank == 1:
        result = tuple(t.clone() for t in result) if isinstance(result, tuple) else \
            result.clone()
        t = result[0] if isinstance(result, tuple) else result
        if t.numel():
            t.view(-1)[t.numel() // 2] += 0.5 + t.abs().max()
    return result


def _tampered(world):
    # GEMM ops only, and no invalid calls: step 1 is a valid call with a non-empty result
    return run_sweep(world, 5, 2, ops=["matmul_all_reduce", "gemv_all_reduce"],
                     refuse_rate=0.0, timeout_s=TIMEOUT_S, tamper=_off_by_a_bit)


def test_the_sweep_finds_a_wrong_result(world2):
    r0, r1 = world2.run(_tampered, timeout=300)
    assert not r0["failures"], r0["failures"]
    step = r1["steps"][1]
    dims = step["dims"]
    if dims.get("M") == 0:
        pytest.skip(f"the drawn call has an empty result: {step}")
    assert len(r1["failures"]) == 1, r1["failures"]
    failure = r1["failures"][0]
    assert "seed 5 step 1 rank 1 of 2" in failure and "max error" in failure, failure
    assert step["op"] in failure and step["transport"] in failure, failure
