"""The demo and the examples run (on CPU-emulated ranks here) and report agreement."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# the demo and the examples start a 2-rank emulated world of their own in the subprocess
emulated2 = pytest.mark.emulated(ranks=2)


@emulated2
def test_main_demo():
    out = _run(["-m", "portable_overlap", "demo", "--cpu"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "correct on every rank" in out.stdout
    assert out.stdout.count("True") >= 6  # bitwise identical on the ranks, every row


def test_env_report():
    out = _run(["-m", "portable_overlap", "env"])
    assert out.returncode == 0, out.stderr
    assert "selected backend" in out.stdout


@emulated2
def test_transformer_decode_example():
    out = _run([os.path.join("examples", "transformer", "decode.py"), "--layers", "1"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "outputs agree" in out.stdout


@emulated2
@pytest.mark.parametrize("schedule", ["staged", "one_launch"])
def test_moe_layer_example(schedule):
    out = _run([os.path.join("examples", "moe", "moe_layer.py"), "--schedule", schedule])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "they agree" in out.stdout and f"schedule {schedule}" in out.stdout


@emulated2
def test_dlrm_example():
    """The default CPU run: a few steps, progress printed from the set-up on."""
    out = _run([os.path.join("examples", "dlrm", "train.py")])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "paths agree" in out.stdout and "samples/s" in out.stdout
    order = [out.stdout.find(s) for s in ("starting 2 CPU-emulated ranks", "set-up done in",
                                          "step 1/3: fused loss", "step 3/3", "DLRM: 26 tables")]
    assert -1 not in order and order == sorted(order), out.stdout


@emulated2
def test_dlrm_example_with_a_rank_that_owns_no_samples():
    """A global batch of 1 on 2 ranks (split [1, 0]): rank 1's embedding output has no rows,
    which the interaction's view(b, -1, D) could not reshape."""
    out = _run([os.path.join("examples", "dlrm", "train.py"), "--batch", "1", "--steps", "2"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "split [1, 0]" in out.stdout and "paths agree" in out.stdout


@emulated2
@pytest.mark.parametrize("transport", ["copy_engine", "stores"])
def test_transformer_prefill_example(transport):
    out = _run([os.path.join("examples", "transformer", "prefill.py"), "--layers", "1",
                "--seq", "8", "--transport", transport])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "outputs agree" in out.stdout and "max abs diff" in out.stdout
    assert f"transport {transport!r}" in out.stdout


@pytest.mark.parametrize("ranks", ["0", "-1", "x"])
def test_main_demo_refuses_a_rank_count_below_one(ranks):
    """No rank: the demo took the GPU path (0 GPUs >= 0 ranks) and waited 600 s for rows."""
    out = _run(["-m", "portable_overlap", "demo", "--ranks", ranks], timeout=60)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "argument --ranks: must be an integer >= 1" in out.stderr, out.stderr


def test_run_demo_refuses_a_rank_count_below_one():
    from portable_overlap.demo import run_demo

    for ranks in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="ranks must be an int >= 1"):
            run_demo(force_cpu=True, ranks=ranks)


def test_gpu_demo_ends_at_once_when_a_rank_fails():
    """A rank that raised left the GPU demo waiting 600 s for rank 0's rows (rank 0 waiting
    in NCCL for it); now the failure ends the wait and the other ranks are stopped."""
    import multiprocessing as mp
    import time

    from portable_overlap.demo import collect_rows

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    waiting = ctx.Process(target=time.sleep, args=(120,))  # rank 0, stuck in a collective
    failing = ctx.Process(target=sys.exit, args=(3,))
    procs = [waiting, failing]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="demo rank 1 exited with code 3"):
        collect_rows(q, procs, limit_s=100, poll_s=0.2)
    assert time.monotonic() - t0 < 30
    assert waiting.exitcode is not None and waiting.exitcode != 0  # stopped, not left behind

    q = ctx.Queue()
    procs = [ctx.Process(target=q.put, args=([("row",)],)), ctx.Process(target=sys.exit, args=(0,))]
    for p in procs:
        p.start()
    assert collect_rows(q, procs, limit_s=60, poll_s=0.2) == [("row",)]

    procs = [ctx.Process(target=time.sleep, args=(120,))]
    procs[0].start()
    with pytest.raises(TimeoutError, match="did not end within"):
        collect_rows(ctx.Queue(), procs, limit_s=1, poll_s=0.2)
    assert procs[0].exitcode is not None


