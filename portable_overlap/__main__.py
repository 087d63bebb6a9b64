"""``python -m portable_overlap env`` prints what this machine offers the library;
``python -m portable_overlap demo`` runs the 2-rank fused GEMV + AllReduce demo."""
from __future__ import annotations

import argparse
import sys

from .cli import int_at_least


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m portable_overlap")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="backend, devices, peer access, NVSHMEM availability")
    d = sub.add_parser("demo", help="2-rank fused GEMV + AllReduce: correctness and timing table")
    d.add_argument("--cpu", action="store_true", help="use CPU-emulated ranks even with GPUs")
    d.add_argument("--ranks", type=int_at_least(1), default=2, help="how many ranks (default 2)")
    args = ap.parse_args(argv)
    if args.cmd == "env":
        from .env_report import print_env
        from .errors import BackendUnavailable

        try:
            print_env()
        except (BackendUnavailable, ValueError) as e:  # a bad override: its message, no trace
            print(f"{ap.prog} env: error: {e}", file=sys.stderr)
            return 2
        return 0
    from .backends import get_backend
    from .demo import run_demo
    from .env_report import override_errors
    from .errors import BackendUnavailable

    try:
        # the overrides first, in this process: a bad one raised in every rank's process
        # (two tracebacks and exit 1, the code of a wrong result), and the ranks' emulated
        # backend hid a forced one that cannot run here
        errors = override_errors()
        if errors:
            raise ValueError("; ".join(str(e) for _, e in errors))
        get_backend()
        return run_demo(force_cpu=args.cpu, ranks=args.ranks)
    except (BackendUnavailable, ValueError) as e:  # its message, no trace
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
