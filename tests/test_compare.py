"""The comparison every test, GPU check and benchmark uses (portable_overlap.testing.compare)."""
import math

import torch

from portable_overlap.testing.compare import rel_err


def test_rel_err_is_the_norm_ratio():
    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)  # norm 5
    got = ref + torch.tensor([[0.0, 0.3], [0.4, 0.0]], dtype=torch.float64)  # norm 0.5
    assert math.isclose(rel_err(got, ref), 0.1, rel_tol=1e-12)
    assert rel_err(ref.bfloat16(), ref) == 0.0  # compared in float64 whatever the dtypes


def test_rel_err_never_passes_a_poisoned_output():
    ref = torch.randn(8, 8)
    for bad in (float("nan"), float("inf"), -float("inf")):
        got = ref.clone()
        got[3, 5] = bad
        assert rel_err(got, ref) == math.inf
    assert rel_err(torch.ones(3), torch.zeros(3)) == math.inf  # zero reference, wrong output
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
