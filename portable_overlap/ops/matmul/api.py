"""Persistent tile GEMM: ``c = a @ b`` for a [M, K], b [K, N] (any strides), bf16 / fp16 / fp32.

The compute baseline of the Triton GEMM ops: GEMM + All-to-All (stores), the MoE grouped GEMM and
the tile-group-signal ops extend its tile (``tiles.gemm``) with their own epilogues. The tile
loads go through TMA tensor descriptors where the operands allow (``tile_descriptors``): on one
H200 0.730 vs cuBLAS 0.721 ms at 8192×8192×4096, 0.88–0.99 of cuBLAS at the four shapes of
``benchmarks/probe_gemm_tma.py``. Alone in the GEMM + All-to-All benchmark (``compute_triton``,
graph replay, 2x H200, docs/moe_combine.md): 0.403 / 0.779 / 0.679 ms against cuBLAS's 0.361 /
0.690 / 0.693 ms at 8192×4096×4096, 16384×7168×2048 and 4096×4096×14336 bf16; with pointer loads
(``gemm_tile``) 0.441 / 0.839 / 0.770 ms against 0.367 / 0.685 / 0.659, 82–86% of cuBLAS.
``benchmarks/tune_gemm_core.py`` sweeps its configuration."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch

from ...tiles.gemv import dot_precision, dot_upcast
from .kernel import persistent_matmul_kernel

OP = "persistent_matmul"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        # ints, not bools or floats: a group_m of 1.5 or NaN was taken here and failed inside
        # the kernel at its first launch ("unexpected type fp32" under the interpreter)
        def count(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not count(v) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16: {self}")
        if not (count(self.group_m) and self.group_m >= 1 and count(self.num_warps)
                and self.num_warps in (1, 2, 4, 8, 16) and count(self.num_stages)
                and 1 <= self.num_stages <= 8):
            raise ValueError(f"bad config {self}: group_m must be an int >= 1, num_warps 1, 2, "
                             f"4, 8 or 16, num_stages an int in 1..8")

    @property
    def tiling(self) -> tuple:
        """What the ranks of a fused op must agree on: the tiles' shape and order, which fix the
        rows and columns every tile stores to a peer. Warps and stages are each rank's own
        compile choice: they change how fast a tile is computed, not where it goes."""
        return (self.block_m, self.block_n, self.block_k, self.group_m)


#: 16-bit tiles where a warp is a 64-lane wavefront (AMD CDNA). A wavefront gets 512 VGPRs per
#: lane only when it runs alone on its SIMD, i.e. 4 wavefronts per program on a 4-SIMD CU; with 8
#: it gets 256. Compiled for gfx942 / gfx950 (bf16, pointer loads, vgpr count of 512 / spills):
#: the H200 tile (128 x 256 x 64, 8 warps, 3 stages) spills 12 / 27 VGPRs in the plain GEMM, 33 /
#: 38 in the tile-group-signal GEMM, 28 / 32 in GEMM + All-to-All and 50 / 67 in the MoE grouped
#: GEMM; 256 x 256 x 64 spills 78-190 with 4 warps and 147-440 with 8. 128 x 128 x 64 with 4
#: warps and 3 stages spills none in any of them: 328-355 VGPRs on gfx942, 380-411 on gfx950
#: (100 or more to spare, also with a masked K tail and in fp16), and takes 16 KiB of LDS on
#: gfx942 (limit 64) and 64 KiB on gfx950 (limit 160). With 8 warps it fits 256 only just
#: (208-256) and the MoE GEMM spills 4 on gfx950 at 2 stages. tests/test_compile_configs.py
#: compiles these picks. Never timed on AMD hardware.
WAVE64_TILE = MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)


def default_config(dtype: torch.dtype, device: torch.device, M: Optional[int] = None,
                   N: Optional[int] = None, descriptors: bool = False) -> MatmulConfig:
    """The tiling of ``device`` (its ``DeviceFacts``, read once per process): ``tile_config``."""
    if device.type == "cpu":  # the interpreter: small tiles keep emulated runs short
        return MatmulConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1,
                            num_stages=1)
    from ...backends import device_facts

    return tile_config(dtype, device_facts(device), M, N, descriptors)


#: where the full tile leaves many processors idle (``tile_config``): 128 x 128 tiles, and
#: 64 x 128 ones where even those are few; over 4 warps and 4 stages through descriptors, over
#: 8 warps and 3 stages with pointer loads (where 128 x 128 tiles over 4 warps ran at 0.06-0.24
#: of cuBLAS)
MID_TILE = MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4)
MID_TILE_POINTERS = MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8,
                                 num_stages=3)
SMALL_TILE = MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
SMALL_TILE_POINTERS = MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=8,
                                   num_stages=3)
#: the full tile while its grid fills this fraction of the processors; 128 x 128 tiles while
#: theirs fills ``MID_FILL``
FULL_FILL, MID_FILL = 0.6, 1 / 3


def tile_config(dtype: torch.dtype, facts, M: Optional[int] = None, N: Optional[int] = None,
                descriptors: bool = False) -> MatmulConfig:
    """The GEMM tiling for ``dtype`` on a device with ``facts``, for an [M, N] product (None:
    a large one): the H200 tiles on 32-lane warps, ``WAVE64_TILE`` for 16-bit operands on
    64-lane wavefronts (the H200 tile spills VGPRs there).

    On 32-lane warps the full 128 x 256 tile is kept while its grid fills ``FULL_FILL`` of the
    processors; below that, 128 x 128 tiles while their grid fills ``MID_FILL``, else 64 x 128
    ones. The tiles depend on M and N only, so every rank of a call picks the same ones
    (``MatmulConfig.tiling``); the warps on ``descriptors``, whether this rank's operands take
    descriptors: ``MID_TILE`` / ``SMALL_TILE`` if so, else ``MID_TILE_POINTERS`` /
    ``SMALL_TILE_POINTERS``. The ranks of a fused op may differ there (in K, in alignment) and
    still agree on the tiling. One H200, fraction of cuBLAS's speed, graph replay
    (``benchmarks/tune_gemm_shapes.py``, M x N x K):

    - 256 x 8192 x 3584 and 2048 x 1024 x 8192 (64 full tiles): full 0.60 / 0.56, 128 x 128
      over 4 warps 0.88 / 0.92, over 8 warps 0.69 / 0.71;
    - 384 x 8192 x 3584 (96 full tiles): full 0.80, 128 x 128 0.69;
    - 128 x 3584 x 8192 and 64 x 1024 x 4096: full 0.30 / 0.20, 64 x 128 over 4 warps 0.56 /
      0.55, over 8 warps 0.40 / 0.48;
    - pointer loads (K not a multiple of 8): 64 x 128 and 128 x 128 over 8 warps 0.50-1.05
      and 0.33-1.19 of cuBLAS (which slows down there too), 128 x 128 over 4 warps 0.06-0.24;
    - where the full tile's grid fills the device (512 x 8192 x 3584 and up): 0.89-0.98."""
    if dtype == torch.float32:  # 0 spills, 32 KiB of LDS on gfx942 and gfx950 too
        return MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    if facts.warp_size == 64:
        return WAVE64_TILE
    # the plain Triton GEMM measured at 655 TFLOP/s on H200 (see ../shared/DESIGN.md)
    full = MatmulConfig()
    if M is None or N is None:
        return full
    sms = facts.sm_count
    if -(-M // full.block_m) * -(-N // full.block_n) >= FULL_FILL * sms:
        return full
    if -(-M // MID_TILE.block_m) * -(-N // MID_TILE.block_n) >= MID_FILL * sms:
        return MID_TILE if descriptors else MID_TILE_POINTERS
    return SMALL_TILE if descriptors else SMALL_TILE_POINTERS


def shape_config(a: torch.Tensor, b: torch.Tensor, facts) -> MatmulConfig:
    """``tile_config`` for ``a @ b`` on a device with ``facts``: the tiles by the product's
    [M, N], the warps by ``describable(a, b, facts)``. CPU: the interpreter's tiles."""
    if a.device.type == "cpu":
        return default_config(a.dtype, a.device)
    return tile_config(a.dtype, facts, a.shape[0], b.shape[1], describable(a, b, facts))


def describable(a: torch.Tensor, b: torch.Tensor, facts, cfg: MatmulConfig = MID_TILE,
                b_trans: bool = False) -> bool:
    """Whether ``tile_descriptors`` gives descriptors of ``a`` and ``b`` in ``cfg``'s tiles
    (by default any of those ``tile_config`` picks: their boxes all fit where one does); with
    ``b_trans``, whether ``operand_descriptors`` does (``b`` may be a transposed weight)."""
    if not (_boxes_fit(a, cfg, facts) and _rows_fit(a)):
        return False
    return _rows_fit(b) or (b_trans and _rows_fit(b.t()))


def tile_descriptors(a: torch.Tensor, b: torch.Tensor, cfg: MatmulConfig, facts) -> tuple:
    """``(a_desc, b_desc)`` for ``tiles.gemm.gemm_tile_desc`` (blocks [BLOCK_M, BLOCK_K] of
    ``a`` and [BLOCK_K, BLOCK_N] of ``b``), or ``(None, None)`` where the pointer loads of
    ``gemm_tile`` must do: a device without bulk tensor copies (``facts.tensor_descriptors``),
    a dtype other than bf16 / fp16, or operands a descriptor cannot describe (rows not
    contiguous, row strides or base addresses not multiples of 16 bytes, e.g. a transposed
    weight view: see ``operand_descriptors``). Build them per call: they hold the tensors'
    addresses."""
    if not describable(a, b, facts, cfg):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n]))


