"""The GEMV tile: ``acc[BLOCK_M, BLOCK_N] = x[:, :] @ w[n0:n0+BLOCK_N, :]ᵀ`` over all of K.

x holds at most 64 rows (decode batch), so the tile pads the rows to BLOCK_M >= 16 and runs the
product on the matrix units (``tl.dot``): the padded rows cost no memory traffic, and the kernel
stays bound by streaming W, which is what a GEMV is. W rows are streamed BLOCK_K at a time through
a software pipeline of ``NUM_STAGES`` loads in flight.
"""
import os

import torch
import triton
import triton.language as tl


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether the tile must upcast its operands to float32 before ``tl.dot``.

    Only under the Triton interpreter with bfloat16: Triton 3.6's interpreter multiplies bfloat16
    tiles as their raw 16-bit integers (numpy has no bfloat16). Upcasting is exact (bf16 products
    fit a float32), so the CPU run computes what the GPU's bf16 matrix units compute."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """The ``input_precision`` of the tiles' ``tl.dot``: ``"ieee"`` for every dtype. fp32 operands
    stay exact (TF32 would keep 10 mantissa bits; the tests compare fp32 at 1e-5). For 16-bit
    operands the setting selects nothing (the sm_90 PTX is the same with ``"tf32"``), and
    ``"ieee"`` is the value every target takes: Triton's gfx950 backend refuses ``"tf32"``
    (only gfx942 has XF32)."""
    return "ieee"


@triton.jit
def gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, n0,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
              PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask, other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask, other=0.0)
        else:
            k_mask = (k0 + offs_k)[None, :] < K
            x = tl.load(x_ptrs, mask=m_mask & k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask & k_mask, other=0.0)
        if UPCAST:  # see ``dot_upcast``
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc
