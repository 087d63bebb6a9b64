"""Reference of the persistent matmul: torch.matmul (cuBLAS / hipBLASLt on GPUs)."""
import torch


def matmul_reference(a: torch.Tensor, b: torch.Tensor, accumulate_fp32: bool = True) -> torch.Tensor:
    """``a @ b`` in float32 (tests) or in the input dtype (the benchmark's compute baseline)."""
    if accumulate_fp32:
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b
