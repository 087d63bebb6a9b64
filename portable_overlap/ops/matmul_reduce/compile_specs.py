"""Representative compile signatures of the ``"stores"`` GEMM + ReduceScatter / AllReduce kernel
for the compile matrix: both modes, the device's bf16 tiles with and without descriptors, with
the epilogue's bias and residual, and fp32. At the options of the launches of their tiles
(``matmul.api.tile_config``): the H200 bf16 tile over 8 warps (sm_90), fp32 over 4; 3 stages;
the tiles of products too small for it, over 4 warps and 4 stages through descriptors
(``MID_TILE``, ``SMALL_TILE``), over 8 warps and 3 stages by pointer loads
(``SMALL_TILE_POINTERS``); and split tiles in both modes (``SPLIT``: the peers' float32
ranges, ``tiles.split``)."""
from ..matmul.compile_specs import descriptor_signature, fused_tile_launch, tile_launch
from .kernel import matmul_reduce_stores_kernel

_ARGS = ("M:i32 N:i32 K:i32 stride_am:i32 stride_ak:i32 stride_bk:i32 stride_bn:i32 "
         "stride_res:i32 block_rows:i32 G:i32 tag:i32 parts:i32")


def specs():
    for dt, prec, bm, bn, bk, desc, bt, ar, extra, split in (
            ("bf16", "ieee", 128, 256, 64, False, False, False, False, False),
            ("bf16", "ieee", 128, 256, 64, True, False, False, True, False),
            ("bf16", "ieee", 128, 256, 64, True, True, False, False, False),
            ("bf16", "ieee", 128, 256, 64, True, True, True, True, False),
            ("fp32", "ieee", 64, 64, 32, False, False, True, False, False),
            ("bf16", "ieee", 128, 128, 64, True, False, False, True, False),
            ("bf16", "ieee", 64, 128, 64, True, True, True, False, False),
            ("bf16", "ieee", 64, 128, 64, False, False, True, False, False),
            ("bf16", "ieee", 64, 128, 64, True, True, False, True, True),
            ("bf16", "ieee", 64, 128, 64, True, False, False, True, True),
            ("bf16", "ieee", 64, 128, 64, False, False, False, True, True),
            ("fp32", "ieee", 64, 64, 32, False, False, False, True, True),
            ("bf16", "ieee", 64, 128, 64, True, True, True, True, True),
            ("bf16", "ieee", 64, 128, 64, False, False, True, True, True)):
        sig = {n: f"*{dt}" for n in ("a_ptr", "b_ptr", "out_ptr", "bias_ptr", "res_ptr",
                                     "recv_ptr", "gathered_ptr")}
        if split:  # the peers' ranges travel in float32
            sig["recv_ptr"] = "*fp32"
        sig.update({n: "*i64" for n in ("sent_ptr", "reduced_ptr", "consumed_ptr", "ctx")})
        sig.update(ws_ptr="*fp32", done_ptr="*i32")
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        sig.update(descriptor_signature(dt, bm, bn, bk, desc))
        if bt:  # blocks of b.t(), [bn, bk]
            sig["b_desc"] = f"tensordesc<{dt}[{bn}, {bk}]>"
        consts = dict(ALL_REDUCE=ar, HAS_BIAS=extra, HAS_RES=extra, USE_DESC=desc, B_TRANS=bt,
                      BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=3, EVEN_K=True,
                      PRECISION=prec, UPCAST=False, G_MAX=1024, SPLIT=split)
        if not split:  # the launch passes parts = 1, which the JIT specializes as a constant
            consts["parts"] = 1
        if not desc:
            consts.update(a_desc=None, b_desc=None)
        sig.update({k: "constexpr" for k in consts})
        small = bn == 128 and dt == "bf16"  # a product too small for the full tile
        consts.update(fused_tile_launch(bm, bn, bk, desc) if small else tile_launch(bm, bn, bk))
        aligned = ["a_ptr", "b_ptr", "out_ptr", "recv_ptr", "gathered_ptr", "K", "N",
                   "stride_am", "stride_bk"]
        yield (f"matmul_reduce_stores[{'all_reduce' if ar else 'reduce_scatter'}, {dt}"
               f"{f' {bm}x{bn}' if small else ''}"
               f"{', descriptors' if desc else ''}{' of b.t()' if bt else ''}"
               f"{', bias+residual' if extra else ''}{', split tiles' if split else ''}]",
               matmul_reduce_stores_kernel, sig, consts, aligned)
