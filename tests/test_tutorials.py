"""Every tutorial in docs/tutorials runs on CPU-emulated ranks (as a user would start it: a
plain ``python`` command) and reports that its result matched torch on every rank."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "docs", "tutorials", "[0-9]*.py")))
# the first two (no GEMM) are cheap enough to run on 4 ranks too
FOUR_RANKS = [t for t in TUTORIALS if os.path.basename(t)[:2] in ("01", "02")]


def _run(path, ranks):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PORTABLE_OVERLAP_EMULATED_RANKS=str(ranks))
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, path], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "right on every rank: True" in out.stdout, out.stdout[-3000:]
    assert f"over {ranks} ranks" in out.stdout or f"{ranks} ranks" in out.stdout, out.stdout
    return out.stdout


def test_there_are_tutorials():
    names = [os.path.basename(t) for t in TUTORIALS]
    assert names[:2] == ["01_ping_pong.py", "02_all_gather.py"], names


@pytest.mark.emulated(ranks=2)
@pytest.mark.parametrize("path", TUTORIALS, ids=os.path.basename)
def test_tutorial_on_two_ranks(path):
    _run(path, 2)


@pytest.mark.emulated(ranks=4)
@pytest.mark.parametrize("path", FOUR_RANKS, ids=os.path.basename)
def test_tutorial_on_four_ranks(path):
    _run(path, 4)


def test_tutorials_stay_short():
    for path in TUTORIALS:
        with open(path) as f:
            lines = len(f.read().splitlines())
        assert lines <= 150, f"{os.path.basename(path)} has {lines} lines (a tutorial stays "\
                             f"under 150)"


def test_emulated_ranks_override_is_range_checked(monkeypatch):
    from portable_overlap.testing import run_on_ranks

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("PORTABLE_OVERLAP_EMULATED_RANKS", "0")
    with pytest.raises(ValueError, match="PORTABLE_OVERLAP_EMULATED_RANKS='0'"):
        run_on_ranks(print)


def _module(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tutorial_" + os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernels_read_only_constexpr_globals():
    """The interpreter lets a kernel read any module global; the GPU compiler accepts only
    ``tl.constexpr`` ones (and functions, modules): a tutorial that passes on emulated ranks
    must not fail to compile on a GPU for that."""
    import inspect
    import types

    import triton
    import triton.language as tl

    for path in TUTORIALS:
        mod = _module(path)
        for name, fn in vars(mod).items():
            if not isinstance(fn, triton.runtime.JITFunction):
                continue
            for g in fn.fn.__code__.co_names:
                value = fn.fn.__globals__.get(g, None)
                allowed = (tl.constexpr, types.ModuleType, triton.runtime.JITFunction)
                ok = value is None or isinstance(value, allowed) or inspect.isfunction(value) \
                    or inspect.isclass(value) or inspect.isbuiltin(value)
                assert ok, (f"{os.path.basename(path)}: {name} reads the global {g} = "
                            f"{value!r}; make it a tl.constexpr")


def _bench_tutorials_on_rank(world, argv):
    """One emulated rank of benchmarks/bench_tutorials.py, the protocol's timer replaced (no
    GPU): each path runs once and is given 1 ms."""
    import benchmarks.harness as harness
    from benchmarks import bench_tutorials, runner

    def fake_time_op(fn, world, *, graph, iters, warmup, barrier):
        assert graph and (iters, warmup, barrier) == (50, 1, "device")
        fn()
        return {"median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.1}

    harness.time_op = fake_time_op
    return bench_tutorials.body(runner.Bench(bench_tutorials.parser().parse_args(argv), world))


@pytest.mark.emulated(ranks=2)
def test_tutorial_benchmark_writes_rows(tmp_path, monkeypatch):
    """benchmarks/bench_tutorials.py runs each tutorial's main() as written, times its paths with
    the protocol's timer and writes a row per path, named by role, at the shapes that split."""
    import json

    from benchmarks.bench_tutorials import TUTORIALS
    from portable_overlap.testing import run_on_ranks

    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "r.jsonl"
    argv = ["--out", str(out), "--device-kind", "cpu", "--shapes", "74x50x58,75x50x58",
            "--dtypes", "fp32", "--iters", "50", "--warmup", "1"]
    assert run_on_ranks(_bench_tutorials_on_rank, argv, ranks=2) == [0, 0]
    rows = [json.loads(line) for line in open(out)]
    got = sorted((r["op"], r["impl"], r["correct"]) for r in rows)
    assert got == sorted((op, impl, True if impl == "tutorial" else None)
                         for op in TUTORIALS for impl in ("tutorial", "sequential"))
    assert all(r["world"] == 2 and r["shape"] == {"M": 74, "N": 50, "K": 58} and r["graph"]
               for r in rows)  # 75 rows do not split 2 ways: skipped


