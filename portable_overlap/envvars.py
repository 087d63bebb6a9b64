"""The library's environment overrides, parsed and checked in one place.

Each helper reads the variable when it is called (not at import), so a value set after import,
by a launcher script or a test, takes effect. An unset or empty variable gives the default; a
value that does not parse or lies out of range raises ``ValueError`` naming the variable, the
value and what is allowed, instead of running with a value that hangs or computes garbage. A
variable with the library's prefix that it does not read (a misspelt name) is reported with a
warning when a :class:`~portable_overlap.world.World` is made (:func:`check_names`).
"""
from __future__ import annotations

import difflib
import math
import os
import warnings
from typing import Optional

PREFIX = "PORTABLE_OVERLAP_"
#: every variable the library reads (``tests/test_envvars.py`` checks the package names no other)
NAMES = ("PORTABLE_OVERLAP_BACKEND", "PORTABLE_OVERLAP_CPU_SLOTS",
         "PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT", "PORTABLE_OVERLAP_EMULATED_RANKS",
         "PORTABLE_OVERLAP_TUNING_CACHE")
_reported: set = set()


def check_names(environ=None, warn: bool = True) -> list:
    """``(name, the closest variable it reads or None)`` for each variable of ``environ``
    (default: the process's) with the library's prefix that it does not read, sorted by name;
    with ``warn``, each is reported once per process with a ``RuntimeWarning``. A misspelt
    override (``..._TUNNING_CACHE`` for ``..._TUNING_CACHE``) is otherwise ignored without a
    word, and the job runs with the default."""
    env = os.environ if environ is None else environ
    tails = {n[len(PREFIX):]: n for n in NAMES}
    unknown = []
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in NAMES):
        close = difflib.get_close_matches(name[len(PREFIX):], tails, n=1)
        unknown.append((name, tails[close[0]] if close else None))
        if warn and name not in _reported:
            _reported.add(name)
            hint = f" (did you mean {tails[close[0]]}?)" if close else ""
            warnings.warn(f"{name} is set, but portable_overlap reads no variable of that "
                          f"name{hint}; it is ignored. The variables it reads: "
                          f"{', '.join(NAMES)}", RuntimeWarning, stacklevel=2)
    return unknown


def env_str(name: str) -> Optional[str]:
    """``$name``, or None when unset, empty or blank (spaces only: a value no setting takes,
    where a file named " " would otherwise be made)."""
    raw = os.environ.get(name)
    return raw if raw and raw.strip() else None


def env_int(name: str, default: int, lo: int, hi: int) -> int:
    """``$name`` as an integer in ``lo .. hi`` (both included); ``default`` when unset."""
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise ValueError(f"{name}={raw!r} is not allowed: it must be an integer in {lo} .. {hi} "
                         f"(unset it for the default {default})")
    return value


def env_float(name: str, default: float, above: float, at_most: float = math.inf) -> float:
    """``$name`` as a finite number with ``above < value <= at_most``; ``default`` when unset.
    NaN and infinity are refused: a NaN deadline never passes, so a wait would never time out."""
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and above < value <= at_most):
        bound = "" if math.isinf(at_most) else f" and <= {at_most}"
        raise ValueError(f"{name}={raw!r} is not allowed: it must be a finite number > {above}"
                         f"{bound} (unset it for the default {default})")
    return value


def env_file_path(name: str) -> Optional[str]:
    """``$name`` as the path of a file (``~`` expanded); None when unset. A path that names an
    existing directory, or ends in a separator (a folder's path, existing or not), is refused:
    the file would have to be made inside it under a guessed name."""
    raw = env_str(name)
    if raw is None:
        return None
    if raw != raw.strip():  # a copied line's stray space would name another file, silently
        raise ValueError(f"{name}={raw!r} starts or ends with white space; give the path "
                         f"without it")
    path = os.path.expanduser(raw)
    if is_folder_path(path):
        raise ValueError(f"{name}={raw!r} names a directory; give the path of a file "
                         f"(for instance one inside that directory)")
    return path


def is_folder_path(path: str) -> bool:
    """Whether ``path`` names a folder: an existing directory, or a path ending in a separator
    (a file cannot be written there: the tuning cache's rename onto it fails)."""
    return os.path.isdir(path) or path.endswith(("/", os.sep))
