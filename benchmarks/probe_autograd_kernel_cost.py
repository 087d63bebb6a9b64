"""Probe (one process, GPU or CPU): the host cost of the Python Autograd kernel that every
torch op of the library without a backward carries (``ops.registry._no_backward``). Defines
two no-op ops in a scratch namespace, one with that kernel and one without, and times many
calls of each through the dispatcher, with grad mode on and off: the difference is what the
kernel adds to one call of a library op (``torch.compile`` without CUDA graphs, autograd). The
eager Python functions skip the dispatcher and CUDA-graph replay skips the host, so neither
pays it. Prints a table of microseconds per call (median of several rounds).

    python -m benchmarks.probe_autograd_kernel_cost [--calls 20000] [--rounds 7] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from portable_overlap.ops.registry import _no_backward

_LIB = torch.library.Library("po_probe_autograd", "DEF")
_LIB.define("plain(Tensor x) -> Tensor")
_LIB.define("guarded(Tensor x) -> Tensor")


def _identity(x):
    # a view: no allocation, so the timing is the dispatch alone
    return x.view(x.shape)


for _name in ("plain", "guarded"):
    _LIB.impl(_name, _identity, "CompositeExplicitAutograd")
_LIB.impl("guarded", _no_backward("guarded", _identity,
                                  lambda: torch.ops.po_probe_autograd.guarded.default),
          "Autograd")


def per_call_us(op, x, calls: int, rounds: int) -> float:
    for _ in range(100):
        op(x)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            op(x)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; the median counts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        print("--calls and --rounds must be positive", file=sys.stderr)
        return 2
    x = torch.randn(64, device=args.device)
    ops = torch.ops.po_probe_autograd
    print(f"device {args.device}, {args.calls} calls x {args.rounds} rounds, us per call")
    print(f"{'grad mode':>10} {'no kernel':>10} {'kernel':>10} {'added':>8}")
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            plain = per_call_us(ops.plain, x, args.calls, args.rounds)
            guarded = per_call_us(ops.guarded, x, args.calls, args.rounds)
        print(f"{'on' if grad else 'off':>10} {plain:10.2f} {guarded:10.2f} "
              f"{guarded - plain:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
