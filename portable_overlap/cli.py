"""Command-line helpers shared by the package's entry point (``python -m portable_overlap``) and
the example scripts."""
from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse ``type=``: the argument as an int >= ``least``, else argparse's usage error
    naming the value. Counts (ranks, layers, steps, iterations) that argparse's plain ``int``
    takes below their least value run nothing and then report on it: the demo waited for ranks
    that never started, an example with no layer compared its input with itself, the median of
    no timed run raised."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return n

    parse.__name__ = f"int >= {least}"  # (argparse names the type in its messages)
    return parse
