"""The persistent tile GEMM core (interpreter, in the emulated ranks' processes) against torch."""
import pytest
import torch

from portable_overlap.ops.matmul import MatmulConfig, matmul_reference, persistent_matmul

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _cases(world, dtype):
    g = torch.Generator().manual_seed(5 + world.rank)
    errs = []
    # odd shapes, a transposed b, one program walking every tile, wide tiles
    for M, N, K, bt, programs, cfg in [
        (37, 45, 29, False, None, None), (64, 33, 48, True, 1, None), (5, 70, 16, False, 3, None),
        (50, 50, 64, True, None, MatmulConfig(block_m=32, block_n=64, block_k=32, group_m=1,
                                              num_warps=2, num_stages=2))]:
        a = torch.randn(M, K, generator=g).to(dtype)
        b = torch.randn(N, K, generator=g).to(dtype).t() if bt else \
            torch.randn(K, N, generator=g).to(dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        persistent_matmul(a, b, programs=programs, config=cfg, out=out)
        ref = matmul_reference(a, b)
        errs.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
    return errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=lambda d: str(d)[6:])
def test_persistent_matmul_matches_torch(world2, dtype):
    for errs in world2.run(_cases, dtype):
        assert all(e < TOL[dtype] for e in errs), errs


def test_bad_input():
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    with pytest.raises(ValueError, match="need a"):
        persistent_matmul(a, torch.randn(7, 5))
    with pytest.raises(TypeError, match="dtype"):
        persistent_matmul(a, b.double())
    with pytest.raises(ValueError, match="power of two"):
        MatmulConfig(block_m=48)


