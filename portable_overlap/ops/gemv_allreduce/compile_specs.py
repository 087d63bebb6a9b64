"""Representative compile signatures of this op's kernels, for the compile matrix
(tests/test_compile_matrix.py compiles each for sm_90, gfx942 and gfx950 on a CPU-only machine):
the 64 x 128 tile of ``config.pick_config``'s widest band, launched over 4 warps with 4 stages
(``GemvConfig``, passed by ``api``'s launch), and the one-shot form's K split in two."""
from .kernel import gemv_allreduce_kernel

_PTRS = {"x_ptr": "*{dt}", "w_ptr": "*{dt}", "out_ptr": "*{dt}", "partial_ptr": "*fp32",
         "result_ptr": "*{dt}", "ready_ptr": "*i64", "bcast_ptr": "*i64", "ctx": "*i64"}
_SCALARS = ("M:i32 N:i32 K:i32 stride_xm:i32 stride_wn:i32 n_blocks:i32 G:i32 tag:i32 "
            "half_elems:i32")


def specs():
    for dt, prec in (("bf16", "ieee"), ("fp16", "ieee"), ("fp32", "ieee")):
        for block_m, even, one_shot, split in ((16, True, False, 1), (64, False, False, 1),
                                               (16, True, True, 1), (16, True, True, 2)):
            sig = {k: v.format(dt=dt) for k, v in _PTRS.items()}
            sig.update(dict(kv.split(":") for kv in _SCALARS.split()))
            consts = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, EVEN_K=even,
                          EVEN_N=even, PRECISION=prec, UPCAST=False, G_MAX=1024,
                          ONE_SHOT=one_shot, SPLIT_K=split)
            sig.update({k: "constexpr" for k in consts})
            consts.update(num_warps=4, num_stages=4)
            # what the JIT specializes at run time: 16-byte aligned pointers, K and strides % 16
            aligned = [*_PTRS, "K", "stride_xm", "stride_wn"] if even else [*_PTRS]
            yield (f"gemv_allreduce[{dt},BM{block_m},even={even}"
                   f"{',one_shot' if one_shot else ''}{f',split{split}' if split > 1 else ''}]",
                   gemv_allreduce_kernel, sig, consts,
                   aligned)
