"""Representative compile signatures of the one-launch MoE layer kernel."""
from ..moe_dispatch.compile_specs import _SWIGLU_ARGS, _sig
from .kernel import moe_layer_kernel

_LAYER_ARGS = _SWIGLU_ARGS + (" c_status_addr:i64 max_slots:i32 stride_de:i32 stride_dk:i32 "
                              "stride_dn:i32 c_tag:i32 c_timeout_us:i32")


def specs():
    """The layer at the tiles its planner picks (api._plan: the gated GEMM's, the down GEMM's
    with the same row tile height and warps): bf16 through descriptors at prefill and decode
    sizes (sm_90), bf16 by pointer loads (no descriptors: AMD), fp32. Compiled at the launch's
    options: the gated GEMM's warps and stages."""
    for dt, (bm, bn, bk, warps, stages), (bn2, bk2, stages2), desc in (
            ("bf16", (128, 128, 64, 8, 3), (256, 64, 3), True),
            ("bf16", (64, 256, 64, 8, 3), (256, 64, 4), True),
            ("bf16", (128, 64, 64, 4, 3), (128, 64, 3), False),
            ("fp32", (64, 64, 32, 4, 3), (64, 32, 3), False)):
        ptrs = {"tokens_ptr": f"*{dt}", "ids_ptr": "*i64", "base_ptr": "*i32",
                "dest_start_ptr": "*i32", "recv_ptr": f"*{dt}", "recv_slots_ptr": "*i32",
                "counts_ptr": "*i32", "queue_ptr": "*i32", "ready_ptr": "*i32",
                "wg_ptr": f"*{dt}", "wu_ptr": f"*{dt}", "h_ptr": f"*{dt}", "wd_ptr": f"*{dt}",
                "combine_ptr": f"*{dt}"}
        ptrs.update({n: "*i64" for n in (
            "sent_ptr", "ctl_ptr", "clock_ptr", "bases_ptr", "slot_epoch_ptr", "c_sent_ptr",
            "rows_in_ptr", "rows_mine_ptr", "c_consumed_ptr", "c_ctl_ptr", "c_clock_ptr",
            "c_bases_ptr")})
        consts = dict(BLOCK_T=64, BLOCK_E=16, BLOCK_H=256 if dt == "bf16" else 128, G_MAX=1024,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=stages,
                      EVEN_K=True, PRECISION="ieee", UPCAST=False, USE_DESC=desc, BLOCK_SEG=16,
                      BLOCK_F=32, SENDERS_COMPUTE=True, BLOCK_N2=bn2, BLOCK_K2=bk2, GROUP_M2=8,
                      NUM_STAGES2=stages2, EVEN_K2=True, USE_DESC2=desc, SENDERS_DOWN=True,
                      EXPERT_MAJOR=bm == 64 and desc, BLOCK_SRC=8, num_warps=warps,
                      num_stages=stages)
        if desc:
            ptrs.update(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>",
                        wg_desc=f"tensordesc<{dt}[{bk}, {bn}]>",
                        wu_desc=f"tensordesc<{dt}[{bk}, {bn}]>",
                        h_desc=f"tensordesc<{dt}[{bm}, {bk2}]>",
                        wd_desc=f"tensordesc<{dt}[{bk2}, {bn2}]>")
        else:
            consts.update(x_desc=None, wg_desc=None, wu_desc=None, h_desc=None, wd_desc=None)
        name = f"moe_layer[{dt}, {bm}x{bn}/{bn2}{', descriptors' if desc else ''}]"
        yield (name, moe_layer_kernel, _sig(ptrs, _LAYER_ARGS, consts), consts,
               ["tokens_ptr", "recv_ptr", "wg_ptr", "wu_ptr", "h_ptr", "wd_ptr", "combine_ptr",
                "H", "stride_ts", "I", "stride_we", "stride_wk", "stride_hm", "stride_de",
                "stride_dk"])