def test_out_aliasing_overlapping_or_recording_grad_is_refused():
    """An ``out`` over ``a``'s memory (the tiles were stored while other programs read ``a``:
    max error ~80 on a 32 x 32 product), an expanded ``out`` (every row's tiles in one row),
    an input that requires grad (a result with no gradient), a grid that is no count: each
    refused with a clear error before any launch, as the interpreter returned wrong numbers
    or dropped the gradient with no error."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
    with pytest.raises(ValueError, match="out shares memory with the input a"):
        persistent_matmul(a, b, out=a)
    with pytest.raises(ValueError, match="out shares memory with the input b"):
        persistent_matmul(a, b, out=b.t())
    with pytest.raises(ValueError, match=r"out's elements must be distinct \(strides \(0, 1\)"):
        persistent_matmul(a, b, out=torch.empty(1, 32).expand(32, 32))
    with pytest.raises(ValueError, match="out must be"):
        persistent_matmul(a, b, out=torch.empty(32, 31))
    with pytest.raises(RuntimeError, match="persistent_matmul has no backward"):
        persistent_matmul(a.clone().requires_grad_(True), b)
    with pytest.raises(ValueError, match="out requires grad"):
        persistent_matmul(a, b, out=torch.empty(32, 32, requires_grad=True))
    for programs in (0, 2.5, True):
        with pytest.raises(ValueError, match="programs must be an int >= 1"):
            persistent_matmul(a, b, programs=programs)


def _strided_out(world):
    """An ``out`` that is a transposed or column-strided view (distinct elements) is taken."""
    g = torch.Generator().manual_seed(9 + world.rank)
    a, b = torch.randn(19, 23, generator=g), torch.randn(23, 13, generator=g)
    errs = []
    for out in (torch.full((13, 19), float("nan")).t(),
                torch.full((19, 26), float("nan"))[:, ::2]):
        persistent_matmul(a, b, out=out)
        ref = matmul_reference(a, b)
        errs.append(((out - ref).norm() / ref.norm()).item())
    with torch.no_grad():  # inference on a leaf that requires grad is no training call
        y = persistent_matmul(a.clone().requires_grad_(True), b)
    errs.append(((y - matmul_reference(a, b)).norm() / y.norm()).item())
    return errs


def test_strided_out_and_no_grad_inputs_are_taken(world2):
    for errs in world2.run(_strided_out):
        assert all(e < 1e-5 for e in errs), errs


def test_k_strides_that_would_wrap_the_tiles_int32_steps_are_refused():
    """The tile GEMM steps through K in int32 (tiles.gemm): a column-major ``a`` of 2**25
    rows (K stride 2**25, times the 64-wide K block = 2**31) or a ``b`` as wide is refused
    with a clear error, before anything is launched."""
    store = torch.randn(2 ** 25 + 16).bfloat16()
    wide = store.as_strided((4, 2), (1, 2 ** 25))  # a [4, 2] whose K stride is 2**25
    b = torch.randn(2, 3).bfloat16()
    cfg = MatmulConfig(block_k=64)
    with pytest.raises(ValueError, match="a's K stride 33554432"):
        persistent_matmul(wide, b, config=cfg)
    with pytest.raises(ValueError, match="b's K stride 33554432"):
        persistent_matmul(b.t().contiguous()[:, :2], wide.t(), config=cfg)


def test_tile_descriptors_only_where_the_device_and_operands_allow():
    """The TMA main loop is chosen only on a device with bulk tensor copies, for bf16 / fp16
    operands whose rows are contiguous with 16-byte row strides and bases (the GPU checks run
    both paths; the CPU has no descriptors)."""
    import dataclasses

    from portable_overlap.backends import get_backend
    from portable_overlap.ops.matmul import MatmulConfig
    from portable_overlap.ops.matmul.api import tile_descriptors

    cpu = get_backend().device_facts(torch.device("cpu"))
    tma = dataclasses.replace(cpu, tensor_descriptors=True)
    cfg = MatmulConfig(block_m=128, block_n=256, block_k=64)
    a = torch.randn(256, 64).bfloat16()
    b = torch.randn(64, 512).bfloat16()
    assert tile_descriptors(a, b, cfg, cpu) == (None, None)
    ad, bd = tile_descriptors(a, b, cfg, tma)
    assert list(ad.block_shape) == [128, 64] and list(bd.block_shape) == [64, 256]
    assert tile_descriptors(a, b.t().contiguous().t(), cfg, tma) == (None, None)  # column-major
    assert tile_descriptors(a.float(), b.float(), cfg, tma) == (None, None)
    odd = torch.randn(256, 7).bfloat16()  # 14-byte rows
    assert tile_descriptors(odd, torch.randn(7, 512).bfloat16(), cfg, tma) == (None, None)
    wide = MatmulConfig(block_m=128, block_n=512, block_k=64)  # a box over 256 elements
    assert tile_descriptors(a, b, wide, tma) == (None, None)


def test_tiles_follow_the_products_shape():
    """``tile_config``: the full 128 x 256 tile while its grid fills 60 % of the processors,
    then 128 x 128, then 64 x 128; the warps by ``descriptors``; K plays no part (the ranks of a
    reduction may each have their own); 64-lane wavefronts and fp32 keep their one tiling."""
    import dataclasses

    from portable_overlap.backends import get_backend
    from portable_overlap.ops.matmul.api import (MID_TILE, MID_TILE_POINTERS, SMALL_TILE,
                                                 SMALL_TILE_POINTERS, WAVE64_TILE, describable,
                                                 shape_config, tile_config)

    cpu = get_backend().device_facts(torch.device("cpu"))
    h200 = dataclasses.replace(cpu, sm_count=132, warp_size=32, tensor_descriptors=True)
    bf = torch.bfloat16
    assert tile_config(bf, h200) == MatmulConfig()  # shape unknown: the full tile
    for (M, N), desc, want in (((8192, 8192), True, MatmulConfig()),
                               ((384, 8192), True, MatmulConfig()),  # 96 tiles: 0.73 full
                               ((256, 8192), True, MID_TILE), ((256, 8192), False,
                                                               MID_TILE_POINTERS),
                               ((2048, 1024), True, MID_TILE),
                               ((128, 3584), True, SMALL_TILE), ((64, 1024), False,
                                                                 SMALL_TILE_POINTERS),
                               ((1, 1), True, SMALL_TILE)):
        assert tile_config(bf, h200, M, N, desc) == want, (M, N, desc)
        assert tile_config(torch.float16, h200, M, N, desc) == want
    amd = dataclasses.replace(h200, warp_size=64)
    assert tile_config(bf, amd, 256, 8192, True) == WAVE64_TILE
    assert tile_config(torch.float32, h200, 256, 8192, True).block_n == 64
    # persistent_matmul's pick: the warps by whether descriptors describe a and b
    a, b = torch.randn(256, 64).bfloat16(), torch.randn(64, 8192).bfloat16()
    assert describable(a, b, h200) and not describable(a, b, cpu)
    assert not describable(a, b.t().contiguous().t(), h200)
    # a row-parallel weight (weight.t()): described through its transpose where the op can
    assert describable(a, b.t().contiguous().t(), h200, b_trans=True)
    assert not describable(a, b[:, 1:], h200, b_trans=True)
    # what the ranks of a fused op agree on: the tiles, not the warps each rank compiles with
    assert MID_TILE.tiling == MID_TILE_POINTERS.tiling != SMALL_TILE.tiling
    assert SMALL_TILE.tiling == SMALL_TILE_POINTERS.tiling
    assert not describable(torch.randn(256, 7).bfloat16(), torch.randn(7, 64).bfloat16(), h200)
    assert shape_config(a, b, h200) == MatmulConfig(block_m=16, block_n=16, block_k=16,
                                                    group_m=2, num_warps=1, num_stages=1)


@pytest.mark.parametrize("field", ["block_m", "group_m", "num_warps", "num_stages"])
@pytest.mark.parametrize("value", [True, 1.5, float("nan"), 0, 9 * 2 ** 20])
def test_a_config_field_that_is_no_count_in_range_is_refused(field, value):
    """A group_m of 1.5 or NaN was taken and failed inside the kernel at its first launch
    ("unexpected type fp32"); True passed as 1, a num_stages of 1.5 as a stage count."""
    if field in ("block_m", "group_m") and value == 9 * 2 ** 20:
        value = -16  # (a huge tile is refused by the device's limits; any group_m >= 1 works)
    with pytest.raises(ValueError, match="power of two|bad config"):
        MatmulConfig(**{field: value})
