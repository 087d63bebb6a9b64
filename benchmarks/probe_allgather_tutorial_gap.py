"""Probe: why did ``AllGatherMatmul(transport="stores")`` time 8-14 % behind tutorial 3's kernel
(docs/tutorials/03_allgather_gemm.py) at (4096, 8192, 16384), bf16, one rank on one H100
(benchmarks/bench_tutorials.py), with the same tiles, registers and grid? At one rank both read
``a`` through its descriptor in the same grouped tile order (``order`` is the identity: checked)
and wait for nothing; their K loops compile to the same SASS (``sass`` entry). Left: a few
instructions per tile, the op's ``out`` made per call, its host path, and when each was timed
(bench_tutorials: tutorial, then cuBLAS, then the op, one block of 30 each).

Per shape (default 4096x8192x16384 and the control 8192x8192x8192), every variant checked against
``torch.matmul(all_gather(a), b)`` first, then timed twice:

- ``bench_order``: the bench's blocks (``harness.time_op``, graphs, 30 after 5 warm-ups) in its
  order (tutorial, sequential, op), then in the reverse order;
- ``interleaved``: each variant captured once (and plain launches), ``--rounds`` rounds of
  ``--iters`` calls each, the order rotated every round; SM clock, power, temperature and
  clock-limit reasons read while each block runs (NVML or nvidia-smi). ``tutorial``: the
  tutorial's kernel and launch; ``op``: ``ctx(a, b)``
  (the bench's call, a new ``out`` per call); ``op_out``: ``out=`` given; ``plan``: the op's
  planned launch called with arguments made once (no host checks, descriptors made once);
  ``cublas``: ``torch.matmul`` of the gathered rows (the clock anchor).

    torchrun --nproc-per-node 1 -m benchmarks.probe_allgather_tutorial_gap --out DIR
    python -m benchmarks.probe_allgather_tutorial_gap --sass-only --out DIR   # CPU: SASS only

Writes DIR/probe_allgather_tutorial_gap.json and the kernels' SASS; prints a table last.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import statistics
import subprocess
import sys

import torch
import triton

from benchmarks.bench_tutorials import load_tutorial
from benchmarks.cli import parse_shapes
from benchmarks.harness import _quantile, time_op
from benchmarks.rows import git_commit
from portable_overlap import collectives

VARIANTS = ("tutorial", "op", "op_out", "plan", "cublas")


# -- SASS: do the two kernels' K loops differ? ---------------------------------------------------
def _norm(line: str) -> str:  # registers, immediates, labels and addresses out
    line = re.sub(r"\bU?R\d+\b", "R", re.sub(r"/\*[0-9a-f]+\*/|;.*", "", line))
    return " ".join(re.sub(r"0x[0-9a-f]+|\.L_x_\d+", "X", re.sub(r"\bU?P\d\b", "P", line)).split())


def k_loop(sass: str) -> list:
    """The normalized lines of the loop holding the first HGMMA (the GEMM main loop): from the
    label a later branch jumps back to, to that branch."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    first = next((i for i, l in enumerate(lines) if "HGMMA" in l), None)
    if first is None:
        return []
    for i in range(first, len(lines)):
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", lines[i])
        if m and labels.get(m.group(1), len(lines)) < first:
            return [_norm(ln) for ln in lines[labels[m.group(1)] + 1:i + 1] if _norm(ln)]
    return []


