"""Representative compile signatures of the fused GEMM + All-to-All for the compile matrix, at
the options of the launches of their tiles (``matmul.api.tile_config``): the H200 bf16 tile over
8 warps (sm_90), fp32 over 4; 3 stages; for products too small for it, 64 x 128 bf16 tiles
through descriptors (``matmul.api.SMALL_TILE``: 4 warps, 4 stages) and 128 x 128 ones by
pointer loads (``MID_TILE_POINTERS``: 8 warps, 3 stages)."""
from ..matmul.compile_specs import descriptor_signature, fused_tile_launch, tile_launch
from .kernel import gemm_alltoall_kernel

_ARGS = ("status_addr:i64 M:i32 N:i32 K:i32 stride_am:i32 stride_ak:i32 stride_bk:i32 "
         "stride_bn:i32 chunk:i32 G:i32 rank:i32 world:i32 tag:i32 timeout_us:i32")


def specs():
    for dt, prec, bm, bn, bk, desc in (("bf16", "ieee", 128, 256, 64, False),
                                       ("bf16", "ieee", 128, 256, 64, True),
                                       ("fp32", "ieee", 64, 64, 32, False),
                                       ("bf16", "ieee", 64, 128, 64, True),
                                       ("bf16", "ieee", 128, 128, 64, False)):
        sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}", "recv_ptr": f"*{dt}",
               "sent_ptr": "*i64", "consumed_ptr": "*i64", "ctl_ptr": "*i64",
               "clock_ptr": "*i64", "bases_ptr": "*i64"}
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        sig.update(descriptor_signature(dt, bm, bn, bk, desc))
        consts = dict(USE_DESC=desc, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                      NUM_STAGES=3, EVEN_K=True, PRECISION=prec, UPCAST=False, G_MAX=1024)
        if not desc:
            consts.update(a_desc=None, b_desc=None)
        sig.update({k: "constexpr" for k in consts})
        small = bn == 128 and dt == "bf16"  # a product too small for the full tile
        consts.update(fused_tile_launch(bm, bn, bk, desc) if small else tile_launch(bm, bn, bk))
        aligned = ["a_ptr", "b_ptr", "out_ptr", "recv_ptr", "K", "N", "stride_am", "stride_bk"]
        yield (f"gemm_alltoall[{dt}{f' {bm}x{bn}' if small else ''}"
               f"{', descriptors' if desc else ''}]", gemm_alltoall_kernel,
               sig, consts, aligned)
