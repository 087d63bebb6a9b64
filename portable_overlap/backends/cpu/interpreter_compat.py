"""Compatibility of Triton's interpreter with the numpy installed, applied by the CPU backend.

The interpreter holds every scalar of a kernel (an int argument, ``tl.program_id``, the result of
``tl.cdiv`` on scalars) as a 1-element numpy array, and turns one into a Python int for
``range(...)`` bounds and indexing with ``int(array)``. numpy 2.4 raises ``TypeError('only
0-dimensional arrays can be converted to Python scalars')`` there (deprecated since 1.25), so
every kernel with a loop over a runtime bound fails in the interpreter of Triton 3.6. The
conversion is Triton's, not the kernels': :func:`install` gives the interpreter's tensors an
``__index__`` that reads the one element with ``.item()``, which every numpy version accepts.
It changes nothing outside the interpreter (compiled kernels never call ``__index__``).
"""
from __future__ import annotations

import functools


def _index(self) -> int:
    """The Python int a scalar holds (a 1-element array of any rank); a block raises, as the
    interpreter's own conversion does."""
    data = self.handle.data  # always a numpy array in the interpreter
    if data.size != 1:
        raise TypeError(f"only a scalar converts to an index; this tensor holds {data.size} "
                        f"elements")
    return int(data.item())


def install() -> bool:
    """Make the interpreter convert scalars with ``.item()`` (idempotent). Returns whether the
    interpreter module was found and patched (False on a Triton without one)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton layout: nothing of ours to fix there
        return False
    if getattr(original, "_portable_overlap_compat", False):
        return True

    # The interpreter sets its tensor methods (``__index__`` among them) at every launch and
    # restores them afterwards, through a scope object: wrap the function that sets them, and
    # set ours through the same scope, so it is undone with the others.
    @functools.wraps(original)
    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patch_lang_tensor._portable_overlap_compat = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
