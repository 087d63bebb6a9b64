"""Representative compile signatures of the persistent matmul for the compile matrix, at the
warps and stages of the launch that picks each tile (``api.tile_config``): bf16 at the H200 tile
(8 warps; sm_90), fp16 at the 64-lane-wavefront tile (``WAVE64_TILE``, 4 warps; gfx942 /
gfx950), fp32 at 4 warps (every device); 3 stages. Then bf16 at the tiles of products too small
for the full one (``MID_TILE`` ... ``SMALL_TILE_POINTERS``), at their own warps and stages."""
from .kernel import persistent_matmul_kernel

_ARGS = ("M:i32 N:i32 K:i32 stride_am:i32 stride_ak:i32 stride_bk:i32 stride_bn:i32 "
         "stride_cm:i32 stride_cn:i32 G:i32")


def specs():
    for dt, prec, bm, bn, bk in (("bf16", "ieee", 128, 256, 64), ("fp16", "ieee", 128, 128, 64),
                                 ("fp32", "ieee", 64, 64, 32)):
        for desc in (False, True) if dt != "fp32" else (False,):
            sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "c_ptr": f"*{dt}"}
            sig.update(dict(kv.split(":") for kv in _ARGS.split()))
            sig.update(descriptor_signature(dt, bm, bn, bk, desc))
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=3,
                          EVEN_K=True, PRECISION=prec, UPCAST=False, USE_DESC=desc)
            if not desc:
                consts.update(a_desc=None, b_desc=None)
            sig.update({k: "constexpr" for k in consts})
            consts.update(tile_launch(bm, bn, bk))
            aligned = ["a_ptr", "b_ptr", "c_ptr", "K", "N", "stride_am", "stride_bk", "stride_cm"]
            name = f"persistent_matmul[{dt}{', descriptors' if desc else ''}]"
            yield name, persistent_matmul_kernel, sig, consts, aligned
    from .api import MID_TILE, MID_TILE_POINTERS, SMALL_TILE, SMALL_TILE_POINTERS

    for cfg, desc in ((MID_TILE, True), (SMALL_TILE, True), (MID_TILE_POINTERS, False),
                      (SMALL_TILE_POINTERS, False)):
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        sig.update(descriptor_signature("bf16", bm, bn, bk, desc))
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=cfg.num_stages,
                      EVEN_K=desc, PRECISION="ieee", UPCAST=False, USE_DESC=desc)
        if not desc:
            consts.update(a_desc=None, b_desc=None)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        aligned = ["a_ptr", "b_ptr", "c_ptr", "N", "stride_bk", "stride_cm"]
        yield (f"persistent_matmul[bf16 {bm}x{bn}, {cfg.num_warps} warps"
               f"{', descriptors' if desc else ''}]", persistent_matmul_kernel, sig, consts,
               aligned)


def tile_launch(bm: int, bn: int, bk: int) -> dict:
    """The warps and stages the library launches the GEMM tile ``bm`` x ``bn`` x ``bk`` with:
    those of the ``api.tile_config`` pick of that tile (on 32- or 64-lane warps, any dtype)."""
    from types import SimpleNamespace

    import torch

    from .api import tile_config

    for warp_size in (32, 64):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            c = tile_config(dtype, SimpleNamespace(warp_size=warp_size))
            if (c.block_m, c.block_n, c.block_k) == (bm, bn, bk):
                return {"num_warps": c.num_warps, "num_stages": c.num_stages}
    raise ValueError(f"no device's GEMM tiling picks the tile {bm} x {bn} x {bk}")


def fused_tile_launch(bm: int, bn: int, bk: int, descriptors: bool) -> dict:
    """The warps and stages (``num_warps``, ``num_stages``, and the kernel's ``NUM_STAGES``)
    a fused op launches a tile of products too small for the full one with, where it picks them
    by ``descriptors`` (``api.tile_config``): ``api.MID_TILE`` / ``api.SMALL_TILE`` if true,
    else ``api.MID_TILE_POINTERS`` / ``api.SMALL_TILE_POINTERS``."""
    from .api import MID_TILE, MID_TILE_POINTERS, SMALL_TILE, SMALL_TILE_POINTERS

    for c in ((MID_TILE, SMALL_TILE) if descriptors
              else (MID_TILE_POINTERS, SMALL_TILE_POINTERS)):
        if (c.block_m, c.block_n, c.block_k) == (bm, bn, bk):
            return {"num_warps": c.num_warps, "num_stages": c.num_stages,
                    "NUM_STAGES": c.num_stages}
    raise ValueError(f"the fused ops pick no tile {bm} x {bn} x {bk} for small products")


def descriptor_signature(dt: str, bm: int, bn: int, bk: int, desc: bool) -> dict:
    """The ``a_desc`` / ``b_desc`` entries of a tile-GEMM kernel's signature: tensor descriptors
    of [bm, bk] and [bk, bn] blocks, or constexpr None (the pointer loads)."""
    if not desc:
        return {"a_desc": "constexpr", "b_desc": "constexpr"}
    return {"a_desc": f"tensordesc<{dt}[{bm}, {bk}]>", "b_desc": f"tensordesc<{dt}[{bk}, {bn}]>"}
