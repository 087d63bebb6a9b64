"""Result rows of the benchmark protocol (pure Python): one JSON object per line with the keys
``op, shape (object), dtype, world, device, impl, graph, median_ms, p10_ms, p90_ms, date,
commit`` (rows that time nothing, such as summaries and calibrations, leave out the timing keys)
and whatever else a benchmark records about the case.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
from typing import Optional

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