def operand_descriptors(a: torch.Tensor, b: torch.Tensor, cfg: MatmulConfig, facts) -> tuple:
    """``(a_desc, b_desc, b_trans)``: ``tile_descriptors`` where ``b`` allows them, else, where
    ``b`` is the transpose of a row-major [N, K] matrix (``weight.t()`` of an ``nn.Linear``),
    a descriptor of that matrix in [BLOCK_N, BLOCK_K] blocks with ``b_trans`` True (for
    ``tiles.gemm.gemm_tile_desc_bt``); ``(None, None, False)`` where neither is possible."""
    a_desc, b_desc = tile_descriptors(a, b, cfg, facts)
    if a_desc is not None:
        return a_desc, b_desc, False
    if describable(a, b, facts, cfg, b_trans=True):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return (TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]),
                TensorDescriptor.from_tensor(b.t(), [cfg.block_n, cfg.block_k]), True)
    return None, None, False


def _boxes_fit(a: torch.Tensor, cfg: MatmulConfig, facts) -> bool:
    """Whether the device copies tiles of ``a``'s dtype in ``cfg``'s blocks: a box is at most
    256 elements per dimension and its rows whole 16-byte units."""
    if not getattr(facts, "tensor_descriptors", False) or a.dtype not in (torch.bfloat16,
                                                                          torch.float16):
        return False
    es = a.element_size()
    return max(cfg.block_m, cfg.block_n, cfg.block_k) <= 256 and not (cfg.block_k * es) % 16 \
        and not (cfg.block_n * es) % 16