def test_time_paths_rotates_the_order():
    """The tutorials' timer runs every path in rounds whose order rotates, so no path is always
    timed after the same others (a fixed order made the last path 9-13% slower on one H100)."""
    import types

    import torch

    from portable_overlap.testing import time_paths

    world = types.SimpleNamespace(device=torch.device("cpu"), barrier=lambda: None,
                                  all_gather_object=lambda x: [x])
    calls = []
    paths = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    ms = time_paths(paths, world, iters=3, warmup=0, rounds=3)
    assert calls == list("abcbcacab") and set(ms) == set("abc")
    calls.clear()
    time_paths(paths, world, iters=4, warmup=1, rounds=2)  # 2 rounds of 2 runs, 1 warm-up each
    assert calls == list("aaabbbcccbbbcccaaa")


def _tutorial_kernels():
    """(id, jit function) of every Triton kernel the tutorials define."""
    import importlib.util

    import triton

    for path in TUTORIALS:
        name = os.path.basename(path)[:-3]
        spec = importlib.util.spec_from_file_location(f"tutorial_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # (main() runs under __name__ == "__main__" only)
        for attr, fn in sorted(vars(mod).items()):
            if isinstance(fn, triton.runtime.JITFunction) and fn.fn.__module__ == mod.__name__:
                yield f"{name}.{attr}", fn


#: the launch values of the tutorials' kernels that are not GEMMs (row_rstd's BLOCK_K on GPUs)
_SMALL = dict(BLOCK_R=16, BLOCK_K=256, BLOCK=1024, ROUNDS=3, CHUNK=8192)
_FLAGS = ("ctx", "ready_ptr", "free_ptr", "arrived_ptr", "claim_ptr", "flags_ptr")


def _launch(fn, warp_size: int, desc: bool):
    """The tutorial kernel's compile signature, constexprs and launch options as the tutorial
    launches it on a device of ``warp_size`` lanes: a GEMM kernel (one with ``BLOCK_M``) at the
    device's bf16 tiling (``ops.matmul.api.tile_config``, as ``default_config`` gives the
    tutorials), the others at Triton's default options. Types by the tutorials' naming: flags
    and counters int64, data bf16, ``rstd`` fp32, ``*_desc`` tensor descriptors of A-side
    [BLOCK_M, BLOCK_K] or B-side (``b``, ``w``) [BLOCK_K, BLOCK_N] blocks."""
    from types import SimpleNamespace

    import torch

    from portable_overlap.ops.matmul.api import tile_config

    cfg = tile_config(torch.bfloat16, SimpleNamespace(warp_size=warp_size))
    gemm = "BLOCK_M" in fn.arg_names
    values = dict(_SMALL)
    options = {}
    if gemm:
        values.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m, STAGES=cfg.num_stages, EVEN_K=True, COPY=8192,
                      JOIN=True, USE_DESC=desc)
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    sig, consts = {}, {}
    for p in fn.params:
        n = p.name
        if p.is_constexpr:
            consts[n] = values[n]
            sig[n] = "constexpr"
        elif n.endswith("_desc"):
            shape = ((cfg.block_k, cfg.block_n) if n[0] in "bw"
                     else (cfg.block_m, cfg.block_k))
            sig[n] = f"tensordesc<bf16[{shape[0]}, {shape[1]}]>" if desc else "constexpr"
            if not desc:
                consts[n] = None
        elif n in _FLAGS:
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n.startswith("rstd") else "*bf16"
        else:
            sig[n] = "fp32" if n == "eps" else "i32"
    return sig, consts, options


_KERNELS = list(_tutorial_kernels())


@pytest.mark.parametrize("target", [("cuda", 90, 32), ("hip", "gfx942", 64)],
                         ids=["cuda-90", "hip-gfx942"])
@pytest.mark.parametrize("kernel", _KERNELS, ids=[k[0] for k in _KERNELS])
def test_tutorial_kernels_compile(kernel, target):
    """Each tutorial kernel compiles for sm_90 with tensor descriptors (the path an H100 / H200
    takes) and for gfx942 with pointer loads, at the tiles and options it is launched with
    there: the interpreter runs neither path's typing rules (a 64-bit descriptor offset passed
    it and failed on the GPU)."""
    from portable_overlap.kernel_registry import compile_spec

    name, fn = kernel
    sig, consts, options = _launch(fn, target[2], desc=target[0] == "cuda")
    compiled = compile_spec(fn, sig, consts, [], target, **options)
    assert compiled.asm.get("cubin" if target[0] == "cuda" else "hsaco"), name


def _tutorial_main(world, name, kwargs):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tutorial_" + name[:2], os.path.join(ROOT, "docs", "tutorials", name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main(world, **kwargs)


@pytest.mark.emulated(ranks=2)
def test_the_reduce_scatter_tutorial_with_fewer_rows_than_ranks(world2):
    """M = 1 over 2 ranks: rank 1's block has no rows, and its error check (the max of an
    empty difference) raised there, leaving rank 0 to time out in the next call."""
    codes = world2.run(_tutorial_main, "04_gemm_reduce_scatter.py", {"M": 1, "N": 5, "K": 7},
                       timeout=300)
    assert codes == [0, 0], codes
