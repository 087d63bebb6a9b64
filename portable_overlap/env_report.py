"""What ``python -m portable_overlap env`` prints."""
from __future__ import annotations

import platform

import torch

from .backends import ENV_VAR, backend_classes, get_backend
from .envvars import check_names


def print_env() -> None:
    import os

    import triton

    print(f"portable_overlap  python {platform.python_version()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(f"backend override  {ENV_VAR}={os.environ.get(ENV_VAR, '(unset)')}")
    for name, close in check_names(warn=False):
        print(f"not read          {name}" + (f" (did you mean {close}?)" if close else ""))
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
