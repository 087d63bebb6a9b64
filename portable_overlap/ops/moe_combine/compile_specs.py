"""Representative compile signatures of the MoE expert GEMM + combine kernels, at their launches'
options (``api._plan``, ``_plan_combine``): the GEMM at its tile's config (the H200 bf16 tile,
``matmul.api.tile_config``, over 8 warps with 3 stages; the decode tile, ``decode_tile``, over 8
with 4; fp32 over 4 with 3), the weighted sum over ``CombineConfig``'s 4 warps with 1 stage,
and the one-program launch of the counts' check and the segments' starts before the GEMM."""
from .kernel import moe_combine_kernel, moe_gemm_scatter_kernel, segment_starts_kernel

_GEMM_ARGS = ("status_addr:i64 R:i32 H:i32 I:i32 E:i32 max_slots:i32 stride_xm:i32 stride_xk:i32 "
              "stride_we:i32 stride_wk:i32 stride_wn:i32 G:i32 rank:i32 world:i32 tag:i32 "
              "timeout_us:i32")
_COMB_ARGS = ("status_addr:i64 S:i32 H:i32 k:i32 stride_ts:i32 stride_tk:i32 G_src:i32 rank:i32 "
              "world:i32 tag:i32 timeout_us:i32")


def specs():
    # the counts' check and the segments' starts: 8 ranks x 32 experts
    sig = {"counts_ptr": "*i32", "safe_ptr": "*i32", "starts_ptr": "*i32", "status_addr": "i64",
           "n_seg": "i32", "R": "i32", "BLOCK": "constexpr"}
    yield ("moe_gemm_combine segment_starts", segment_starts_kernel, sig,
           dict(BLOCK=256, num_warps=4, num_stages=1), [])
    # the default tiles (source-major walk) and the decode tiles (expert-major walk)
    for dt, prec, bm, bn, bk, desc, experts in (("bf16", "ieee", 128, 256, 64, True, False),
                                                ("bf16", "ieee", 128, 256, 64, False, False),
                                                ("fp32", "ieee", 64, 64, 32, False, False),
                                                ("bf16", "ieee", 64, 256, 64, True, True)):
        sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "counts_ptr": "*i32", "starts_ptr": "*i32",
               "slots_ptr": "*i32", "combine_ptr": f"*{dt}", "stage_ptr": f"*{dt}",
               "slot_epoch_ptr": "*i64", "sent_ptr": "*i64",
               "rows_in_ptr": "*i64", "rows_mine_ptr": "*i64", "consumed_ptr": "*i64",
               "ctl_ptr": "*i64", "clock_ptr": "*i64", "bases_ptr": "*i64"}
        sig.update(dict(kv.split(":") for kv in _GEMM_ARGS.split()))
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                      NUM_STAGES=4 if experts else 3, EVEN_K=True, PRECISION=prec,
                      UPCAST=False, G_MAX=1024, USE_DESC=desc, EXPERT_MAJOR=experts,
                      BLOCK_SRC=8)
        if desc:  # x [R, I] and the weights stacked as [E * I, H]
            sig.update(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>",
                       w_desc=f"tensordesc<{dt}[{bk}, {bn}]>")
        else:
            consts.update(x_desc=None, w_desc=None)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=8 if dt == "bf16" else 4, num_stages=consts["NUM_STAGES"])
        aligned = ["x_ptr", "w_ptr", "combine_ptr", "I", "H", "stride_xm", "stride_wk",
                   "stride_we"]
        yield (f"moe_gemm_scatter[{dt}{', descriptors' if desc else ''}"
               f"{', decode' if experts else ''}]", moe_gemm_scatter_kernel, sig, consts, aligned)
        if dt == "bf16" and (desc or experts):
            continue  # one combine kernel per dtype
        sig = {"combine_ptr": f"*{dt}", "topk_ptr": "*fp32", "out_ptr": f"*{dt}",
               "slot_epoch_ptr": "*i64", "sent_ptr": "*i64", "rows_in_ptr": "*i64",
               "consumed_ptr": "*i64", "ctl_ptr": "*i64", "clock_ptr": "*i64", "bases_ptr": "*i64"}
        sig.update(dict(kv.split(":") for kv in _COMB_ARGS.split()))
        consts = dict(BLOCK_S=8, BLOCK_H=256, G_MAX=1024)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=4, num_stages=1)
        yield (f"moe_combine[{dt}]", moe_combine_kernel, sig, consts,
               ["combine_ptr", "out_ptr", "H"])