def _rows_fit(t: torch.Tensor) -> bool:
    """Whether a descriptor can describe ``t``: contiguous rows, row stride and base address
    multiples of 16 bytes, not empty."""
    es = t.element_size()
    return t.stride(1) == 1 and not (t.stride(0) * es) % 16 and not t.data_ptr() % 16 \
        and t.numel() > 0


def check_operands(op: str, a, b, device: Optional[torch.device] = None) -> None:
    """The checks every GEMM-based op makes of ``a [M, K] @ b [K, N]`` (any strides). M = 0
    (no rows) is a call: its result has no rows, as torch's. K = 0 and N = 0 are refused with a
    ValueError naming them (torch would give zeros, or no columns; the tilings and the
    contexts' sizes take K, N >= 1): the K-split GEMM patterns' contexts give torch's zeros
    for K = 0 before any of these checks (``pattern.MatmulPattern._nonempty_k``)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"{op}: a and b must be tensors")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: need a [M, K] and b [K, N]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise TypeError(f"{op}: a and b must share one dtype of {DTYPES}; got {a.dtype}, {b.dtype}")
    device = device or a.device
    if a.device != device or b.device != device:
        raise ValueError(f"{op}: a and b must be on {device}; got {a.device}, {b.device}")
    if a.shape[1] < 1:
        raise ValueError(f"{op}: K must be >= 1 (a has no columns): {tuple(a.shape)} @ "
                         f"{tuple(b.shape)}")
    if b.shape[1] < 1:
        raise ValueError(f"{op}: N must be >= 1 (b has no columns): {tuple(a.shape)} @ "
                         f"{tuple(b.shape)}")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of the 2-d ``t`` share memory: sorted by stride, each dimension
    longer than 1 must step past the whole extent of the ones below it."""
    extent = 1
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1),
                       key=lambda d: d[1]):
        if s < extent:
            return True
        extent = s * n
    return False


