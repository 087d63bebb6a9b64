"""Representative compile signatures of the experts' gated grouped GEMM, at the tiles and launch
options of ``api.tile_config``: per-source row tiles through descriptors and by pointer loads
(sm_90's, 8 warps), fp32, and the decode picks of gathered row tiles (64 x 256 through
descriptors, 64 x 64 by pointer loads, 8 warps); 3 stages."""
from .kernel import expert_swiglu_kernel

_ARGS = ("I:i32 H:i32 n_seg:i32 E:i32 stride_xm:i32 stride_xk:i32 stride_we:i32 stride_wk:i32 "
         "stride_wn:i32 stride_hm:i32")


def specs():
    # the default tiles (api.default_config); bf16 through descriptors and pointer loads, per
    # source and gathered row tiles (the latter at decode sizes: 64 rows per segment or fewer)
    for dt, bm, bn, bk, warps, desc, gather in (("bf16", 128, 128, 64, 8, True, False),
                                                ("bf16", 128, 64, 64, 8, False, False),
                                                ("fp32", 64, 64, 32, 4, False, False),
                                                ("bf16", 64, 256, 64, 8, True, True),
                                                ("bf16", 64, 64, 64, 8, False, True)):
        sig = {n: f"*{dt}" for n in ("x_ptr", "wg_ptr", "wu_ptr", "h_ptr")}
        sig["counts_ptr"] = "*i32"
        if desc:
            sig.update(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>",
                       wg_desc=f"tensordesc<{dt}[{bk}, {bn}]>",
                       wu_desc=f"tensordesc<{dt}[{bk}, {bn}]>")
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=3, EVEN_K=True,
                      PRECISION="ieee", UPCAST=False, USE_DESC=desc, BLOCK_SEG=16,
                      BLOCK_SRC=2, GATHER=gather)
        if not desc:
            consts.update(x_desc=None, wg_desc=None, wu_desc=None)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=warps, num_stages=3)
        aligned = ["x_ptr", "wg_ptr", "wu_ptr", "h_ptr", "I", "H", "stride_xm", "stride_we",
                   "stride_wk", "stride_hm"]
        name = (f"expert_swiglu[{dt}{', descriptors' if desc else ''}"
                f"{', gathered rows' if gather else ''}]")
        yield name, expert_swiglu_kernel, sig, consts, aligned
