"""Representative compile signatures of the experts' gated grouped GEMM, at the tiles and launch
options of ``api.tile_config``: per-source row tiles through descriptors and by pointer loads
(sm_90's, 8 warps), fp32, the decode pick (64 x 256 through descriptors, 8 warps) with
packed experts, by descriptors and by pointer loads, and the decode variants' light (64 x 128,
4 warps, 4 stages) and heavy (128 x 128) tiles; 3 stages unless said, the last round's tiles
split (the default). And the launch that packs the experts' rows (``pack_rows_kernel``)."""
from .api import PACK_BLOCK_H, PACK_BLOCK_R
from .kernel import expert_swiglu_kernel, pack_rows_kernel

_ARGS = ("cap:i32 ws_ptr:*fp32 done_ptr:*i32 light_rows:i32 n_rows:i32 I:i32 H:i32 n_seg:i32 "
         "E:i32 stride_xm:i32 stride_xk:i32 stride_we:i32 stride_wk:i32 stride_wn:i32 "
         "stride_hm:i32 stride_pm:i32")


def specs():
    # the default tiles (api.default_config); bf16 through descriptors and pointer loads, per
    # source and with packed experts (the latter at decode sizes: 64 rows per segment or fewer)
    for dt, bm, bn, bk, warps, stages, desc, pack, variant in (
            ("bf16", 128, 128, 64, 8, 3, True, 0, 0), ("bf16", 128, 64, 64, 8, 3, False, 0, 0),
            ("fp32", 64, 64, 32, 4, 3, False, 0, 0), ("bf16", 64, 256, 64, 8, 3, True, 1, 0),
            ("bf16", 64, 256, 64, 8, 3, False, 1, 0), ("bf16", 64, 128, 64, 4, 4, True, 0, 1),
            ("bf16", 128, 128, 64, 8, 3, True, 0, 2)):
        sig = {n: f"*{dt}" for n in ("x_ptr", "wg_ptr", "wu_ptr", "h_ptr", "p_ptr")}
        sig.update(counts_ptr="*i32", map_ptr="*i32")
        if desc:
            sig.update(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>",
                       wg_desc=f"tensordesc<{dt}[{bk}, {bn}]>",
                       wu_desc=f"tensordesc<{dt}[{bk}, {bn}]>",
                       p_desc=f"tensordesc<{dt}[{bm}, {bk}]>")
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=stages,
                      EVEN_K=True, PRECISION="ieee", UPCAST=False, USE_DESC=desc, BLOCK_SEG=16,
                      BLOCK_SRC=2, BLOCK_E=8, PACK=pack, VARIANT=variant, SPLIT=True)
        if not desc:
            consts.update(x_desc=None, wg_desc=None, wu_desc=None, p_desc=None)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=warps, num_stages=stages)
        aligned = ["x_ptr", "wg_ptr", "wu_ptr", "h_ptr", "p_ptr", "I", "H", "stride_xm",
                   "stride_we", "stride_wk", "stride_hm", "stride_pm"]
        name = (f"expert_swiglu[{dt}{', descriptors' if desc else ''}"
                f"{', packed experts' if pack else ''}"
                f"{('', ', light variant', ', heavy variant')[variant]}]")
        yield name, expert_swiglu_kernel, sig, consts, aligned
    sig = {"x_ptr": "*bf16", "counts_ptr": "*i32", "p_ptr": "*bf16", "map_ptr": "*i32",
           **dict(kv.split(":") for kv in "H:i32 n_src:i32 E:i32 cap:i32 n_rows:i32 stride_xm:i32 "
                                          "stride_xk:i32 stride_pm:i32".split())}
    consts = dict(BLOCK_M=64, BLOCK_SRC=8, BLOCK_E=2, PACK=1, BLOCK_R=PACK_BLOCK_R,
                  BLOCK_H=PACK_BLOCK_H)
    sig.update({k: "constexpr" for k in consts})
    consts.update(num_warps=4)
    yield ("expert_swiglu pack_rows[bf16]", pack_rows_kernel, sig, consts,
           ["x_ptr", "p_ptr", "H", "stride_xm", "stride_pm"])