def sass_of(compiled, path: str) -> dict:
    """SASS of a compiled kernel (nvdisasm of its cubin, written to ``path``) and its counts."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    open(path + ".cubin", "wb").write(compiled.asm["cubin"])
    text = subprocess.run([nvdisasm, "-c", path + ".cubin"], capture_output=True, text=True,
                          check=True).stdout
    open(path + ".sass", "w").write(text)
    info = {"instructions": len(re.findall(r"\n\s+/\*[0-9a-f]+\*/", text)),
            "shared": compiled.metadata.shared}
    try:
        compiled._init_handles()  # needs a GPU
        info.update(regs=compiled.n_regs, spills=compiled.n_spills)
    except Exception:
        pass
    return {"info": info, "loop": k_loop(text)}


def compare_sass(lib: dict, tut: dict) -> dict:
    a, b = lib.pop("loop"), tut.pop("loop")
    diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0)
            if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    return {"library": lib["info"], "tutorial": tut["info"], "loop_lines": [len(a), len(b)],
            "loop_identical": a == b and bool(a), "loop_same_instructions": sorted(a) == sorted(b),
            "loop_diff": diff[:40]}


def sass_offline(out: str, tut) -> dict:
    """Both kernels compiled for sm_90 on this machine (no GPU) at the bench's tiles."""
    from portable_overlap.kernel_registry import compile_spec
    from portable_overlap.ops.allgather_gemm.compile_specs import specs

    target = ("cuda", 90, 32)
    _, fn, sig, consts, aligned = next(s for s in specs()
                                       if s[0] == "allgather_gemm[bf16, descriptors, joined]")
    lib = compile_spec(fn, sig, consts, aligned, target, num_warps=8, num_stages=3)
    tconsts = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, STAGES=3, EVEN_K=True,
                   COPY=8192, USE_DESC=True, JOIN=True)
    same = {"gathered_ptr": "gather_ptr", "free_ptr": "consumed_ptr",  # its names for the same
            "claim_ptr": "tile_ptr"}
    tsig = {n: sig[same.get(n, n)] for n in tut.allgather_gemm_kernel.arg_names
            if n not in tconsts}  # the library spec's types, descriptor blocks included
    tsig.update({k: "constexpr" for k in tconsts})
    taligned = [k for k, v in tsig.items() if v[0] == "*"] + ["m", "N", "K", "chunk_rows"]
    tk = compile_spec(tut.allgather_gemm_kernel, tsig, tconsts, taligned, target, num_warps=8,
                      num_stages=3)
    return compare_sass(sass_of(lib, f"{out}/library_sm90"), sass_of(tk, f"{out}/tutorial_sm90"))


# -- timing --------------------------------------------------------------------------------------
SMI_FIELDS = ("mhz", "watts", "celsius", "throttle")


def gpu_state(device):
    """Start reading the SM clock (MHz), power (W), temperature (C) and clock-limit reasons (a
    bit mask: 0x4 power cap, 0x20/0x40 thermal) while the GPU runs; returns a function that
    gives them as a dict. NVML through torch where it is installed, else ``nvidia-smi``."""
    try:
        got = dict(mhz=torch.cuda.clock_rate(device), watts=torch.cuda.power_draw(device) / 1e3,
                   celsius=torch.cuda.temperature(device), throttle=None)
        return lambda: got
    except Exception:  # no pynvml
        pass
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index)).split(",")[device.index]
    try:
        q = subprocess.Popen(["nvidia-smi", "-i", gpu, "--format=csv,noheader,nounits",
                              "--query-gpu=clocks.sm,power.draw,temperature.gpu,"
                              "clocks_throttle_reasons.active"], stdout=subprocess.PIPE, text=True)
    except Exception:
        return lambda: dict.fromkeys(SMI_FIELDS)

    def read():
        try:
            v = [x.strip() for x in q.communicate(timeout=30)[0].split(",")]
            return dict(zip(SMI_FIELDS, [float(v[0]), float(v[1]), float(v[2]), v[3]]))
        except Exception:
            return dict.fromkeys(SMI_FIELDS)
    return read


def runner(fn, graph: bool):
    if not graph:
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def interleaved(fns: dict, graph: bool, rounds: int, iters: int, tail: int, device) -> dict:
    """Rounds of ``iters`` timed calls per variant, the order rotated each round; ``tail``
    untimed calls after each block keep the GPU busy while its clock is read."""
    runs = {n: runner(f, graph) for n, f in fns.items()}
    names = list(runs)
    ms, per_round, state = ({n: [] for n in names} for _ in range(3))
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            runs[n](), runs[n]()  # untimed: the block's first calls
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
            for a, b in ev:
                a.record()
                runs[n]()
                b.record()
            read = gpu_state(device)  # while the block (and an untimed tail) runs
            for _ in range(tail):
                runs[n]()
            torch.cuda.synchronize()
            state[n].append(read())
            t = [a.elapsed_time(b) for a, b in ev]
            ms[n] += t
            per_round[n].append(round(statistics.median(t), 5))
    out = {}
    for n in names:
        mhz = [s["mhz"] for s in state[n] if s["mhz"] is not None]
        out[n] = {"median_ms": statistics.median(ms[n]), "p10_ms": _quantile(ms[n], 0.1),
                  "p90_ms": _quantile(ms[n], 0.9), "samples": len(ms[n]),
                  "per_round_ms": per_round[n], "state": state[n],
                  "median_mhz": statistics.median(mhz) if mhz else None}
    return out