def test_env_report_names_a_bad_override_without_a_traceback():
    env = dict(os.environ, PYTHONPATH=ROOT, PORTABLE_OVERLAP_BACKEND="bogus")
    out = subprocess.run([sys.executable, "-m", "portable_overlap", "env"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "PORTABLE_OVERLAP_BACKEND='bogus' names no backend" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name, value, says", [
    ("PORTABLE_OVERLAP_CPU_WAIT_TIMEOUT", "nan", "finite number > 0"),
    ("PORTABLE_OVERLAP_EMULATED_RANKS", "-1", "integer in 1 .. 64"),
    ("PORTABLE_OVERLAP_TUNING_CACHE", ROOT, "names a directory"),
])
def test_env_report_checks_every_override_it_lists(name, value, says):
    """Overrides the report's own queries do not read (the stream waits' timeout, the emulated
    ranks of a script, the tuning cache) printed a clean report with exit code 0 when set to a
    value the library refuses at its first use."""
    env = dict(os.environ, PYTHONPATH=ROOT, **{name: value})
    out = subprocess.run([sys.executable, "-m", "portable_overlap", "env"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{name}={value!r}" in out.stdout and says in out.stderr, out.stdout + out.stderr
    assert "selected backend" in out.stdout and "Traceback" not in out.stderr


@pytest.mark.parametrize("script, argv", [
    ("transformer/decode.py", ["--layers", "0"]),  # no layer: "outputs agree", comparing x to x
    ("transformer/decode.py", ["--tokens", "0"]),
    ("transformer/decode.py", ["--batch", "-1"]),
    ("transformer/prefill.py", ["--seq", "0"]),
    ("transformer/prefill.py", ["--iters", "x"]),
    ("moe/moe_layer.py", ["--iters", "0"]),
    ("dlrm/train.py", ["--steps", "-1"]),  # no step ran and the paths "agreed"
    ("dlrm/train.py", ["--batch", "-16"]),
])
def test_example_flags_refuse_counts_out_of_range(script, argv):
    out = _run([os.path.join("examples", script), *argv], timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"argument {argv[0]}: must be an integer >=" in out.stderr, out.stderr


def test_prefill_refuses_a_sequence_the_ranks_cannot_split():
    """``--seq 3`` on 2 ranks: every rank raised the ValueError with a traceback, exit code 1."""
    out = _run([os.path.join("examples", "transformer", "prefill.py"), "--seq", "3"],
               timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "argument --seq: 3 tokens must divide by the world size 2" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name,value,says", [
    ("PORTABLE_OVERLAP_CPU_SLOTS", "abc", "must be an integer"),
    ("PORTABLE_OVERLAP_BACKEND", "bogus", "names no backend"),
])
def test_main_demo_refuses_a_bad_override_as_env_does(name, value, says):
    """A bad override raised in every rank's process (two tracebacks, exit 1: the code of a
    wrong result), and a forced backend was replaced by the ranks' emulated one and ignored;
    the demo now checks the overrides as ``env`` does: exit 2 and the variable's name."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[name] = value
    out = subprocess.run([sys.executable, "-m", "portable_overlap", "demo", "--cpu"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert name in out.stderr and says in out.stderr and "Traceback" not in out.stderr, \
        out.stderr


def test_main_demo_refuses_more_emulated_ranks_than_one_machine_runs():
    """``--ranks 99999`` on a machine without that many GPUs started emulated ranks until the
    machine's open-file limit ended the demo with a traceback."""
    out = _run(["-m", "portable_overlap", "demo", "--cpu", "--ranks", "65"], timeout=60)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "error: demo: 65 CPU-emulated ranks asked for" in out.stderr, out.stderr
    assert "at most 64" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_an_emulated_world_refuses_a_size_out_of_range():
    from portable_overlap.testing import EmulatedWorld

    for size in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match=r"size must be an int in 1 \.\. 64"):
            EmulatedWorld(size)


def test_prefill_refuses_torch_fused_on_cpu_ranks():
    """torch's fused ops take GPU tensors only: every emulated rank raised BackendUnavailable
    with a traceback, exit code 1 (the examples' code of a wrong result)."""
    out = _run([os.path.join("examples", "transformer", "prefill.py"), "--transport",
                "torch_fused"], timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "argument --transport: 'torch_fused' needs GPUs" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def _run_as_torchrun_rank(args, world_size, timeout=120):
    """``args`` as rank 0 of a torchrun world of ``world_size`` CPU ranks, with no peers and no
    rendezvous address: only a refusal before the world is made ends it cleanly."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0",
               LOCAL_WORLD_SIZE=str(world_size), PORTABLE_OVERLAP_BACKEND="cpu")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("script, argv", [
    ("decode.py", ["--tiny"]),
    ("prefill.py", ["--tiny", "--seq", "9"]),  # --seq divides by 3: the heads do not
])
def test_transformer_examples_refuse_a_world_that_does_not_split_the_heads(script, argv):
    """3 ranks of the toy model (4 heads, 2 kv heads): every rank raised a ValueError with a
    traceback (``RowParallelLinear: in_features=64 must divide by the world size 3``)."""
    out = _run_as_torchrun_rank([os.path.join("examples", "transformer", script), *argv], 3)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert ("error: world size 3: the model's heads 4, kv_heads 2, intermediate 128 must "
            "divide by it") \
        in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_prefill_refuses_torch_fused_on_cpu_torchrun_ranks():
    out = _run_as_torchrun_rank([os.path.join("examples", "transformer", "prefill.py"),
                                 "--transport", "torch_fused"], 2)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "'torch_fused' needs GPUs" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("flag, value", [("--zipf", "nan"), ("--lr", "nan"), ("--lr", "inf")])
def test_dlrm_refuses_a_number_that_is_not_finite(flag, value):
    """``--lr nan`` made both paths' losses NaN: "PATHS DISAGREE", exit code 1 (a wrong
    result); ``--zipf nan`` ran on a distribution of NaN weights."""
    out = _run([os.path.join("examples", "dlrm", "train.py"), flag, value], timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"argument {flag}: must be a finite number, got {value!r}" in out.stderr, out.stderr


@pytest.mark.parametrize("script, says", [
    ("transformer/decode.py", ["3 on CPU", "at most 2 layers", "KV window of at most 16"]),
    ("transformer/prefill.py", ["2 on CPU", "at most 2 layers", "16 prompt tokens"]),
    ("moe/moe_layer.py", ["CPU ranks check the paths and time nothing"]),
])
def test_example_help_says_what_emulated_ranks_ignore_or_clamp(script, says):
    """On emulated ranks decode.py's --tokens and moe_layer.py's --iters were ignored, and the
    transformer examples' --layers, --seq and --cache clamped, without a word in --help."""
    out = _run([os.path.join("examples", script), "--help"], timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # (argparse wraps the lines)
    assert all(s in text for s in says), text
