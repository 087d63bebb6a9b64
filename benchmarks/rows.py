"""Result rows of the benchmark protocol (pure Python): one JSON object per line with the keys
``op, shape (object), dtype, world, device, impl, graph, median_ms, p10_ms, p90_ms, date,
commit`` (rows that time nothing, such as summaries and calibrations, leave out the timing keys)
and whatever else a benchmark records about the case.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import subprocess
import sys
from typing import Callable, Iterator, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(env=None, cwd: str = REPO) -> str:
    """The commit the rows are recorded with: ``$PO_COMMIT`` when set (a copy of the tree
    without its git folder, as on the GPU machines), else git's short hash of HEAD, else
    ``"unknown"``."""
    env = os.environ if env is None else env
    if env.get("PO_COMMIT"):
        return env["PO_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def results_path(out: str, device_kind: str) -> str:
    """The JSONL file for ``--out``: ``out`` itself, or ``<out>/<device_kind>.jsonl`` when
    ``out`` is a folder (an existing one, or a path ending in a separator)."""
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        return os.path.join(out, f"{device_kind}.jsonl")
    return out


def make_row(op: str, *, world: int, device: str, date: str, commit: str, shape=None,
             dtype=None, **fields) -> dict:
    """One result row: the protocol's keys first, then ``fields`` in their order, then
    ``date`` and ``commit``."""
    row = {"op": op, "shape": {} if shape is None else dict(shape), "dtype": dtype,
           "world": world, "device": device}
    row.update(fields)
    row.update(date=date, commit=commit)
    return row


def finite(value):
    """``value`` with every NaN or infinite float (nested in dicts, lists and tuples) as None:
    json.dumps writes them as ``NaN`` / ``Infinity``, which is no JSON, and a reader other than
    Python's (jq, JavaScript, pandas' strict modes) refuses the whole file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class ResultWriter:
    """Appends rows to one JSONL file (``path`` as ``results_path`` reads it), each with this
    run's world size, device kind, date and commit."""

    def __init__(self, path: str, device_kind: str, world_size: int,
                 commit: Optional[str] = None):
        self.path = results_path(path, device_kind)
        self.device = device_kind
        self.world = world_size
        self.commit = commit or git_commit()
        self.date = datetime.date.today().isoformat()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

    def row(self, **fields) -> dict:
        """The row ``write`` would append (nothing written); ``fields`` may set its own
        ``date`` and ``commit``."""
        fields.setdefault("date", self.date)
        fields.setdefault("commit", self.commit)
        return make_row(fields.pop("op"), world=self.world, device=self.device, **fields)

    def write(self, **fields) -> dict:
        row = self.row(**fields)
        with open(self.path, "a") as f:
            f.write(json.dumps(finite(row), allow_nan=False) + "\n")
        return row


# --- reading results files (the tools: compare_results, compare_worlds, ops_table, plot) ------

class UnreadableResults(Exception):
    """A results file a tool cannot read: missing, not JSON lines, or a row without a field the
    tool reads. The message names the file."""


def json_rows(path: str, skip_unreadable: bool = False) -> Iterator[tuple]:
    """``(line number from 1, row)`` for each non-blank line of the JSON-lines file ``path``.
    A line that is not a JSON object raises ``ValueError`` naming the line; with
    ``skip_unreadable`` such lines are skipped, but a file with lines and not one row still
    raises (it is no results file)."""
    lines = rows = 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            lines += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row, why = None, f"not JSON ({e})"
            else:
                why = f"a JSON {type(row).__name__}, not an object"
            if not isinstance(row, dict):
                if skip_unreadable:
                    continue
                raise ValueError(f"line {n} is {why}")
            rows += 1
            yield n, row
    if lines and not rows:
        raise ValueError("no line is a JSON object (not a results file)")


def load_results(path: str, load: Callable, *args, **kwargs):
    """``load(path, *args, **kwargs)``; what makes the file unreadable to ``load`` (a missing
    file, a line that is not a JSON object, a row without a field it reads) is raised as
    :class:`UnreadableResults` naming ``path``."""
    try:
        return load(path, *args, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e  # (no path twice)
        if isinstance(e, KeyError):
            why = f"a row has no field {e}"
        raise UnreadableResults(f"cannot read the results in {path}: {type(e).__name__}: "
                                f"{why}") from e


def refuses_unreadable_results(tool: str):
    """A decorator for a tool's ``main``: :class:`UnreadableResults` ends it with one line on
    stderr and exit code 2, the tools' code for input they cannot use (a traceback's exit
    code 1 reads as a fault of the tool)."""
    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except UnreadableResults as e:
                print(f"{tool}: {e}", file=sys.stderr)
                return 2
        return run
    return wrap
