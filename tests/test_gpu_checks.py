"""The GPU check script (tests/gpu/gpu_checks.py, run by ci/gpu.sh under torchrun, never
collected here) on the CPU: it imports, every check its ``main`` runs is defined, and the
device-independent parts of ``check_refresh`` (moving call numbers on, the refreshing calls,
the flag-word checks) run on CPU-emulated ranks, for two of its cases (the others' shapes are
sized for GPUs and take minutes under the interpreter)."""
import ast
import importlib.util
import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "tests", "gpu", "gpu_checks.py")


def _load():
    """The script as a module (it is not a package's: loaded from its path)."""
    spec = importlib.util.spec_from_file_location("gpu_checks", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main() -> ast.FunctionDef:
    """The script's ``main``, parsed."""
    return next(node for node in ast.parse(open(PATH).read()).body
                if isinstance(node, ast.FunctionDef) and node.name == "main")


def test_the_script_imports_and_its_main_runs_defined_checks():
    """Every ``check_*`` name ``main`` refers to is a function of the script, and
    ``check_refresh`` is among them."""
    module = _load()
    main = _main()
    named = {node.id for node in ast.walk(main)
             if isinstance(node, ast.Name) and node.id.startswith("check_")}
    assert "check_refresh" in named, sorted(named)
    assert all(callable(getattr(module, name, None)) for name in named), sorted(
        name for name in named if not callable(getattr(module, name, None)))


def test_scaleup_check_parts_cover_every_gpu_check():
    """ci/scaleup.sh's checks-ops, checks-moe and checks-rest parts name every check that
    ``main`` runs by name (PO_CHECKS), each once: a check added to the script and to none of
    the parts would never run on 4 or 8 GPUs."""
    text = open(os.path.join(ROOT, "ci", "scaleup.sh")).read()
    groups = re.findall(r"\n  checks-\w+\)[^\n]*\n    checks ([\w,]+)\n", text)
    named = [n for g in groups for n in g.split(",")]
    assert len(groups) == 3 and len(named) == len(set(named)), groups
    main = _main()
    # by name: the checks of a loop whose body tests the name against ``only``, and the names
    # main itself tests against ``only`` ("gemv", which runs a group of checks)

    def tests_only(node):
        return any(isinstance(n, ast.Name) and n.id == "only" for n in ast.walk(node))

    runs = {name.id[len("check_"):] for loop in ast.walk(main)
            if isinstance(loop, ast.For) and isinstance(loop.iter, ast.Tuple)
            and any(tests_only(n) for n in loop.body) for name in loop.iter.elts}
    runs |= {node.left.value for node in ast.walk(main) if isinstance(node, ast.Compare)
             and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)
             and any(isinstance(c, ast.Name) and c.id == "only" for c in node.comparators)}
    assert set(named) == runs, (sorted(runs - set(named)), sorted(set(named) - runs))


def _refresh_checks(world, names):
    """``check_refresh`` of the cases ``names`` on this rank: its recorded results."""
    module = _load()
    gen = torch.Generator(device=world.device).manual_seed(1000 + world.rank)
    module.check_refresh(world, gen, names)
    return module.LOG.results


def test_check_refresh_on_emulated_ranks(world2):
    """GEMV + AllReduce over stores (the peers' words) and the MoE dispatch (the scatter and
    the fused dispatch + gated GEMM on one context; this rank's own words too): every result
    recorded, every one passed, the flag words checked after the refreshing call."""
    names = ("gemv+allreduce[stores]", "moe_dispatch[stores]")
    for rank, results in enumerate(world2.run(_refresh_checks, names, timeout=300)):
        assert [ok for _, ok, _ in results] == [True] * 10, (rank, results)
        assert sum("every checked flag word" in name for name, _, _ in results) == 2, results
