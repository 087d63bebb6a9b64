"""The embedding op's device-side index check (ops/embedding_alltoall/pool.py:
``indices_outside``, and ``first_outside`` for the report) on its own, run by the Triton
interpreter on an emulated rank: ranges that start and end off the scan's 512-index steps, span
several steps, are empty, and hold negative, too-large and exactly-``n_rows`` indices."""
import torch
import triton
import triton.language as tl

from portable_overlap.ops.embedding_alltoall.pool import first_outside, indices_outside


@triton.jit
def _outside_kernel(idx_ptr, ranges_ptr, n_rows, out_ptr):
    pid = tl.program_id(0)
    lo = tl.load(ranges_ptr + 2 * pid)
    hi = tl.load(ranges_ptr + 2 * pid + 1)
    n_bad = indices_outside(idx_ptr, lo, hi, n_rows)
    bad = first_outside(idx_ptr, lo, hi, n_rows)
    tl.store(out_ptr + 2 * pid, n_bad.to(tl.int64))
    tl.store(out_ptr + 2 * pid + 1, bad)


ROWS = 1000
BAD = {17: -1, 600: ROWS, 1500: 2 ** 40, 1501: -(2 ** 63), 2999: -7}
RANGES = [(0, 16), (0, 18), (5, 600), (5, 601), (513, 1600), (1502, 2999), (0, 3000),
          (100, 100), (1400, 1500), (2999, 3000), (600, 601)]


def _run(world, idx_dtype):
    gen = torch.Generator().manual_seed(11 + world.rank)
    idx = torch.randint(0, ROWS, (3000,), generator=gen)
    idx[0], idx[1] = 0, ROWS - 1  # the edges of the table are inside
    for p, v in BAD.items():
        if idx_dtype == torch.int32:
            v = max(min(v, 2 ** 31 - 1), -(2 ** 31))
        idx[p] = v
    idx = idx.to(idx_dtype)
    ranges = torch.tensor(RANGES, dtype=torch.int64).reshape(-1)
    out = torch.full((2 * len(RANGES),), -99, dtype=torch.int64)  # poisoned
    _outside_kernel[(len(RANGES),)](idx, ranges, ROWS, out)
    return idx, out.view(-1, 2)


def test_indices_outside_counts_every_bad_index_and_first_outside_finds_the_first(world2):
    for idx_dtype in (torch.int64, torch.int32):
        for idx, out in world2.run(_run, idx_dtype):
            for (lo, hi), (n_bad, bad) in zip(RANGES, out.tolist()):
                inside = idx[lo:hi].long()
                wrong = inside[(inside < 0) | (inside >= ROWS)]
                assert n_bad == wrong.numel(), (idx_dtype, lo, hi, n_bad)
                if wrong.numel():
                    assert bad == wrong[0].item(), (idx_dtype, lo, hi, bad)
                else:
                    assert bad == 0, (idx_dtype, lo, hi, bad)
