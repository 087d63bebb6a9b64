"""Operands laid out the way a reviewer trying to break an op would lay them out, on any
device: transposed views, every other column, rows that all alias one row (stride 0), a base
address one element past an aligned one, rows padded to a wider stride. The CPU tests and the
GPU checks share them: on a GPU they reach what the interpreter never sees, compiled kernels
specialized on pointer alignment and strides, and tensor descriptors that need 16-byte
aligned bases and rows."""
from typing import Optional

import torch

#: the layouts ``laid_out`` makes
LAYOUTS = ("contiguous", "transposed", "every_other_column", "stride_0", "offset",
           "padded_rows")


def laid_out(shape, how: Optional[str] = None, *, dtype: torch.dtype = torch.float32,
             device="cpu", gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """A fresh random 2-d tensor of ``shape`` (standard normal, in ``dtype``) in the layout
    ``how`` (one of ``LAYOUTS``; None is contiguous):

    - ``"transposed"``: the transpose of a contiguous [cols, rows] tensor (column-major);
    - ``"every_other_column"``: columns 0, 2, 4, ... of a [rows, 2 * cols] tensor;
    - ``"stride_0"``: one random row expanded to every row (row stride 0);
    - ``"offset"``: a contiguous view one element into its storage (base misaligned);
    - ``"padded_rows"``: the first ``cols`` columns of a [rows, cols + 8] tensor (rows
      aligned, not contiguous).
    """
    rows, cols = shape

    def fresh(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if how in (None, "contiguous"):
        return fresh(rows, cols)
    if how == "transposed":
        return fresh(cols, rows).t()
    if how == "every_other_column":
        return fresh(rows, 2 * cols)[:, ::2]
    if how == "stride_0":
        return fresh(1, cols).expand(rows, cols)
    if how == "offset":
        return fresh(rows * cols + 1)[1:].view(rows, cols)
    if how == "padded_rows":
        return fresh(rows, cols + 8)[:, :cols]
    raise ValueError(f"laid_out: how must be one of {LAYOUTS} or None, got {how!r}")


#: (name, (M, N, K), how a / b / residual are laid out) for the GEMM patterns; M is the
#: GEMM's rows (AllGather: the shard's) per rank of a 2-rank world, times W elsewhere
ODD_GEMMS = [
    ("1x1x1", (2, 1, 1), {}), ("primes", (14, 7, 3), {}), ("K 97", (2, 5, 97), {}),
    ("N 97", (4, 97, 5), {}), ("a transposed", (6, 7, 9), {"a": "transposed"}),
    ("b transposed", (6, 7, 9), {"b": "transposed"}),
    ("b every other column", (6, 7, 9), {"b": "every_other_column"}),
    ("b stride 0", (6, 7, 9), {"b": "stride_0"}), ("a storage offset", (6, 7, 9), {"a": "offset"}),
    ("residual stride 0", (6, 7, 9), {"res": "stride_0"}),
]
