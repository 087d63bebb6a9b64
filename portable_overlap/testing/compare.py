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
