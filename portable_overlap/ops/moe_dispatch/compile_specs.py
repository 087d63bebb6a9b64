"""Representative compile signatures of the MoE dispatch kernels, at their launches' options:
the routing and the scatter over 4 warps with 1 stage (``api``), the fused dispatch + gated GEMM
at its tile's config (``swiglu``: ``moe_experts.api.tile_config``)."""
from ...kernel_registry import LAUNCH_OPTIONS
from .kernel import dispatch_scatter_kernel, route_count_kernel, route_exchange_kernel
from .swiglu_kernel import dispatch_swiglu_kernel

_EXCHANGE_ARGS = ("status_addr:i64 n_slots:i32 E:i32 capacity:i32 rank:i32 world:i32 tag:i32 "
                  "timeout_us:i32")
_SCATTER_ARGS = ("status_addr:i64 n_slots:i32 k:i32 H:i32 stride_ts:i32 E:i32 capacity:i32 "
                 "max_tokens:i32 rank:i32 world:i32 tag:i32 timeout_us:i32")


def _sig(pointers: dict, scalars: str, consts: dict) -> dict:
    sig = dict(pointers)
    sig.update(dict(kv.split(":") for kv in scalars.split()))
    sig.update({k: "constexpr" for k in consts if k not in LAUNCH_OPTIONS})
    return sig


#: the routing kernels' and the scatter's launch options (api.py)
_SMALL = dict(num_warps=4, num_stages=1)


def specs():
    # (DeepSeek-like: 8 ranks x 32 experts, top-8 ids int64; 2 ranks x 8 experts, int32 ids)
    for ids, BE, BT, W, El in (("i64", 256, 64, 8, 32), ("i32", 16, 64, 2, 8)):
        consts = dict(BLOCK_T=BT, BLOCK_E=BE, **_SMALL)
        yield (f"route_count[{ids},E{BE}]", route_count_kernel,
               _sig({"ids_ptr": f"*{ids}", "hist_ptr": "*i32", "bad_ptr": "*i32"},
                    "status_addr:i64 n_slots:i32 E_total:i32", consts), consts, ["hist_ptr"])
        consts = dict(BLOCK_T=BT, BLOCK_E=BE, BLOCK_P=min(64, 8192 // BE), BLOCK_W=W,
                      BLOCK_EL=El, **_SMALL)
        ptrs = {n: "*i32" for n in ("hist_ptr", "base_ptr", "bad_ptr", "dest_start_ptr",
                                    "counts_ptr", "counts_in_ptr")}
        ptrs.update({n: "*i64" for n in ("count_flag_ptr", "consumed_ptr", "ctl_ptr",
                                         "clock_ptr", "bases_ptr")})
        yield (f"route_exchange[E{BE}]", route_exchange_kernel,
               _sig(ptrs, _EXCHANGE_ARGS, consts), consts, ["hist_ptr", "base_ptr"])
    for dt, BH, once in (("bf16", 256, False), ("fp32", 128, False), ("bf16", 256, True)):
        consts = dict(BLOCK_T=64, BLOCK_E=256, BLOCK_H=BH, G_MAX=1024, ONCE=once, **_SMALL)
        ptrs = {"tokens_ptr": f"*{dt}", "ids_ptr": "*i64", "base_ptr": "*i32",
                "dest_start_ptr": "*i32", "recv_ptr": f"*{dt}", "recv_slots_ptr": "*i32",
                "slot_ids_ptr": "*i32", "stage_ptr": "*i32", "once_ptr": f"*{dt}",
                "place_ptr": "*i64"}
        ptrs.update({n: "*i64" for n in ("sent_ptr", "ctl_ptr", "clock_ptr", "bases_ptr")})
        # (dispatch_put_kernel, the same body with the SHMEM library's puts, is compiled by
        # the library's launcher on GPUs: kernel_registry.NEEDS_SHMEM_LIBRARY)
        yield (f"dispatch_scatter[{dt}{', once' if once else ''}]", dispatch_scatter_kernel,
               _sig(ptrs, _SCATTER_ARGS, consts), consts,
               ["tokens_ptr", "recv_ptr", "once_ptr", "H", "stride_ts"])
    yield from _swiglu_specs()


_SWIGLU_ARGS = ("status_addr:i64 n_slots:i32 k:i32 H:i32 stride_ts:i32 E:i32 capacity:i32 "
                "rank:i32 world:i32 tag:i32 timeout_us:i32 senders:i32 I:i32 stride_we:i32 "
                "stride_wk:i32 stride_wn:i32 stride_hm:i32")


def _swiglu_specs():
    """The fused dispatch + gated GEMM at its default tiles (moe_experts.api.tile_config):
    bf16 through descriptors (sm_90) and by pointer loads (no descriptors: AMD), fp32."""
    for dt, bm, bn, bk, warps, desc in (("bf16", 128, 128, 64, 8, True),
                                        ("bf16", 128, 64, 64, 4, False),
                                        ("fp32", 64, 64, 32, 4, False)):
        ptrs = {"tokens_ptr": f"*{dt}", "ids_ptr": "*i64", "base_ptr": "*i32",
                "dest_start_ptr": "*i32", "recv_ptr": f"*{dt}", "recv_slots_ptr": "*i32",
                "counts_ptr": "*i32", "queue_ptr": "*i32", "wg_ptr": f"*{dt}",
                "wu_ptr": f"*{dt}", "h_ptr": f"*{dt}"}
        ptrs.update({n: "*i64" for n in ("sent_ptr", "ctl_ptr", "clock_ptr", "bases_ptr")})
        consts = dict(BLOCK_T=64, BLOCK_E=16, BLOCK_H=256 if dt == "bf16" else 128, G_MAX=1024,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=3, EVEN_K=True,
                      PRECISION="ieee", UPCAST=False, USE_DESC=desc, BLOCK_SEG=16, BLOCK_F=32,
                      SENDERS_COMPUTE=True, num_warps=warps, num_stages=3)
        if desc:
            ptrs.update(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>",
                        wg_desc=f"tensordesc<{dt}[{bk}, {bn}]>",
                        wu_desc=f"tensordesc<{dt}[{bk}, {bn}]>")
        else:
            consts.update(x_desc=None, wg_desc=None, wu_desc=None)
        name = f"dispatch_swiglu[{dt}{', descriptors' if desc else ''}]"
        yield (name, dispatch_swiglu_kernel, _sig(ptrs, _SWIGLU_ARGS, consts), consts,
               ["tokens_ptr", "recv_ptr", "wg_ptr", "wu_ptr", "h_ptr", "H", "stride_ts", "I",
                "stride_we", "stride_wk", "stride_hm"])
