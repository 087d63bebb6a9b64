"""Representative compile signatures of the tile-group-signal kernels for the compile matrix, at
their launches' options (``api.launch_plan``, ``_reduce_launch``): the GEMM at its tile's config
(``matmul.api.tile_config``: the H200 bf16 tile over 8 warps, the 64-lane-wavefront 128 x 128
tile over 4, fp32 over 4; 3 stages), the reorder and the reduce over 4 warps and the norm's
reorder over 8 where BLOCK_N is 256, at Triton's default stages (they pass none)."""
from ..matmul.compile_specs import descriptor_signature, tile_launch
from .kernel import (gemm_signal_kernel, signal_reduce_kernel, signal_reorder_kernel,
                     signal_reorder_norm_kernel)

_GEMM_ARGS = ("M_dest:i32 N:i32 K:i32 stride_am:i32 stride_ak:i32 stride_bk:i32 stride_bn:i32 "
              "dests:i32 G:i32")


def _gemm_spec(dt, prec, bm, bn, bk, desc, table):
    sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "stage_ptr": f"*{dt}",
           "slot_ptr": "*i32", "group_ptr": "*i32", "count_ptr": "*i64" if table else "*i32"}
    sig.update(dict(kv.split(":") for kv in _GEMM_ARGS.split()))
    sig.update(descriptor_signature(dt, bm, bn, bk, desc))
    consts = dict(USE_DESC=desc, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                  NUM_STAGES=3, EVEN_K=True, PRECISION=prec, UPCAST=False, GATE_TABLE=table)
    if not desc:
        consts.update(a_desc=None, b_desc=None)
    sig.update({k: "constexpr" for k in consts})
    consts.update(tile_launch(bm, bn, bk))
    aligned = ["a_ptr", "b_ptr", "stage_ptr", "K", "N", "stride_am", "stride_bk"]
    name = (f"gemm_signal[{dt}{', descriptors' if desc else ''}"
            f"{', gate table' if table else ''}]")
    return name, gemm_signal_kernel, sig, consts, aligned


def specs():
    for dt, prec, bm, bn, bk in (("bf16", "ieee", 128, 256, 64), ("fp16", "ieee", 128, 128, 64),
                                 ("fp32", "ieee", 64, 64, 32)):
        for desc in (False, True) if dt != "fp32" else (False,):
            yield _gemm_spec(dt, prec, bm, bn, bk, desc, False)
    # the group counters as separate words reached through their address table (ROCm's signal
    # memory under GPU_STREAMOPS_CP_WAIT=1)
    yield _gemm_spec("fp32", "ieee", 64, 64, 32, False, True)
    for dt, bm, bn, bias, res in (("bf16", 128, 256, True, True), ("fp32", 64, 64, False, False)):
        sig = {"src_ptr": f"*{dt}", "table_ptr": "*i32", "out_ptr": f"*{dt}",
               "bias_ptr": f"*{dt}", "res_ptr": f"*{dt}", "N": "i32", "stride_om": "i32",
               "stride_rm": "i32"}
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, ROWS=32, HAS_BIAS=bias, HAS_RES=res)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=4)
        aligned = ["src_ptr", "out_ptr", "bias_ptr", "res_ptr", "N", "stride_om", "stride_rm"]
        yield f"signal_reorder[{dt}]", signal_reorder_kernel, sig, consts, aligned
    for dt, bm, bn in (("bf16", 128, 256), ("fp32", 64, 64)):
        sig = {"src_ptr": f"*{dt}", "rows_ptr": "*i32", "index_ptr": "*i32",
               "out_ptr": f"*{dt}", "normed_ptr": f"*{dt}", "bias_ptr": f"*{dt}",
               "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", "N": "i32", "n_col_tiles": "i32",
               "stride_om": "i32", "stride_nm": "i32", "stride_rm": "i32", "eps": "fp32"}
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, ROWS=32, HAS_BIAS=True, HAS_RES=True)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=8 if bn >= 256 else 4)
        aligned = ["src_ptr", "out_ptr", "normed_ptr", "bias_ptr", "res_ptr", "w_ptr", "N",
                   "stride_om", "stride_nm", "stride_rm"]
        yield f"signal_reorder_norm[{dt}]", signal_reorder_norm_kernel, sig, consts, aligned
    for dt, bm, bn, bias, res in (("bf16", 128, 256, True, True), ("fp32", 16, 16, False, False)):
        sig = {"stage_ptr": f"*{dt}", "own_slot_ptr": "*i32", "recv_ptr": f"*{dt}",
               "table_ptr": "*i32", "out_ptr": f"*{dt}", "bias_ptr": f"*{dt}",
               "res_ptr": f"*{dt}", "N": "i32", "stride_om": "i32", "stride_rm": "i32",
               "rank": "i32", "W": "i32", "region": "i32"}
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, ROWS=min(bm, 32), HAS_BIAS=bias, HAS_RES=res)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=4)
        aligned = ["stage_ptr", "recv_ptr", "out_ptr", "bias_ptr", "res_ptr", "N", "stride_om",
                   "stride_rm", "region"]
        yield f"signal_reduce[{dt}]", signal_reduce_kernel, sig, consts, aligned
