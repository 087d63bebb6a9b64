"""portable_overlap.collectives: the reduce-scatter and all-gather under the installed torch's
name for them, right on 2 emulated ranks and without the FutureWarning that torch 2.13 gives
at every call of the older names; no other module calls the older names."""
import os
import re
import warnings

import torch

import portable_overlap as po
from portable_overlap import collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_NAMES = re.compile(r"\.(reduce_scatter_tensor|all_gather_into_tensor)\(")


def _collectives_and_sequential_ops(world):
    W, r = world.world_size, world.rank
    g = torch.Generator().manual_seed(7 + r)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name fails the call
        x = torch.randn(2 * W, 3, generator=g)
        every = [None] * W
        torch.distributed.all_gather_object(every, x, group=world.group)
        total = sum(every)
        block = torch.full((2, 3), float("nan"))
        collectives.reduce_scatter(block, x, group=world.group)
        gathered = torch.full((2 * W * W, 3), float("nan"))
        collectives.all_gather(gathered, x, group=world.group)
        ok = [torch.allclose(block, total[2 * r:2 * r + 2], atol=1e-6),
              torch.equal(gathered, torch.cat(every))]
        # the sequential transports call them too
        a, b = torch.randn(2 * W, 5, generator=g), torch.randn(5, 4, generator=g)
        with po.MatmulReduceScatter(world, 2 * W, 4, transport="sequential") as ctx:
            y = po.matmul_reduce_scatter(a, b, ctx)
        ok.append(torch.allclose(y, po.matmul_reduce_scatter_reference(a, b, world.group),
                                 atol=1e-5))
        with po.AllGatherMatmul(world, 2 * 5, transport="sequential") as ctx:
            y = ctx(a[:2], b)
        ok.append(torch.allclose(y, po.all_gather_matmul_reference(a[:2], b, world.group),
                                 atol=1e-5))
    return ok


def test_collectives_are_right_and_warn_of_nothing(world2):
    assert world2.run(_collectives_and_sequential_ops) == [[True] * 4] * 2


def test_no_module_calls_the_older_names():
    """Only portable_overlap/collectives.py names them (its fallback for older torch)."""
    found = []
    for top in ("portable_overlap", "benchmarks", "examples", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)
                if not f.endswith(".py") or rel == os.path.join("portable_overlap",
                                                                  "collectives.py"):
                    continue
                with open(path) as fh:
                    for n, line in enumerate(fh, 1):
                        if OLD_NAMES.search(line) and "OLD_NAMES" not in line:
                            found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
