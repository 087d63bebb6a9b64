"""Scratch probe (one GPU): the GEMM + ReduceScatter stores kernel's pieces, variant by variant,
against GEMM + All-to-All's kernel and persistent_matmul on the same operands (graph replay)."""
import sys
import torch
import portable_overlap as po
from portable_overlap import World
from portable_overlap.ops.gemm_alltoall import GemmAllToAll
from portable_overlap.ops.matmul import persistent_matmul
from portable_overlap.ops.matmul.api import operand_descriptors
from portable_overlap.ops.matmul_reduce.stores import MatmulReduceStores
from portable_overlap.tiles.gemv import dot_precision, dot_upcast
from portable_overlap.ops.context import G_MAX
import probe_rs_kernel as pk

def graph_us(fn, reps=50, rounds=15):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / reps)
    ts.sort()
    return ts[len(ts) // 2]

world = World.from_env()
dev = world.device
shapes = sys.argv[1] if len(sys.argv) > 1 else "64x1024x4096,128x3584x8192,256x8192x3584,2048x1024x8192,4096x3584x8192"
gen = torch.Generator(device=dev).manual_seed(0)
VARS = {"as_is": {}, "no_split": dict(SPLIT_OWN=False), "no_reload": dict(RELOAD=False),
        "no_step2": dict(STEP2=False), "plain_end": dict(CONSUMED_END=False),
        "bare": dict(SPLIT_OWN=False, RELOAD=False, STEP2=False, CONSUMED_END=False)}
for spec in shapes.split(","):
    M, N, K = (int(v) for v in spec.split("x"))
    a = torch.randn(M, K, generator=gen, device=dev).bfloat16()
    b = torch.randn(K, N, generator=gen, device=dev).bfloat16()
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    ref = (a.float() @ b.float())
    res = {}
    res["matmul"] = graph_us(lambda: persistent_matmul(a, b, out=out))
    res["cublas"] = graph_us(lambda: torch.mm(a, b, out=out))
    a2a = GemmAllToAll(world, max_elems=M * N)
    res["a2a_op"] = graph_us(lambda: a2a(a, b, out=out))
    rs = po.MatmulReduceScatter(world, M, N, transport="stores")
    res["rs_op"] = graph_us(lambda: rs(a, b, out=out))
    ctx = MatmulReduceStores(world, "probe_rs", "reduce_scatter", M, N)
    plan = ctx._plan(a, b, out, None, None)
    args = ctx._args(a, b, out, None, None, plan)
    cfg = plan.cfg
    _, _, b_trans = operand_descriptors(a, b, cfg, world.facts)
    consts = dict(ALL_REDUCE=False, HAS_BIAS=False, HAS_RES=False, USE_DESC=plan.use_desc,
                  B_TRANS=b_trans, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages, EVEN_K=K % cfg.block_k == 0,
                  PRECISION=dot_precision(a.dtype), UPCAST=dot_upcast(a.dtype), G_MAX=G_MAX,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    G = plan.programs
    for name, v in VARS.items():
        def launch(v=v):
            pk.matmul_reduce_stores_kernel[(G,)](*args, **consts, **v)
        out.fill_(float("nan"))
        launch(); torch.cuda.synchronize()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        k = pk.matmul_reduce_stores_kernel[(G,)](*args, **consts, **v)
        res[name] = graph_us(launch)
        res[name + "_regs"] = getattr(k, "n_regs", -1)
        res[name + "_spill"] = getattr(k, "n_spills", -1)
        res[name + "_err"] = err
    print(f"{spec} tile {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} desc={plan.use_desc} G={G}", flush=True)
    print("   " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
    ctx.close(); rs.close(); a2a.close()
