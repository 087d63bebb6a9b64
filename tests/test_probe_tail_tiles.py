"""``benchmarks/probe_tail_tiles.py`` on the CPU: its tile table covers every row of every
column block once, and its kernel (narrow last tiles, static and dynamic order) computes the
gated expert GEMM of the reference, on a NaN-poisoned output, in Triton's interpreter."""
import pytest
import torch

from benchmarks.probe_tail_tiles import (Variant, make_case, parse_cases, reference, tile_table,
                                         variants)


@pytest.mark.parametrize("rows,block_t", [([515, 514], 16), ([515, 514], 128), ([7, 0, 64], 8)])
def test_tile_table_covers_each_row_once(rows, block_t):
    width, bn = 300, 128
    seen = torch.zeros(sum(rows), -(-width // bn), dtype=torch.int32)
    starts = [sum(rows[:e]) for e in range(len(rows))]
    for e, r0, n, col in tile_table(rows, width, 128, block_t, bn):
        assert n <= (128 if n > block_t else block_t)
        assert starts[e] <= r0 and r0 + n <= starts[e] + rows[e]  # inside its expert's rows
        seen[r0:r0 + n, col] += 1
    assert bool((seen == 1).all())


def _kernel_errors(world):
    """(variant, relative error) of every variant of the probe's kernel on this rank (an
    emulated rank: the interpreter), at the interpreter's sizes: 32-row tiles, narrow ones of
    16 or 8 rows."""
    rows, H, width = [37, 20, 5], 32, 48
    x, wg, wu, h = make_case(H, width, rows, torch.device("cpu"), seed=world.rank)
    ref = reference(x, wg, wu, rows)
    errs = []
    for name, _, bt, dyn, first in variants(block_ts=(32, 16)):
        v = Variant(x, wg, wu, h, rows, 32, 32 if bt == 128 else bt // 2, dyn, first,
                    programs=3, block_n=16, block_k=16, warps=1, stages=1)
        h.fill_(float("nan"))
        got = v().float()
        errs.append((name, ((got - ref).norm() / ref.norm()).item()))
    return errs


def test_kernel_matches_the_reference(world2):
    for errs in world2.run(_kernel_errors):
        assert len(errs) == 10 and all(e < 1e-2 for _, e in errs), errs


def test_parse_cases():
    want = [(7168, 2048, [515, 514]), (4096, 14336, [256])]
    assert parse_cases("7168,2048,515/514; 4096,14336,256") == want
