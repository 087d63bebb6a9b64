"""What ``import portable_overlap`` offers: the drop-in modules at the top level, and the op
tables of the package docstring and README that list every op's transports."""
import os
import re

import portable_overlap
from portable_overlap import (ColumnParallelLinear, ExpertParallelMoE, RowParallelLinear,
                              ShardedEmbeddingBagCollection)
from portable_overlap import modules
from portable_overlap.ops.registry import SPECS


def test_modules_at_top_level():
    for cls in (ExpertParallelMoE, ShardedEmbeddingBagCollection, RowParallelLinear,
                ColumnParallelLinear):
        assert cls.__name__ in portable_overlap.__all__
        assert getattr(modules, cls.__name__) is cls


def test_every_module_exported():
    """Each drop-in module of ``portable_overlap.modules`` is also a top-level name."""
    assert set(modules.__all__) <= set(portable_overlap.__all__)
    assert all(getattr(portable_overlap, name) is getattr(modules, name)
               for name in modules.__all__)


def _docstring_table() -> dict:
    """op -> the transports the package docstring's op table lists (a row may wrap)."""
    lines = portable_overlap.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    rows, op = {}, None
    for line in lines[rules[1] + 1:rules[2]]:
        if line[:1].strip():  # a new row: op, context, transports
            op, _, *names = line.replace(",", " ").split()
            rows[op] = names
        else:  # the row's transports go on
            rows[op] += line.replace(",", " ").split()
    return rows


def _readme_table() -> dict:
    """op -> the transports (the backquoted names of the third column) of README's op table."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = {}
    with open(os.path.join(root, "README.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.split("|")[1:-1]]
            found = re.match(r"`(\w+)` \(`\w+`\)$", cells[0]) if cells else None
            if found:
                rows[found.group(1)] = re.findall(r"`(\w+)`", cells[2])
    return rows


def test_op_tables_list_every_transport():
    """The package docstring's op table and README's list each op's transports as its
    context's ``TRANSPORTS`` has them, in that order (the first is the default)."""
    want = {name: list(spec.transports) for name, spec in SPECS.items()}
    assert _docstring_table() == want
    assert _readme_table() == want


def test_every_context_names_its_transports():
    """``po.<Context>.TRANSPORTS`` (README) exists on every op's context and matches the op
    table; the first is the default."""
    for name, spec in SPECS.items():
        assert spec.context.TRANSPORTS == spec.transports, name
