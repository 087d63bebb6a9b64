"""What ``python -m portable_overlap env`` prints."""
from __future__ import annotations

import platform

import torch

from .backends import ENV_VAR, backend_classes, get_backend
from .envvars import NAMES, check_names, env_file_path


def override_errors() -> list:
    """``(name, error)`` for each override the library reads that is set to a value its reader
    refuses, read as the library reads it when it uses it (a bad value otherwise showed
    nothing here and raised only in the first call that read it)."""
    from .backends.cpu import SLOTS_VAR, WAIT_TIMEOUT_VAR, env_slots, env_wait_timeout
    from .schedule.tuning import CACHE_VAR
    from .testing.spmd import env_emulated_ranks

    readers = {SLOTS_VAR: env_slots, WAIT_TIMEOUT_VAR: env_wait_timeout,
               "PORTABLE_OVERLAP_EMULATED_RANKS": env_emulated_ranks,
               CACHE_VAR: lambda: env_file_path(CACHE_VAR)}
    errors = []
    for name, read in readers.items():
        try:
            read()
        except ValueError as e:
            errors.append((name, e))
    return errors


def print_env() -> None:
    """The report; a ``ValueError`` after it where an override is set to a value the library
    refuses (``override_errors``)."""
    import os

    import triton

    print(f"portable_overlap  python {platform.python_version()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"backend override  {ENV_VAR}={os.environ.get(ENV_VAR, '(unset)')}")
    for name, close in check_names(warn=False):
        print(f"not read          {name}" + (f" (did you mean {close}?)" if close else ""))
    for name in NAMES:
        if name != ENV_VAR and os.environ.get(name):
            print(f"override          {name}={os.environ[name]!r}")
    errors = override_errors()
    for name, cls in backend_classes().items():
        usable, why = cls.is_usable()
        print(f"backend {name:5s} {'usable' if usable else 'not usable: ' + why}")
    be = get_backend()
    print(f"selected backend  {be.name}")
    n = torch.cuda.device_count() if be.name != "cpu" else 0
    devices = [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    for d in devices:
        f = be.device_facts(d)
        print(f"device {d}  {f.name}  arch {f.arch}  {f.sm_count} SMs/CUs  warp {f.warp_size}")
    if len(devices) > 1:
        for a in devices:
            row = " ".join("self" if a == b else ("yes" if be.can_access_peer(a, b) else "no")
                           for b in devices)
            print(f"peer access from {a}: {row}")
    for k, v in be.extra_facts().items():
        print(f"{k}  {v}")
    if errors:  # (the CLI prints it as its error, exit code 2)
        raise ValueError("; ".join(str(e) for _, e in errors))
