"""How the tests, the GPU checks and the benchmarks compare a result with its reference."""
import math

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` (Frobenius norms) in float64. ``inf`` when ``got`` holds a
    NaN or an infinity (a poisoned or overflowed output never passes a tolerance) and when
    ``ref`` is all zeros but ``got`` is not; 0.0 when both are all zeros."""
    g, r = got.detach().double(), ref.detach().double()
    num = (g - r).norm().item()
    den = r.norm().item()
    if not math.isfinite(num):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def worst(values) -> float:
    """The largest of ``values`` (errors of several ranks or steps), ``inf`` where any is NaN or
    not a number at all: Python's ``max`` keeps a NaN only where it comes first, so a NaN
    error of rank 1 read as agreement."""
    out = -math.inf
    for v in values:
        try:
            v = float(v)
        except (TypeError, ValueError):
            return math.inf
        if math.isnan(v):
            return math.inf
        out = max(out, v)
    return out
