"""Representative compile signatures of the fused embedding + All-to-All for the compile matrix,
at the untuned tile (``fused.default_block_b`` off ``TUNED_TILE``) and its launch's options: one
stage, and the warps of ``fused.default_num_warps``. Where sm_90 has a measured entry of the same
tile (fp16 D=64, bf16 D=92) that is its 8 warps, the CUDA launch's (a gfx942 / gfx950 launch of
that tile takes 4); fp32 D=128 is 4 (sm_90 takes another tile there)."""
from typing import Optional

from .fused import default_block_b, default_num_warps
from .kernel import embedding_alltoall_kernel
from .lookup import pooled_lookup_kernel

_SCALARS = ("status_addr:i64 B:i32 D:i32 n_loc:i32 row_stride:i32 t_max:i32 iters:i32 G:i32 "
            "rank:i32 world:i32 tag:i32 timeout_us:i32")


def fused_spec(dt: str, idx: str, D: int, weighted: bool, mean: bool,
               arch: Optional[str] = None):
    """(signature, constexprs with launch options, aligned arguments) of the fused kernel at
    the tile and warps a launch on ``arch`` takes (``fused.default_block_b`` /
    ``default_num_warps``; None: the untuned tile and 4 warps, no arch's measured entry), one
    stage."""
    sig = {"weight_ptr": f"*{dt}", "indices_ptr": f"*{idx}", "psw_ptr": "*fp32",
           "offsets_ptr": "*i64", "out_ptr": f"*{dt}", "row_off_ptr": "*i64",
           "rows_ptr": "*i64", "gtab_ptr": "*i32", "ntab_ptr": "*i32", "boff_ptr": "*i32",
           "recv_ptr": f"*{dt}", "stage_ptr": f"*{dt}", "sent_ptr": "*i64",
           "consumed_ptr": "*i64", "ctl_ptr": "*i64", "clock_ptr": "*i64", "bases_ptr": "*i64"}
    sig.update(dict(kv.split(":") for kv in _SCALARS.split()))
    nbytes = 4 if dt == "fp32" else 2
    consts = dict(BLOCK_B=default_block_b(D, arch, nbytes), BLOCK_D=1 << (D - 1).bit_length(),
                  HAS_WEIGHTS=weighted, MEAN=mean, G_MAX=1024)
    sig.update({k: "constexpr" for k in consts})
    consts.update(num_warps=default_num_warps(D, arch, nbytes), num_stages=1)
    aligned = ["weight_ptr", "out_ptr", "recv_ptr", "offsets_ptr"]
    if D % 16 == 0:  # what the JIT specializes at run time (D and the row stride % 16)
        aligned += ["D", "row_stride"]
    return sig, consts, aligned


def specs():
    # fp32 D=128 sum (the benchmark's main shape), fp16 weighted, bf16 mean with a D that is not
    # a power of two (masked columns, no alignment hints on D); at the untuned tile, with
    # sm_90's measured warps where its tile is that one (tests/test_compile_configs.py compiles
    # every target's own picks)
    for dt, idx, D, weighted, mean in (("fp32", "i64", 128, False, False),
                                       ("fp16", "i32", 64, True, False),
                                       ("bf16", "i64", 92, False, True)):
        sig, consts, aligned = fused_spec(dt, idx, D, weighted, mean)
        nbytes = 4 if dt == "fp32" else 2
        if default_block_b(D, "sm_90", nbytes) == consts["BLOCK_B"]:
            consts["num_warps"] = default_num_warps(D, "sm_90", nbytes)
        yield (f"embedding_alltoall[{dt},D{D},w={weighted},mean={mean}]",
               embedding_alltoall_kernel, sig, consts, aligned)
    # the sequential transport's lookup (lookup.py): the same gather, no flags
    for dt, idx, D, weighted, mean in (("fp32", "i64", 128, False, False),
                                       ("bf16", "i32", 92, True, False)):
        sig = {"weight_ptr": f"*{dt}", "indices_ptr": f"*{idx}", "psw_ptr": "*fp32",
               "offsets_ptr": "*i64", "out_ptr": f"*{dt}", "row_off_ptr": "*i64",
               "rows_ptr": "*i64", "bad_ptr": "*i64", "B": "i32", "D": "i32",
               "row_stride": "i32"}
        block_d = 1 << (D - 1).bit_length()
        consts = dict(BLOCK_B=max(1, min(64, 4096 // block_d)), BLOCK_D=block_d,
                      HAS_WEIGHTS=weighted, MEAN=mean)
        sig.update({k: "constexpr" for k in consts})
        consts.update(num_warps=4, num_stages=1)
        yield (f"pooled_lookup[{dt},D{D},w={weighted}]", pooled_lookup_kernel, sig, consts,
               ["weight_ptr", "out_ptr", "offsets_ptr"])