def check_k_steps(op: str, a: torch.Tensor, b: torch.Tensor, cfg: MatmulConfig) -> None:
    """The shared tile GEMM (``tiles.gemm``) steps its pointers through K by ``block_k`` times
    a K stride in int32 (an int64 step costs the 128 x 128 pointer-load tile 288 bytes of
    spills on sm_90): refuse an ``a`` whose K stride (a column-major ``a`` of 2**31 / block_k
    rows or more) or a ``b`` whose K stride (a row-major ``b`` that wide) would wrap it."""
    for name, stride in (("a", a.stride(1)), ("b", b.stride(0))):
        if abs(stride) * cfg.block_k >= 2 ** 31:
            raise ValueError(f"{op}: {name}'s K stride {stride} times the tile's K block "
                             f"{cfg.block_k} passes 2**31 (the tiles' int32 K steps); pass "
                             f"{'a row-major a' if name == 'a' else 'a b with a smaller K stride'}")


def vector_checks(op, a, N, rows, *, bias=None, residual=None, rms_weight=None) -> None:
    """The epilogue operands' checks: ``residual`` [rows, N] with contiguous rows, ``bias`` and
    ``rms_weight`` contiguous [N]; all of ``a``'s dtype and device."""
    if residual is not None:
        check_2d(op, "residual", residual, (rows, N), a)
    for name, vec in (("bias", bias), ("rms_weight", rms_weight)):
        if vec is not None and (not isinstance(vec, torch.Tensor) or vec.shape != (N,)
                                or vec.dtype != a.dtype or vec.device != a.device
                                or vec.stride(0) != 1):
            raise ValueError(f"{op}: {name} must be a contiguous {a.dtype} [{N}] tensor on "
                             f"{a.device}")


def check_2d(op, name, t, shape, a) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != a.dtype \
            or t.device != a.device or t.stride(1) != 1:
        raise ValueError(f"{op}: {name} must be a {a.dtype} {list(shape)} tensor on {a.device} "
                         f"with contiguous rows")


def add_epilogue(out: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: Optional[torch.Tensor]) -> None:
    """``out += bias (+ residual)`` in place, for the transports whose GEMM has no fused
    epilogue (one rounding per addition; the fused epilogues round once)."""
    if bias is not None:
        out.add_(bias)
    if residual is not None:
        out.add_(residual)


def persistent_matmul(a: torch.Tensor, b: torch.Tensor, *, programs: Optional[int] = None,
                      config: Optional[MatmulConfig] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` by a persistent grid of ``programs`` (an int >= 1; default: one per SM, or 4
    on the CPU). ``out``: an [M, N] tensor of ``a``'s dtype and device, any strides whose
    elements are all distinct, sharing no memory with ``a`` or ``b`` (the tiles are stored
    while other programs still read the operands: an aliased ``out`` gave relative errors
    near 1 on the CPU interpreter with no error), and not requiring grad in grad mode. The
    op has no backward: an ``a`` or ``b`` that requires grad in grad mode is refused (its
    result would carry no gradient)."""
    from ..context import check_no_overlap, check_sizes, refuse_grad

    check_operands(OP, a, b)
    refuse_grad(OP, a, b)
    if programs is not None:
        check_sizes(OP, programs=programs)  # a float grid or 0 programs reached the kernel
    M, K = a.shape
    N = b.shape[1]
    from ...backends import device_facts

    facts = device_facts(a.device)  # read once per process, not per call
    cfg = config or shape_config(a, b, facts)
    check_k_steps(OP, a, b, cfg)
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    else:
        if not isinstance(out, torch.Tensor) or out.shape != (M, N) or out.dtype != a.dtype \
                or out.device != a.device:
            raise ValueError(f"{OP}: out must be {a.dtype} [{M}, {N}] on {a.device}")
        if _overlaps_itself(out):  # an expanded out: every row's tiles land in one row
            raise ValueError(f"{OP}: out's elements must be distinct (strides "
                             f"{tuple(out.stride())} for {list(out.shape)} make rows or columns "
                             f"share memory)")
        if out.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{OP} has no backward, and out requires grad: pass an out tensor "
                             f"that does not require grad, or call it under torch.no_grad()")
        check_no_overlap(OP, out, {"a": a, "b": b})
    if programs is None:  # one per SM / CU (the CPU backend reports a few emulated slots)
        programs = facts.sm_count
    n_tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    G = max(1, min(programs, n_tiles))
    a_desc, b_desc = tile_descriptors(a, b, cfg, facts)
    persistent_matmul_kernel[(G,)](
        a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        out.stride(1), G, a_desc, b_desc, USE_DESC=a_desc is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages, EVEN_K=K % cfg.block_k == 0,
        PRECISION=dot_precision(a.dtype), UPCAST=dot_upcast(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
