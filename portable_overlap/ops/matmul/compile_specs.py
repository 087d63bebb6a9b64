"""Representative compile signatures of the persistent matmul for the compile matrix."""
from .kernel import persistent_matmul_kernel

_ARGS = ("M:i32 N:i32 K:i32 stride_am:i32 stride_ak:i32 stride_bk:i32 stride_bn:i32 "
         "stride_cm:i32 stride_cn:i32 G:i32")


def specs():
    for dt, prec, bm, bn, bk in (("bf16", "tf32", 128, 256, 64), ("fp16", "tf32", 128, 128, 64),
                                 ("fp32", "ieee", 64, 64, 32)):
        sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "c_ptr": f"*{dt}"}
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=3, EVEN_K=True,
                      PRECISION=prec, UPCAST=False)
        sig.update({k: "constexpr" for k in consts})
        aligned = ["a_ptr", "b_ptr", "c_ptr", "K", "N", "stride_am", "stride_bk", "stride_cm"]
        yield f"persistent_matmul[{dt}]", persistent_matmul_kernel, sig, consts, aligned
