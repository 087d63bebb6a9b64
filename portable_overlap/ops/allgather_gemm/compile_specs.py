"""Representative compile signatures of the ``"stores"`` AllGather + GEMM kernel for the
compile matrix: the device's bf16 tiles with and without descriptors (of b, or of b.t() for a
transposed weight), with and without the own shard's copy (a shard height off the tile), with
and without joined senders and copy-engine pulls, two copy blocks, bulk copies (tensor
descriptors of boxes of a and of the peer's rows), and fp32. At the options of the launches of
their tiles (``matmul.api.tile_config``): the H200 bf16 tile over 8 warps (sm_90), fp32 over 4;
3 stages; the 64 x 128 tile of products too small for the full one over 8 warps, with or
without descriptors (``matmul.api.SMALL_TILE_POINTERS``: the senders share the launch's
warps)."""
from ..matmul.compile_specs import descriptor_signature, fused_tile_launch, tile_launch
from .kernel import allgather_gemm_kernel

_ARGS = ("m:i32 N:i32 K:i32 stride_bk:i32 stride_bn:i32 chunk_rows:i32 n_chunks:i32 "
         "n_pull:i32 senders:i32 tag:i32")


def specs():
    for dt, prec, bm, bn, bk, desc, bt, copy_own, join, copy, pulls, bulk in (
            ("bf16", "ieee", 128, 256, 64, False, False, False, False, 8192, False, False),
            ("bf16", "ieee", 128, 256, 64, True, False, False, True, 8192, False, False),
            ("bf16", "ieee", 128, 256, 64, True, False, False, True, 8192, False, True),
            ("bf16", "ieee", 128, 256, 64, True, False, False, True, 8192, True, False),
            ("bf16", "ieee", 128, 256, 64, True, True, True, True, 32768, True, True),
            ("fp32", "ieee", 64, 64, 32, False, False, True, True, 8192, False, False),
            ("bf16", "ieee", 64, 128, 64, True, False, True, True, 8192, False, True)):
        sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}",
               "gather_ptr": f"*{dt}", "ready_ptr": "*i64", "consumed_ptr": "*i64",
               "tile_ptr": "*i64", "ctx": "*i64", "order_ptr": "*i32"}
        sig.update(dict(kv.split(":") for kv in _ARGS.split()))
        ds = descriptor_signature(dt, bm, bn, bk, desc)
        sig.update(ds)
        sig["g_desc"] = ds["a_desc"]
        if bt:  # blocks of b.t(), [bn, bk]
            sig["b_desc"] = f"tensordesc<{dt}[{bn}, {bk}]>"
        consts = dict(USE_DESC=desc, B_TRANS=bt, COPY_OWN=copy_own, JOIN=join, PULLS=pulls,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_STAGES=3, EVEN_K=True,
                      PRECISION=prec, UPCAST=False, COPY_BLOCK=copy,
                      VEC=8 if dt == "bf16" else 4, C_MAX=1024, COPY_TMA=bulk,
                      BOX_R=128 if bm % 128 == 0 else 64, BOX_K=256 if dt == "bf16" else 128)
        if not desc:
            consts.update(a_desc=None, g_desc=None, b_desc=None)
        sig.update({k: "constexpr" for k in consts})
        small = bn == 128 and dt == "bf16"  # a product too small for the full tile
        consts.update(fused_tile_launch(bm, bn, bk, descriptors=False) if small
                      else tile_launch(bm, bn, bk))
        aligned = ["a_ptr", "b_ptr", "out_ptr", "gather_ptr", "K", "N", "stride_bk"]
        yield (f"allgather_gemm[{dt}{f' {bm}x{bn}' if small else ''}"
               f"{', descriptors' if desc else ''}"
               f"{' of b.t()' if bt else ''}"
               f"{', own copy' if copy_own else ''}{', joined' if join else ''}"
               f"{f', copy {copy}' if copy != 8192 else ''}{', pulls' if pulls else ''}"
               f"{', bulk copies' if bulk else ''}]",
               allgather_gemm_kernel, sig, consts, aligned)