def probe_shape(world, tut, M, N, K, args) -> dict:
    from portable_overlap import AllGatherMatmul, Workspace
    from portable_overlap.ops.context import align_key
    from portable_overlap.ops.matmul.api import default_config, tile_descriptors
    from portable_overlap.testing.compare import rel_err

    dev, W = world.device, world.world_size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # (interpreter: see 03)
    m = M // W
    g = torch.Generator(dev).manual_seed(world.rank)
    a = torch.randn(m, K, device=dev, generator=g).to(dtype)
    b = (torch.randn(K, N, device=dev, generator=torch.Generator(dev).manual_seed(7))
         / K ** 0.5).to(dtype)
    full = torch.empty(W * m, K, device=dev, dtype=dtype)
    gather = collectives.all_gather
    gather(full, a, group=world.group)
    ref = torch.matmul(full, b)
    outs = {n: torch.empty(W * m, N, device=dev, dtype=dtype) for n in VARIANTS}

    # the tutorial's kernel, set up and launched as its main() does
    cfg = default_config(dtype, dev)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 GROUP_M=cfg.group_m, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)
    chunk_rows = cfg.block_m * triton.cdiv(triton.cdiv(m, cfg.block_m), tut.MAX_CHUNKS)
    chunks = triton.cdiv(m, chunk_rows)
    flags = (((W, chunks), "ready"), ((W,), "free"), ((1,), "tiles"))
    ws = Workspace(world, Workspace.bytes_for(((W * m, K), dtype),
                                              *((sh, torch.int64) for sh, _ in flags)),
                   name="allgather_gemm")
    gathered = ws.tensor((W * m, K), dtype)
    ready, free, claimed = (ws.flags(sh, name) for sh, name in flags)
    senders = min(max(1, ws.sm_count * (W - 1) // (4 * W)), (W - 1) * chunks, ws.sm_count - 1)
    a_desc, b_desc = tile_descriptors(a, b, cfg, world.facts)
    g_desc = tile_descriptors(gathered, b, cfg, world.facts)[0]

    def launch_tutorial():
        return ws.launch(tut.allgather_gemm_kernel, (ws.sm_count,), a, b, outs["tutorial"],
                         gathered, ready, free, claimed, a_desc, g_desc, b_desc, m, N, K,
                         chunk_rows, senders, EVEN_K=K % cfg.block_k == 0, COPY=8192,
                         USE_DESC=a_desc is not None, JOIN=W > 1, **tiles)

    ctx = AllGatherMatmul(world, m * K, transport="stores")
    impl = ctx.impl
    ctx(a, b, outs["op_out"])  # plans the launch for these tensors
    plan = impl._plans[(m, K, N, a.dtype, b.stride(), align_key(a, b, outs["op_out"]))]
    plan_args = impl._args(a, b, outs["op_out"], plan)
    fns = {
        "tutorial": lambda: (launch_tutorial(), outs["tutorial"])[1],
        "op": lambda: ctx(a, b),
        "op_out": lambda: ctx(a, b, outs["op_out"]),
        "plan": lambda: (plan(plan_args), outs["op_out"])[1],
        "cublas": lambda: torch.matmul(full, b, out=outs["cublas"]),
    }
    errs = {}
    for n, f in fns.items():
        for o in outs.values():  # a variant that skips a tile shows
            o.fill_(float("nan"))
        errs[n] = rel_err(f(), ref)
    ws.check()
    ctx.check()
    bad = {n: e for n, e in errs.items() if not e < 1e-2}
    if bad:
        raise SystemExit(f"{M}x{N}x{K}: wrong results, not timed: {bad}")

    res = {"shape": {"M": M, "N": N, "K": K}, "rel_err": errs, "programs": plan.programs,
           "senders": plan.senders, "tutorial_senders": senders, "chunk_rows": chunk_rows,
           "order_is_identity": plan.order.tolist() == list(range(plan.order.numel())),
           "config": repr(cfg)}
    try:
        res["sass"] = compare_sass(sass_of(plan.compiled, f"{args.out}/library_{M}x{N}x{K}"),
                                   sass_of(launch_tutorial(), f"{args.out}/tutorial_{M}x{N}x{K}"))
    except Exception as e:
        res["sass"] = {"error": f"{type(e).__name__}: {e}"}

    def sequential():
        gather(full, a, group=world.group)
        return full @ b

    fns_seq = dict(fns, sequential=sequential)
    res["bench_order"] = {label: {n: time_op(fns_seq[n], world, graph=True, iters=30, warmup=5)
                                  for n in order}
                          for label, order in (("forward", ("tutorial", "sequential", "op")),
                                               ("reverse", ("op", "sequential", "tutorial")))}
    res["interleaved"] = {("graph" if gr else "plain"):
                          interleaved(fns, gr, args.rounds, args.iters, args.tail, dev)
                          for gr in (True, False)}
    ws.close()
    ctx.close()
    return res


def table(results: list) -> str:
    lines = [f"{'shape':>17} {'mode':>5} {'variant':>8} {'median ms':>9} {'p10':>7} {'p90':>7} "
             f"{'/tutorial':>9} {'MHz':>5}"]
    for r in results:
        s = "x".join(str(v) for v in r["shape"].values())
        for mode, rows in r["interleaved"].items():
            t0 = rows["tutorial"]["median_ms"]
            for n, x in rows.items():
                lines.append(f"{s:>17} {mode:>5} {n:>8} {x['median_ms']:9.4f} {x['p10_ms']:7.4f} "
                             f"{x['p90_ms']:7.4f} {x['median_ms'] / t0:9.3f} "
                             f"{x['median_mhz'] or float('nan'):5.0f}")
        for label, rows in r["bench_order"].items():
            ratio = rows["op"]["median_ms"] / rows["tutorial"]["median_ms"]
            lines.append(f"{s:>17} bench order {label}: " + ", ".join(
                f"{n} {x['median_ms']:.4f}" for n, x in rows.items())
                + f"; op/tutorial {ratio:.3f}")
        sa = r.get("sass", {})
        lines.append(f"{s:>17} SASS: K loop identical {sa.get('loop_identical')}, "
                     f"{sa.get('library')} vs {sa.get('tutorial')}, order identity "
                     f"{r['order_is_identity']}, programs {r['programs']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the JSON and the SASS")
    p.add_argument("--shapes", default="4096x8192x16384,8192x8192x8192")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=20, help="timed calls per variant per round")
    p.add_argument("--tail", type=int, default=40, help="untimed calls after each block")
    p.add_argument("--sass-only", action="store_true", help="compile for sm_90 here, no GPU")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tut = load_tutorial("03_allgather_gemm.py")
    path = os.path.join(args.out, "probe_allgather_tutorial_gap.json")
    if args.sass_only:
        r = sass_offline(args.out, tut)
        json.dump(r, open(path, "w"), indent=1)
        print(json.dumps({k: v for k, v in r.items() if k != "loop_diff"}), r["loop_diff"][:10])
        return 0
    from portable_overlap import World

    world = World.from_env()
    results = []
    try:
        for shape in parse_shapes(args.shapes, ("M", "N", "K")):
            results.append(probe_shape(world, tut, shape["M"], shape["N"], shape["K"], args))
            if world.rank == 0:
                with open(path, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(world.device),
                               "world": world.world_size, "commit": git_commit(),
                               "torch": torch.__version__, "triton": triton.__version__,
                               "results": results}, f, indent=1)
        if world.rank == 0:
            print(table(results), flush=True)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
