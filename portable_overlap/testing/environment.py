"""Environment variables set for a block of code and restored after it, in the process that
runs it (an emulated rank's included: each rank is its own process)."""
import contextlib
import os
from typing import Optional


def _put(name: str, value: Optional[str]) -> None:
    """Set ``name`` to ``value``, or unset it where ``value`` is None."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def environ(**values: Optional[str]):
    """Set each variable to its value (``None``: unset it) for the ``with`` block, then put back
    what was there before, set or unset, whatever the block raised."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _put(name, value)
        yield
    finally:
        for name, value in saved.items():
            _put(name, value)
